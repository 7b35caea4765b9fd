"""Start-up of the `posttrain` CLI: what a person typing `--help` and a verifier spawning
`sandbox exec` per sample wait for, against the eager CLI that imported every component.

Side by side in one run, interleaved so background load hits all alike:

- ``help (lazy)``: ``posttrain --help`` as shipped (commands listed from posttrain.cli.COMMANDS);
- ``help (eager)``: the same parser with every component module imported and registered
  (``build_parser()`` without argv: what ``--help`` cost before);
- ``sandbox exec``: ``posttrain sandbox exec -- true`` (one sandboxed execution);
- ``python -c pass``: the interpreter's own floor.

Prints the median wall time and the median CPU time (user + sys of the child) of each, and
the ratios to the floor. ``python bench/cli_startup.py [RUNS]`` (default 15).
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time

EAGER = (
    "import contextlib, io\n"
    "from posttrain.cli import build_parser\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    try:\n"
    "        build_parser().parse_args(['--help'])\n"
    "    except SystemExit:\n"
    "        pass\n"
)

CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "help (lazy)": [sys.executable, "-m", "posttrain", "--help"],
    "help (eager)": [sys.executable, "-c", EAGER],
    "sandbox exec": [sys.executable, "-m", "posttrain", "sandbox", "exec", "--", "true"],
}


def measure(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for _ in range(runs):
        for name, argv in CASES.items():
            results[name].append(measure(argv))
    floor_wall = statistics.median(w for w, _ in results["python -c pass"])
    floor_cpu = statistics.median(c for _, c in results["python -c pass"])
    print(f"{runs} runs each, load average {os.getloadavg()[0]:.1f}")
    print(f"{'case':<16} {'wall p50':>9} {'cpu p50':>9} {'wall/floor':>11} {'cpu/floor':>10}")
    for name, samples in results.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(
            f"{name:<16} {wall:8.3f}s {cpu:8.3f}s {wall / floor_wall:10.1f}x "
            f"{cpu / max(floor_cpu, 1e-3):9.1f}x"
        )


if __name__ == "__main__":
    main()
