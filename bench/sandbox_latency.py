"""Sandbox latency and throughput, side by side with a bare ``python3 -c`` subprocess.

Modes, all running the same trivial snippet with the same interpreter:
  bare     subprocess.run(python3 -c ...)            the floor: no isolation at all
  library  Executor().run(...) in this process       a cold sandbox (namespaces built per call)
  warm     Executor(warm_pool=N).run(...)            a pre-started sandbox, in process
  runner   POST /v1/exec to `posttrain sandbox serve` the production path: HTTP + a sandbox
                                                     from the warm pool (built ahead of time)
  cli      `posttrain sandbox exec -- python3 -c ...` one-shot CLI (pays Python start-up)

Latency: sequential executions, p50/p95. Throughput: many concurrent clients for a fixed
number of executions, executions per second, and how busy the machine's cores were meanwhile
(all processes: on a shared machine other load counts too). Prints a table and the ratios to
bare.

    .venv/bin/python bench/sandbox_latency.py [--n 200] [--cli-n 20] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from posttrain.sandboxes.client import SandboxClient
from posttrain.sandboxes.executor import SANDBOX_PATH, ExecRequest, ExecResult, Executor

SNIPPET = "print(sum(range(100)))"
PYTHON = shutil.which("python3", path=SANDBOX_PATH) or "python3"


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 0.5)
    2.0
    """
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def interleaved(
    calls: dict[str, Callable[[], object]], n: int, every: dict[str, int]
) -> dict[str, list[float]]:
    """Latency samples in ms, modes taking turns so background load hits all of them alike;
    mode m runs only every ``every[m]`` rounds (the CLI is ~100x slower). A short pause
    between calls lets the runner's warm pool refill, as it does between real requests."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up (page cache, connection pool)
    for round_index in range(n):
        for name, call in calls.items():
            if round_index % every.get(name, 1):
                continue
            started = time.perf_counter()
            call()
            samples[name].append((time.perf_counter() - started) * 1000)
            time.sleep(0.02)
    return samples


def cpu_ticks() -> tuple[int, int]:
    """(idle, total) jiffies of all cores since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # idle + iowait


def throughput(call: Callable[[], object], total: int, concurrency: int) -> tuple[float, float]:
    """(executions per second, fraction of the machine's CPU busy meanwhile). The busy
    fraction counts every process on the machine: near 1.0 means no core sat idle."""
    idle_before, total_before = cpu_ticks()
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(call) for _ in range(total)]:
            future.result()
    rate = total / (time.perf_counter() - started)
    idle_after, total_after = cpu_ticks()
    return rate, 1 - (idle_after - idle_before) / max(1, total_after - total_before)


def start_runner(concurrency: int | None) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # What `posttrain sandbox serve` runs, started directly so the bench does not depend on
    # every other component's CLI importing cleanly.
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from posttrain.sandboxes.runner import serve; "
            "serve('127.0.0.1', int(sys.argv[1]), int(sys.argv[2]) or None, None)",
            str(port),
            str(concurrency or 0),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    client = SandboxClient(url, retries=0)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.health()
            return server, url
        except Exception:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("the runner did not come up within 30 s") from None
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="sequential runs per mode")
    parser.add_argument("--cli-n", type=int, default=20, help="sequential CLI runs")
    parser.add_argument("--concurrency", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--total", type=int, default=200, help="runs in the throughput test")
    parser.add_argument(
        "--runner-concurrency",
        type=int,
        default=None,
        help="the runner's --concurrency (default: its own, cores + 1)",
    )
    args = parser.parse_args()

    def bare() -> None:
        subprocess.run([PYTHON, "-c", SNIPPET], check=True, capture_output=True)

    executor = Executor()
    request = ExecRequest(command=["python3", "-c", SNIPPET])

    def check(result: ExecResult) -> None:
        # The reason says why (e.g. the 10 s wall clock on a badly overloaded machine).
        assert result.status == "ok", f"{result.status}: {result.reason}"

    def library() -> None:
        check(executor.run(request))

    pooled = Executor(warm_pool=args.concurrency)

    def warm() -> None:
        check(pooled.run(request))

    load_before = os.getloadavg()[0]
    server, url = start_runner(args.runner_concurrency)
    client = SandboxClient(url, retries=10, backoff_s=0.02)
    runner_slots = client.health()["concurrency"]

    def runner() -> None:
        check(client.run(request))

    def cli() -> None:
        subprocess.run(
            [sys.executable, "-m", "posttrain", "sandbox", "exec", "--", "python3", "-c", SNIPPET],
            check=True,
            capture_output=True,
        )

    def pool_takes() -> dict[str, float]:
        """The runner's warm-pool counters: how often a request found a pre-started sandbox."""
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        found = re.findall(r'posttrain_sandbox_warm_pool_takes_total\{result="(\w+)"\} (\S+)', text)
        return {result: float(count) for result, count in found}

    try:
        latency = interleaved(
            {"bare": bare, "library": library, "warm": warm, "runner": runner, "cli": cli},
            args.n,
            {"cli": max(1, args.n // args.cli_n)},
        )
        rates = {
            name: throughput(call, args.total, args.concurrency)
            for name, call in (("bare", bare), ("library", library), ("warm", warm))
        }
        takes_before = pool_takes()
        rates["runner"] = throughput(runner, args.total, args.concurrency)
        takes = {
            result: count - takes_before.get(result, 0.0) for result, count in pool_takes().items()
        }
    finally:
        pooled.close()
        client.close()
        server.terminate()
        server.wait(timeout=10)

    print(
        f"snippet: python3 -c {SNIPPET!r}  interpreter: {PYTHON}  cores: {os.cpu_count()}  "
        f"throughput clients: {args.concurrency}  runner concurrency: {runner_slots}  "
        f"load average: {load_before:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'mode':8} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'p50/bare':>9} "
        f"{'exec/s':>8} {'tput/bare':>9} {'cpu busy':>8}"
    )
    base_p50 = statistics.median(latency["bare"])
    for name, samples in latency.items():
        p50 = statistics.median(samples)
        rate, busy = rates.get(name, (0.0, 0.0))
        rate_text = (
            f"{rate:8.1f} {rate / rates['bare'][0]:9.2f} {busy:8.0%}"
            if rate
            else f"{'-':>8} {'-':>9} {'-':>8}"
        )
        print(
            f"{name:8} {len(samples):4d} {p50:8.1f} {percentile(samples, 0.95):8.1f} "
            f"{p50 / base_p50:9.2f} {rate_text}"
        )
    print(
        "runner warm pool during its throughput run: "
        + ", ".join(f"{result} {count:.0f}" for result, count in sorted(takes.items()))
    )


if __name__ == "__main__":
    main()
