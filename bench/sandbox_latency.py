"""Sandbox latency and throughput, side by side with a bare ``python3 -c`` subprocess.

Modes, all running the same trivial snippet with the same interpreter:
  bare     subprocess.run(python3 -c ...)            the floor: no isolation at all
  library  Executor().run(...) in this process       a cold sandbox (namespaces built per call)
  warm     Executor(warm_pool=N).run(...)            a pre-started sandbox, in process
  runner   POST /v1/exec to `posttrain sandbox serve` the production path: HTTP + a sandbox
                                                     from the warm pool (built ahead of time)
  cli      `posttrain sandbox exec -- python3 -c ...` one-shot CLI (pays Python start-up)

Latency: sequential executions, p50/p95. Throughput: many concurrent clients for a fixed
number of executions, executions per second. Prints a table and the ratios to bare.

    .venv/bin/python bench/sandbox_latency.py [--n 200] [--cli-n 20] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from posttrain.sandboxes.client import SandboxClient
from posttrain.sandboxes.executor import SANDBOX_PATH, ExecRequest, Executor

SNIPPET = "print(sum(range(100)))"
PYTHON = shutil.which("python3", path=SANDBOX_PATH) or "python3"


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile.

    >>> percentile([4.0, 1.0, 3.0, 2.0], 0.5)
    2.0
    """
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))]


def interleaved(calls: dict[str, Callable[[], object]], n: int, every: dict[str, int]
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


def throughput(call: Callable[[], object], total: int, concurrency: int) -> float:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(call) for _ in range(total)]:
            future.result()
    return total / (time.perf_counter() - started)


def start_runner(concurrency: int | None) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # What `posttrain sandbox serve` runs, started directly so the bench does not depend on
    # every other component's CLI importing cleanly.
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from posttrain.sandboxes.runner import serve; "
         "serve('127.0.0.1', int(sys.argv[1]), int(sys.argv[2]) or None, None)",
         str(port), str(concurrency or 0)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    parser.add_argument("--runner-concurrency", type=int, default=None,
                        help="the runner's --concurrency (default: its own, the CPU count)")
    args = parser.parse_args()

    def bare() -> None:
        subprocess.run([PYTHON, "-c", SNIPPET], check=True, capture_output=True)

    executor = Executor()
    request = ExecRequest(command=["python3", "-c", SNIPPET])

    def library() -> None:
        assert executor.run(request).status == "ok"

    pooled = Executor(warm_pool=args.concurrency)

    def warm() -> None:
        assert pooled.run(request).status == "ok"

    server, url = start_runner(args.runner_concurrency)
    client = SandboxClient(url, retries=10, backoff_s=0.02)

    def runner() -> None:
        assert client.run(request).status == "ok"

    def cli() -> None:
        subprocess.run([sys.executable, "-m", "posttrain", "sandbox", "exec", "--",
                        "python3", "-c", SNIPPET], check=True, capture_output=True)

    try:
        latency = interleaved({"bare": bare, "library": library, "warm": warm, "runner": runner,
                               "cli": cli}, args.n, {"cli": max(1, args.n // args.cli_n)})
        rates = {name: throughput(call, args.total, args.concurrency)
                 for name, call in (("bare", bare), ("library", library), ("warm", warm),
                                    ("runner", runner))}
    finally:
        pooled.close()
        client.close()
        server.terminate()
        server.wait(timeout=10)

    print(f"snippet: python3 -c {SNIPPET!r}  interpreter: {PYTHON}  cores: {os.cpu_count()}  "
          f"throughput clients: {args.concurrency}")
    print(f"{'mode':8} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'p50/bare':>9} "
          f"{'exec/s':>8} {'tput/bare':>9}")
    base_p50 = statistics.median(latency["bare"])
    for name, samples in latency.items():
        p50 = statistics.median(samples)
        rate = rates.get(name)
        rate_text = f"{rate:8.1f} {rate / rates['bare']:9.2f}" if rate else f"{'-':>8} {'-':>9}"
        print(f"{name:8} {len(samples):4d} {p50:8.1f} {percentile(samples, 0.95):8.1f} "
              f"{p50 / base_p50:9.2f} {rate_text}")


if __name__ == "__main__":
    main()
