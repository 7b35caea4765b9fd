"""Pre-started sandboxes, so namespace and mount setup is off the request path.

Creating the namespaces and mounts is most of a sandbox's fixed cost (~10 ms here), about as
much as starting Python itself. A pooled sandbox has paid it before the request arrives: it
sits in a tiny bash launcher, blocked on a pipe; at request time the host writes the argv and
the launcher ``exec``s the program. Each pooled sandbox still runs exactly one program and is
then destroyed, so isolation between executions is the same as on the cold path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .executor import ExecRequest, Executor, SandboxError

log = logging.getLogger(__name__)

# Runs in a pre-started sandbox: block until the host sends the argv (NUL-separated, then
# EOF) on the control descriptor, close it, and become the program. bash: `mapfile -d ''`
# reads NUL-separated records, so any argv survives unquoted.
_LAUNCHER = (
    'eval "mapfile -d \'\' -u $1 argv; exec $1<&-"; '
    '[ ${#argv[@]} -gt 0 ] || exit 126; exec "${argv[@]}"'
)


@dataclass
class PooledSandbox:
    """A started sandbox blocked in the launcher; ``control`` receives the argv."""

    proc: subprocess.Popen[bytes]
    control: int
    status_read: int
    release: Callable[[], None]  # frees the host uid slot


class WarmPool:
    """Keeps ``size`` sandboxes started ahead of time, each waiting for one command.

    Only default-shaped requests (default memory/process/file/tmpfs limits, no network, no
    files or env, no explicit CPU limit, timeout within the pool's) can use it; everything
    else takes the cold path. A pooled sandbox's CPU limit is the pool's, which is harmless:
    the request's own, shorter wall clock still bounds it.
    """

    def __init__(self, executor: Executor, size: int, shape: ExecRequest | None = None) -> None:
        self.executor = executor
        self.size = size
        self.shape = shape or ExecRequest(command=["true"])
        self._ready: list[PooledSandbox] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._refill, name="sandbox-warm-pool",
                                        daemon=True)
        self._thread.start()

    def fits(self, request: ExecRequest) -> bool:
        shape = self.shape
        # Small argv only: it goes through a pipe the launcher may not be reading yet.
        return (not request.files and not request.env and request.cpu_time_s is None
                and sum(len(arg) + 1 for arg in request.command) < 32768
                and request.timeout_s <= shape.timeout_s and request.network == shape.network
                and (request.memory_mb, request.max_processes, request.max_file_mb,
                     request.workdir_mb)
                == (shape.memory_mb, shape.max_processes, shape.max_file_mb, shape.workdir_mb))

    def take(self, request: ExecRequest) -> PooledSandbox | None:
        """A ready sandbox for ``request``, or None (cold path) if it does not fit or none
        is ready; taking one wakes the refiller."""
        if not self.fits(request):
            return None
        with self._lock:
            while self._ready:
                sandbox = self._ready.pop()
                if sandbox.proc.poll() is None:
                    self._wake.set()
                    return sandbox
                self._discard(sandbox)
        self._wake.set()
        return None

    def _start_one(self) -> PooledSandbox:
        executor = self.executor
        uid = executor._uids.acquire() if executor.is_root else None
        control_read, control_write = os.pipe()
        try:
            proc, status_read = executor._spawn(
                self.shape, uid, ["bash", "-c", _LAUNCHER, "sandbox-launcher",
                                  str(control_read)], [control_read])
        except BaseException:
            os.close(control_write)
            if uid is not None:
                executor._uids.release(uid)
            raise
        release = (lambda: executor._uids.release(uid)) if uid is not None else (lambda: None)
        return PooledSandbox(proc, control_write, status_read, release)

    def _refill(self) -> None:
        while not self._closed:
            with self._lock:
                missing = self.size - len(self._ready)
            for _ in range(max(0, missing)):
                try:
                    sandbox = self._start_one()
                except SandboxError as exc:
                    log.error("warm pool could not start a sandbox: %s", exc)
                    break
                with self._lock:
                    if self._closed:
                        self._discard(sandbox)
                        return
                    self._ready.append(sandbox)
            self._wake.wait(timeout=1.0)
            self._wake.clear()

    @staticmethod
    def _discard(sandbox: PooledSandbox) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sandbox.proc.pid, signal.SIGKILL)
        sandbox.proc.wait()
        for stream in (sandbox.proc.stdin, sandbox.proc.stdout, sandbox.proc.stderr):
            if stream is not None:
                stream.close()
        for fd in (sandbox.control, sandbox.status_read):
            with contextlib.suppress(OSError):
                os.close(fd)
        sandbox.release()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            while self._ready:
                self._discard(self._ready.pop())
