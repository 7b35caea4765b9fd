"""Runs inside the sandbox (shipped as a file, stdlib only, any Python 3.8+): each test case
in its own forked child, so one failing, crashing or hanging case cannot hide the others.

Reads ``cases.json`` ({"setup": str, "cases": [{"name", "source"}], "case_timeout_s"}) and
``solution.py`` from the working directory. A child loads the solution as module
``solution``, runs the shared setup (imports, helpers, test function definitions) and then
its one case, and reports over a private pipe. The parent judges a case passed only when
that report arrived and says so: a solution that calls ``os._exit(0)`` makes its case fail.
Children write their output to per-case files, so only the parent writes to stdout, and the
parent kills every other process before printing the one result line (prefixed with
``RESULT_MARKER``; the host reads the last such line).
"""

import builtins
import contextlib
import json
import os
import signal
import sys
import time
import types

RESULT_MARKER = "__POSTTRAIN_UNIT_TEST_RESULTS__ "
OUTPUT_KEEP = 2000


def _forbid_proc_access() -> None:
    """Make /proc/<our pid>/fd unreadable to the children (same uid) via PR_SET_DUMPABLE."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass


def _load_solution(source: str) -> types.ModuleType:
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    exec(compile(source, "solution.py", "exec"), module.__dict__)
    return module


def _child(solution: str, setup: str, case_source: str, report_fd: int, timeout: float) -> None:
    """Run one case and write a JSON report; never returns."""
    report = {"ok": False, "error": "", "builtins_modified": []}
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    before = {name: id(value) for name, value in vars(builtins).items()}
    try:
        module = _load_solution(solution)
        namespace = dict(vars(module))
        namespace["__name__"] = "tests"
        exec(compile(setup, "tests.py", "exec"), namespace)
        exec(compile(case_source, "tests.py", "exec"), namespace)
        report["ok"] = True
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are failures too
        report["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    signal.setitimer(signal.ITIMER_REAL, 0)
    after = {name: id(value) for name, value in vars(builtins).items()}
    report["builtins_modified"] = sorted(
        n for n in set(before) | set(after) if before.get(n) != after.get(n)
    )
    os.write(report_fd, json.dumps(report).encode())
    os._exit(0)


def _raise_timeout(signum: int, frame: object) -> None:
    raise TimeoutError("test case exceeded its time limit")


def _run_case(index: int, solution: str, setup: str, case: dict, timeout: float) -> dict:
    # $TMPDIR, not /tmp: a SandboxTask pod's root (and /tmp) is read-only and its TMPDIR is the
    # writable workdir; opening /tmp there failed in every child (each case "exited early").
    output_path = os.path.join(os.environ.get("TMPDIR") or "/tmp", f"case-{index}.out")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        output = os.open(output_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(output, 1)
        os.dup2(output, 2)
        _child(solution, setup, case["source"], write_end, timeout)
    os.close(write_end)
    deadline = time.monotonic() + timeout + 1.0
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.002)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    raw = b""
    os.set_blocking(read_end, False)
    try:
        while True:
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            raw += chunk
    except BlockingIOError:
        pass
    os.close(read_end)
    result = {"name": case["name"], "passed": False, "error": "", "builtins_modified": []}
    if raw:
        report = json.loads(raw.decode())
        result.update(
            passed=report["ok"],
            error=report["error"],
            builtins_modified=report["builtins_modified"],
        )
    elif status is None:
        result["error"] = f"killed after the {timeout:.1f} s case time limit"
    else:
        result["error"] = f"process exited (status {status}) before the test finished"
        result["exited_early"] = True
    try:
        with open(output_path, "rb") as handle:
            result["output"] = handle.read(OUTPUT_KEEP).decode("utf-8", "replace")
    except OSError:
        result["output"] = ""
    return result


def main() -> None:
    _forbid_proc_access()
    with open("cases.json") as handle:
        spec = json.load(handle)
    with open("solution.py") as handle:
        solution = handle.read()
    # The solution runs in the same workspace: do not leave the tests lying around for it.
    for name in ("cases.json", "harness.py"):
        with contextlib.suppress(OSError):
            os.unlink(name)
    results = [
        _run_case(i, solution, spec["setup"], case, float(spec["case_timeout_s"]))
        for i, case in enumerate(spec["cases"])
    ]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(-1, signal.SIGKILL)  # every process we may signal but ourselves (and init)
    sys.stdout.write(RESULT_MARKER + json.dumps(results) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
