"""Wait for a started sandbox and turn what it did into an :class:`~.protocol.ExecResult`.

Feeds stdin, drains stdout/stderr (kept up to the request's limit, an output flood killed),
the workspace tar and bwrap's ``--json-status-fd`` stream until the sandbox exits or its wall
clock runs out, then classifies the exit (ok, error, timeout, killed, oom) or raises
:class:`~.protocol.SandboxError` when the sandbox, not the program, failed. Two drivers of
the same bookkeeping: :func:`collect` (a thread blocked in a selector) and
:func:`collect_async` (event-loop readers, for the runner).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field

from .protocol import ExecRequest, ExecResult, SandboxError, Status

# How a memory exhaustion shows up once RLIMIT_AS makes malloc/mmap fail: Python raises
# MemoryError, C++ throws bad_alloc, glibc and most tools print ENOMEM's message.
OOM_PATTERN = re.compile(
    r"MemoryError|std::bad_alloc|Cannot allocate memory|out of memory|memory exhausted",
    re.IGNORECASE,
)
# Kill the sandbox once a stream has produced this many times the kept limit: beyond that it
# is an output flood, and draining it only burns CPU until the wall clock runs out.
OUTPUT_FLOOD_FACTOR = 32
TRUNCATION_MARKER = "\n...[truncated by sandbox: {dropped} more bytes]\n"


def truncate_output(data: bytes, dropped: int) -> str:
    """Decode kept bytes and append the truncation marker when something was dropped.

    >>> truncate_output(b"abc", 0)
    'abc'
    >>> truncate_output(b"abc", 5)
    'abc\\n...[truncated by sandbox: 5 more bytes]\\n'
    """
    text = data.decode("utf-8", errors="replace")
    return text + TRUNCATION_MARKER.format(dropped=dropped) if dropped else text


def classify_exit(exit_code: int, stderr: str) -> tuple[Status, str]:
    """Map the program's exit status to (status, reason).

    bwrap reports a signal death as 128 + signal number, like a shell. The OOM heuristic:
    RLIMIT_AS makes allocations fail instead of invoking the kernel OOM killer, so a memory
    hog either dies with an allocation error message (Python ``MemoryError``, ``bad_alloc``,
    ``Cannot allocate memory``) or crashes; a nonzero exit whose stderr shows such a message
    is reported as ``oom``.

    >>> classify_exit(0, "")
    ('ok', 'exited with code 0')
    >>> classify_exit(1, "Traceback ...\\nMemoryError\\n")[0]
    'oom'
    >>> classify_exit(128 + 9, "")
    ('killed', 'terminated by signal SIGKILL')
    """
    if exit_code == 0:
        return "ok", "exited with code 0"
    if OOM_PATTERN.search(stderr[-4096:]):
        return "oom", f"memory limit reached (allocation failed; exit code {exit_code})"
    if exit_code > 128:
        try:
            name = signal.Signals(exit_code - 128).name
        except ValueError:
            return "error", f"exited with code {exit_code}"
        if name == "SIGXCPU":
            return "killed", "CPU time limit reached (SIGXCPU)"
        if name == "SIGXFSZ":
            return "killed", "file size limit reached (SIGXFSZ)"
        return "killed", f"terminated by signal {name}"
    return "error", f"exited with code {exit_code}"


def wait_for(
    proc: subprocess.Popen[bytes],
    request: ExecRequest,
    started: float,
    status_read: int,
    out_read: int,
    capture_workspace: bool,
) -> ExecResult:
    try:
        collected = collect(
            proc, request, started, status_read, out_read if capture_workspace else None
        )
        duration_ms = (time.monotonic() - started) * 1000
        return finish(request, collected, duration_ms, capture_workspace)
    finally:
        for fd in (status_read, out_read):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


@dataclass
class Collected:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    dropped: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    status_json: bytearray = field(default_factory=bytearray)
    workspace: bytearray = field(default_factory=bytearray)
    timed_out: bool = False
    flood: str | None = None
    workspace_overflow: bool = False
    returncode: int | None = None

    def feed(self, name: str, chunk: bytes, request: ExecRequest) -> bool:
        """Keep what fits of one chunk from stream ``name``; True = kill the sandbox now
        (an output flood)."""
        if name in ("stdout", "stderr"):
            kept = getattr(self, name)
            room = max(0, request.max_output_bytes - len(kept))
            kept += chunk[:room]
            self.dropped[name] += len(chunk) - min(room, len(chunk))
            if (
                self.flood is None
                and self.dropped[name] > OUTPUT_FLOOD_FACTOR * request.max_output_bytes
            ):
                self.flood = name
                return True
        elif name == "status":
            self.status_json += chunk
        # The workspace comes back as a tar of a tmpfs-bounded tree; allow header overhead.
        elif len(self.workspace) + len(chunk) <= 2 * (request.workdir_mb << 20) + (1 << 20):
            self.workspace += chunk
        else:
            self.workspace_overflow = True
        return False


def collect(
    proc: subprocess.Popen[bytes],
    request: ExecRequest,
    started: float,
    status_fd: int,
    workspace_fd: int | None,
) -> Collected:
    """Feed stdin and drain every pipe until the sandbox is gone or the deadline passes."""
    got = Collected()
    deadline = started + request.timeout_s
    selector = selectors.DefaultSelector()
    assert proc.stdin and proc.stdout and proc.stderr
    stdin_data = memoryview(request.stdin.encode())
    if stdin_data:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    else:
        proc.stdin.close()
    selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
    selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
    selector.register(status_fd, selectors.EVENT_READ, "status")
    if workspace_fd is not None:
        selector.register(workspace_fd, selectors.EVENT_READ, "workspace")

    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            got.timed_out = True
            kill(proc)
            break
        for key, _ in selector.select(timeout=min(remaining, 0.5)):
            name = key.data
            if name == "stdin":
                try:
                    written = os.write(key.fd, stdin_data[:65536])
                    stdin_data = stdin_data[written:]
                except (BrokenPipeError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    stdin_data = memoryview(b"")
                if not stdin_data:
                    selector.unregister(key.fileobj)
                    proc.stdin.close()
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
            elif got.feed(name, chunk, request):
                kill(proc)
    selector.close()
    # After a kill the pid namespace dies with bwrap; the wait is short either way.
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic() + 1.0))
    except subprocess.TimeoutExpired:
        kill(proc)
        proc.wait()
    close_out(proc, got, status_fd)
    return got


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL bwrap's process group; pid 1 of the sandbox dies with it, and with pid 1
    every process in the sandbox."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def close_out(proc: subprocess.Popen[bytes], got: Collected, status_fd: int) -> None:
    """After bwrap exited: record its exit status, close our pipe ends, read the status tail."""
    got.returncode = proc.returncode
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream and not stream.closed:
            with contextlib.suppress(OSError):
                stream.close()
    if not got.timed_out and got.flood is None:
        # Drain the tail of the status pipe written just before bwrap exited.
        with contextlib.suppress(OSError):
            os.set_blocking(status_fd, False)
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(status_fd, 4096):
                    got.status_json += chunk


async def collect_async(
    proc: subprocess.Popen[bytes], request: ExecRequest, started: float, status_fd: int
) -> Collected:
    """:func:`collect` for an event loop: the same bookkeeping, driven by loop readers, so a
    server needs no thread (and no GIL hand-off) per execution."""
    loop = asyncio.get_running_loop()
    got = Collected()
    deadline = started + request.timeout_s
    all_closed: asyncio.Future[None] = loop.create_future()
    assert proc.stdin and proc.stdout and proc.stderr
    readers = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_fd: "status"}
    stdin_fd = proc.stdin.fileno()
    stdin_data = memoryview(request.stdin.encode())

    def on_readable(fd: int) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            loop.remove_reader(fd)
            del readers[fd]
            if not readers and not all_closed.done():
                all_closed.set_result(None)
        elif got.feed(readers[fd], chunk, request):
            kill(proc)

    def on_writable() -> None:
        nonlocal stdin_data
        try:
            stdin_data = stdin_data[os.write(stdin_fd, stdin_data[:65536]) :]
        except BlockingIOError:
            return
        except BrokenPipeError:
            stdin_data = memoryview(b"")
        if not stdin_data:
            loop.remove_writer(stdin_fd)
            proc.stdin.close()  # type: ignore[union-attr]

    if stdin_data:
        os.set_blocking(stdin_fd, False)
        loop.add_writer(stdin_fd, on_writable)
    else:
        proc.stdin.close()
    for fd in readers:
        loop.add_reader(fd, on_readable, fd)
    try:
        try:
            await asyncio.wait_for(
                asyncio.shield(all_closed), max(0.0, deadline - time.monotonic())
            )
        except TimeoutError:
            got.timed_out = True
            kill(proc)
        finally:
            for fd in list(readers):
                loop.remove_reader(fd)
            if not proc.stdin.closed:
                loop.remove_writer(stdin_fd)
        # Pipes close as bwrap exits; its exit status follows within moments.
        await exited(proc, deadline + 1.0)
    except asyncio.CancelledError:
        # The caller went away (client disconnect, shutdown): the sandbox must not outlive it.
        kill(proc)
        proc.wait()
        close_out(proc, got, status_fd)
        raise
    close_out(proc, got, status_fd)
    return got


async def exited(proc: subprocess.Popen[bytes], kill_at: float) -> None:
    """Wait until ``proc`` has exited, killing it at ``kill_at`` (monotonic), without
    blocking the loop: a pidfd becomes readable when the process exits, so the loop sleeps
    until then instead of polling ``waitpid`` (pidfd_open needs Linux >= 5.3; older kernels
    poll every half millisecond)."""
    if proc.poll() is not None:
        return
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while proc.poll() is None:
            if time.monotonic() > kill_at:
                kill(proc)
            await asyncio.sleep(0.0005)
        return
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
    try:
        await asyncio.wait_for(exited, max(0.0, kill_at - time.monotonic()))
    except TimeoutError:
        kill(proc)  # the pid namespace dies with bwrap: the reap below is immediate
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    proc.wait()


def _program_exit_code(status_json: bytes) -> tuple[bool, int | None]:
    """Parse bwrap's --json-status-fd stream: (sandbox started, program exit code).

    >>> _program_exit_code(b'{ "child-pid": 7 }\\n{ "exit-code": 3 }\\n')
    (True, 3)
    >>> _program_exit_code(b"")
    (False, None)
    """
    started, exit_code = False, None
    for line in status_json.decode(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            started = started or "child-pid" in record
            if "exit-code" in record:
                exit_code = int(record["exit-code"])
    return started, exit_code


def finish(
    request: ExecRequest, got: Collected, duration_ms: float, capture_workspace: bool
) -> ExecResult:
    stdout = truncate_output(bytes(got.stdout), got.dropped["stdout"])
    stderr = truncate_output(bytes(got.stderr), got.dropped["stderr"])
    started, exit_code = _program_exit_code(bytes(got.status_json))
    if got.timed_out and not started:
        # bwrap never reported the program's start: the sandbox, not the program, used up
        # the wall clock (scoring that as the program's timeout would make up a wrong answer).
        raise SandboxError(
            f"bubblewrap did not start the program within the {request.timeout_s:g} s wall "
            f"clock: {stderr.strip()[:2000] or 'no message'}"
        )
    if got.timed_out:
        return ExecResult(
            "timeout",
            None,
            stdout,
            stderr,
            duration_ms,
            f"wall-clock limit of {request.timeout_s:g} s exceeded; "
            "every process in the sandbox was killed",
        )
    if got.flood:
        return ExecResult(
            "killed",
            None,
            stdout,
            stderr,
            duration_ms,
            f"{got.flood} exceeded {OUTPUT_FLOOD_FACTOR}x the "
            f"{request.max_output_bytes}-byte output limit; sandbox killed",
        )
    if not started:
        raise SandboxError(f"bubblewrap could not create the sandbox: {stderr.strip()[:2000]}")
    if exit_code is None:
        setup_error = re.search(r"^bwrap: (.*)$", stderr, re.MULTILINE)
        if setup_error and got.returncode == 1:
            if not setup_error.group(1).startswith("execvp "):
                # bwrap failed while building the sandbox, after the namespaces existed
                # (mounting /proc, binding a path): the program never ran, so there is
                # nothing to score; a caller that scored it would train on a made-up 0.
                raise SandboxError(f"bubblewrap could not set up the sandbox: {setup_error[0]}")
            # bwrap could not exec the command (not found, not executable): the caller's
            # mistake, reported like a shell would (127).
            return ExecResult(
                "error",
                127,
                stdout,
                stderr,
                duration_ms,
                f"could not start the program: {setup_error.group(1)}",
            )
        # bwrap itself was killed from outside before reporting; treat as a kill.
        return ExecResult(
            "killed",
            None,
            stdout,
            stderr,
            duration_ms,
            "the sandbox was terminated before the program reported an exit code",
        )
    status, reason = classify_exit(exit_code, stderr)
    if exit_code == 125 and "sandbox: could not unpack the workspace" in stderr:
        raise SandboxError(f"could not seed /workspace: {stderr.strip()[:2000]}")
    workspace: bytes | None = None
    if capture_workspace:
        if got.workspace_overflow:
            reason += "; workspace too large to capture, state not saved"
        elif got.workspace:
            workspace = bytes(got.workspace)
        else:
            reason += "; the program killed the sandbox shell, workspace state not saved"
    return ExecResult(status, exit_code, stdout, stderr, duration_ms, reason, workspace)
