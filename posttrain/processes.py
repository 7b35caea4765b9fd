"""Start, health-check and stop local server processes.

Used by the dev environment's servers and the trainer's local rollout server.

Each process gets its own session (so ``dev up`` can leave it running after the
CLI exits, and a stop kills its whole group) and a log file that is kept, and
quoted, when it fails to become healthy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class StartError(RuntimeError):
    """A server did not come up; the message names it, the cause and its log.

    ``exit_code`` is the server's own exit code when it died while starting, None when it
    was still running but not ready in time (and has been stopped).
    """

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_ok(url: str, ssl_context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ssl_context) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class ManagedProcess:
    """One server process: command, log file, and a readiness probe."""

    name: str
    command: Sequence[str]
    log_path: Path
    ready: Callable[[], bool]
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    pid: int | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.popen = subprocess.Popen(
                list(self.command),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        self.pid = self.popen.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise StartError(
                    f"{self.name} exited with code {self.popen.returncode} while starting; "
                    f"last lines of {self.log_path}:\n{tail(self.log_path)}",
                    exit_code=self.popen.returncode,
                )
            if self.ready():
                log.info("%s is ready (pid %d)", self.name, self.pid)
                return
            time.sleep(0.2)
        self.stop()
        raise StartError(
            f"{self.name} did not become ready within {timeout_s:.0f} s; "
            f"last lines of {self.log_path}:\n{tail(self.log_path)}"
        )

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.pid is not None and pid_alive(self.pid)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.pid is None:
            return
        stop_pid(self.pid, grace_s)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=1)
        self.pid = None


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float = 30.0,
    what: str = "condition",
    interval_s: float = 0.1,
) -> Any:
    """Poll until ``predicate()`` is truthy and return its value; fail naming ``what``.

    >>> wait_for(lambda: 42, what="the answer")
    42
    """
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as dead.
    with contextlib.suppress(OSError):
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        return state != "Z"
    return True


def stop_pid(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it outlives ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
                return
            time.sleep(0.1)
