"""Pre-started sandboxes, so namespace and mount setup is off the request path.

Creating the namespaces and mounts is most of a sandbox's fixed cost (~10 ms here), about as
much as starting Python itself. A pooled sandbox has paid it before the request arrives: it
sits in a tiny bash launcher, blocked on a pipe; at request time the host writes the argv and
the launcher ``exec``s the program. Each pooled sandbox still runs exactly one program and is
then destroyed, so isolation between executions is the same as on the cold path. The launcher
sets the resource limits itself (bash ``ulimit``) before it waits, so the program starts with
exactly the cold path's limits without a ``prlimit`` exec per sandbox.

When the pool refills matters as much as its size. Starting a sandbox costs ~5-10 ms of CPU
(bwrap's namespaces and mounts, plus the spawn in this process), so a refill that runs while
an execution is running takes a core, the GIL and kernel namespace locks from it: measured
on 2 cores, refilling during the execution made a pooled snippet ~1.1-2.4 ms slower than
refilling after it. So the pool keeps ``size`` sandboxes when nothing runs, and while
executions run it refills only below ``reserve`` (the sandboxes the next concurrent
requests may claim); a sequential caller never pays for a refill, and a saturating one still
finds a sandbox ready.
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

from prometheus_client import Counter

from .bubblewrap import Bubblewrap
from .protocol import ExecRequest, SandboxError

log = logging.getLogger(__name__)

POOL_TAKES = Counter(
    "posttrain_sandbox_warm_pool_takes_total",
    "Requests that asked the warm pool for a sandbox: hit (got one), empty (none ready yet: "
    "cold path; a pool too small or refilling too slowly), unfit (non-default limits, files "
    "or env: cold path by design).",
    ["result"],
)

# Runs in a pre-started sandbox after the limits are set (see bash_ulimits): block until the
# host sends the argv (NUL-separated, then EOF) on the control descriptor, close it, and
# become the program. bash: `mapfile -d ''` reads NUL-separated records, so any argv
# survives unquoted.
_LAUNCHER = (
    "eval \"mapfile -d '' -u $1 argv; exec $1<&-\"; "
    '[ ${#argv[@]} -gt 0 ] || exit 126; exec "${argv[@]}"'
)
# bash's ulimit option per resource, and its unit in bytes (1 = unscaled) outside POSIX mode.
_ULIMIT_OPTIONS = {
    "as": ("-v", 1024),
    "cpu": ("-t", 1),
    "nproc": ("-u", 1),
    "fsize": ("-f", 1024),
    "nofile": ("-n", 1),
    "core": ("-c", 1024),
}


def bash_ulimits(limits: dict[str, tuple[int, int]]) -> str:
    """The bash commands that set ``limits`` (name -> (soft, hard), as
    :meth:`.Bubblewrap.rlimits` gives them) on the launcher, and so on the program it becomes:
    first soft = hard, then the soft limits that differ lowered. Failing to set one ends the
    launcher (exit 125), so a sandbox never runs a program without its limits.

    Why not ``prlimit`` as on the cold path: that is one more program exec per sandbox (~1.2
    ms of CPU here); ``ulimit`` is a builtin of the launcher that runs anyway.

    >>> bash_ulimits({"as": (1 << 20, 1 << 20), "cpu": (11, 12), "core": (0, 0)})
    'ulimit -v 1024 -t 12 -c 0 && ulimit -S -t 11 || exit 125'
    """
    both = " ".join(
        f"{_ULIMIT_OPTIONS[name][0]} {hard // _ULIMIT_OPTIONS[name][1]}"
        for name, (_, hard) in limits.items()
    )
    soft = " ".join(
        f"{_ULIMIT_OPTIONS[name][0]} {soft // _ULIMIT_OPTIONS[name][1]}"
        for name, (soft, hard) in limits.items()
        if soft != hard
    )
    return f"ulimit {both}" + (f" && ulimit -S {soft}" if soft else "") + " || exit 125"


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

    def __init__(self, bubblewrap: Bubblewrap, size: int, shape: ExecRequest | None = None) -> None:
        """``size`` sandboxes are kept ready while idle; half of them (rounded up) while
        executions run: the ``reserve``."""
        self.bubblewrap = bubblewrap
        self.size = size
        self.reserve = (size + 1) // 2
        self.shape = shape or ExecRequest(command=["true"])
        self._ready: list[PooledSandbox] = []
        self._busy = 0  # pooled sandboxes handed out and not yet finished
        self.started = 0  # sandboxes the refiller started (tests read it)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._refill, name="sandbox-warm-pool", daemon=True)
        self._thread.start()

    def fits(self, request: ExecRequest) -> bool:
        shape = self.shape
        # Small argv only: it goes through a pipe the launcher may not be reading yet.
        return (
            not request.files
            and not request.env
            and request.cpu_time_s is None
            and sum(len(arg) + 1 for arg in request.command) < 32768
            and request.timeout_s <= shape.timeout_s
            and request.network == shape.network
            and (request.memory_mb, request.max_processes, request.max_file_mb, request.workdir_mb)
            == (shape.memory_mb, shape.max_processes, shape.max_file_mb, shape.workdir_mb)
        )

    def take(self, request: ExecRequest) -> PooledSandbox | None:
        """A ready sandbox for ``request``, or None (cold path) if it does not fit or none
        is ready. The caller calls :meth:`replenish` once it has handed the sandbox its
        program (so a needed refill never competes with that hand-off) and :meth:`finished`
        once the execution is over."""
        if not self.fits(request):
            POOL_TAKES.labels("unfit").inc()
            return None
        with self._lock:
            while self._ready:
                sandbox = self._ready.pop()
                if sandbox.proc.poll() is None:
                    POOL_TAKES.labels("hit").inc()
                    self._busy += 1
                    return sandbox
                # Only something broken ends a launcher early (e.g. a limit it could not set).
                log.warning(
                    "a pooled sandbox exited before use (code %s); discarding it",
                    sandbox.proc.returncode,
                )
                self._discard(sandbox)
        POOL_TAKES.labels("empty").inc()
        self.replenish()
        return None

    def _target(self) -> int:
        """How many ready sandboxes to keep now (caller holds the lock)."""
        return self.size if self._busy == 0 else self.reserve

    def replenish(self) -> None:
        """Wake the refiller if fewer sandboxes are ready than the pool keeps now."""
        with self._lock:
            needed = len(self._ready) < self._target()
        if needed:
            self._wake.set()

    def finished(self) -> None:
        """An execution from :meth:`take` is over: once none runs, top the pool up."""
        with self._lock:
            self._busy = max(0, self._busy - 1)
        self.replenish()

    def _start_one(self) -> PooledSandbox:
        bubblewrap = self.bubblewrap
        uid = bubblewrap.uids.acquire() if bubblewrap.is_root else None
        control_read, control_write = os.pipe()
        try:
            launcher = f"{bash_ulimits(bubblewrap.rlimits(self.shape))}; {_LAUNCHER}"
            proc, status_read = bubblewrap.spawn(
                self.shape,
                uid,
                ["bash", "-c", launcher, "sandbox-launcher", str(control_read)],
                [control_read],
                limits_inside=True,
            )
        except BaseException:
            os.close(control_write)
            if uid is not None:
                bubblewrap.uids.release(uid)
            raise
        release = (lambda: bubblewrap.uids.release(uid)) if uid is not None else (lambda: None)
        return PooledSandbox(proc, control_write, status_read, release)

    def _refill(self) -> None:
        while not self._closed:
            # Cleared before counting: a sandbox taken from here on sets it again, so the
            # wait below returns at once and no wake-up is lost between count and wait.
            self._wake.clear()
            while True:
                # Re-read each time: an execution that starts meanwhile lowers the target.
                with self._lock:
                    if self._closed or len(self._ready) >= self._target():
                        break
                try:
                    sandbox = self._start_one()
                except SandboxError as exc:
                    log.error("warm pool could not start a sandbox: %s", exc)
                    break
                with self._lock:
                    self.started += 1
                    if self._closed:
                        self._discard(sandbox)
                        return
                    self._ready.append(sandbox)
            self._wake.wait(timeout=1.0)

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
