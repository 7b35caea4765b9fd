"""Run untrusted programs (model output) in a fresh bubblewrap sandbox per execution.

Why bubblewrap: it gives a new user, pid, mount, network, ipc, uts and cgroup namespace in
~10 ms with no daemon and no root, so every execution gets a brand-new, throw-away machine
view. Isolation layers, outermost first:

* **Host uid.** When we are root, bwrap itself is started as an unprivileged host uid
  (``100000 + slot``), so the sandbox holds no host privileges at all, cannot read root-only
  files even if a path leaked in, and ``RLIMIT_NPROC`` really applies (the kernel exempts
  uid 0 from it). Inside, the program runs as uid/gid 1000 ``sandbox``.
* **Filesystem.** Only ``/usr`` (and the ``/bin``, ``/lib*`` links into it) plus a short
  allow-list of ``/etc`` files are bound, read-only. ``/proc`` is a fresh procfs of the new
  pid namespace and ``/dev`` a minimal devtmpfs. The working directory ``/workspace`` and
  ``/tmp`` are size-capped tmpfs mounts, so nothing the program writes ever reaches host disk
  and filling them ends in ``ENOSPC``.
* **Environment.** ``--clearenv`` plus a fixed ``PATH``/``HOME``/``LANG``: no host variable
  reaches the program.
* **Limits.** ``prlimit`` (run after ``setpriv`` dropped to the host uid) sets address space
  (memory), CPU seconds, process count, file size and open files before bwrap starts; a
  host-side wall clock kills the whole sandbox.
* **Lifetime.** ``--unshare-pid`` + ``--die-with-parent``: when the program's main process
  exits, or when we kill bwrap on timeout, the kernel kills every process left in the pid
  namespace, detached or not.

Files (``ExecRequest.files``) and a persistent workspace (see :mod:`snapshot`) are moved in and
out as tar streams over inherited file descriptors, so the host never mounts or unpacks
anything the program wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import Counter, Histogram

from posttrain.telemetry import get_tracer

if TYPE_CHECKING:
    from .warm_pool import PooledSandbox, WarmPool

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

Status = Literal["ok", "error", "timeout", "killed", "oom"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "killed", "oom")

SANDBOX_LATENCY = Histogram(
    "posttrain_sandbox_exec_seconds",
    "Wall-clock time of one sandboxed execution, sandbox setup included.",
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
SANDBOX_EXECUTIONS = Counter(
    "posttrain_sandbox_executions_total", "Sandboxed executions by final status.", ["status"]
)

WORKDIR = "/workspace"
SANDBOX_UID = 1000
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
TRUNCATION_MARKER = "\n...[truncated by sandbox: {dropped} more bytes]\n"
# Host uids handed to concurrent executions when we run as root; high enough that no real
# account owns them, so RLIMIT_NPROC counts only sandbox processes.
HOST_UID_BASE = 100000
HOST_UID_SLOTS = 256
# /etc entries a normal program needs (dynamic linker cache, alternatives symlinks for awk
# & co, time zone, certificates). Never the whole /etc: it holds shadow files and keys.
ETC_ALLOWLIST = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/nsswitch.conf",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
)
ETC_NETWORK = ("/etc/resolv.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf")
# How a memory exhaustion shows up once RLIMIT_AS makes malloc/mmap fail: Python raises
# MemoryError, C++ throws bad_alloc, glibc and most tools print ENOMEM's message.
OOM_PATTERN = re.compile(
    r"MemoryError|std::bad_alloc|Cannot allocate memory|out of memory|memory exhausted",
    re.IGNORECASE,
)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Kill the sandbox once a stream has produced this many times the kept limit: beyond that it
# is an output flood, and draining it only burns CPU until the wall clock runs out.
OUTPUT_FLOOD_FACTOR = 32


class SandboxError(RuntimeError):
    """The sandbox itself could not run (bwrap missing or refused); not the program's fault."""


@dataclass(frozen=True)
class ExecRequest:
    """One execution: what to run and under which limits (the CLI and HTTP API fields)."""

    command: list[str]
    stdin: str = ""
    files: dict[str, str] = field(default_factory=dict)
    """Files written into /workspace before the command starts (relative path -> text)."""
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0
    memory_mb: int = 512
    network: Literal["none", "host"] = "none"
    cpu_time_s: int | None = None
    """Per-process CPU seconds; default ceil(timeout_s) + 1."""
    max_processes: int = 64
    max_file_mb: int = 64
    workdir_mb: int = 64
    """Size cap of the /workspace and /tmp tmpfs mounts (each)."""
    max_output_bytes: int = 1 << 20
    """Bytes of stdout and of stderr kept; the rest is dropped behind a marker."""

    def __post_init__(self) -> None:
        problems = validate_request(self)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecRequest:
        """Build from JSON (HTTP body / CLI), rejecting unknown fields by name."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(known)}")
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate_request(request: ExecRequest) -> list[str]:
    """Every problem with a request, phrased so the caller can fix it (empty list = valid)."""
    problems: list[str] = []
    # Requests arrive as JSON from other processes: check types, not just values.
    for name, kind in (
        ("stdin", str),
        ("files", dict),
        ("env", dict),
        ("timeout_s", (int, float)),
        ("memory_mb", int),
        ("max_processes", int),
        ("max_file_mb", int),
        ("workdir_mb", int),
        ("max_output_bytes", int),
    ):
        if not isinstance(getattr(request, name), kind) or isinstance(getattr(request, name), bool):
            problems.append(f"{name} has the wrong type: {getattr(request, name)!r}")
    if problems:
        return problems
    if not all(isinstance(v, str) for v in [*request.files.values(), *request.env.values()]):
        problems.append("files and env values must be strings")
    if (
        not isinstance(request.command, list)
        or not request.command
        or not all(isinstance(a, str) for a in request.command)
    ):
        problems.append(f"command must be a non-empty list of strings, got {request.command!r}")
    if not 0 < request.timeout_s <= 3600:
        problems.append(f"timeout_s must be in (0, 3600], got {request.timeout_s}")
    if request.memory_mb < 32:
        problems.append(
            f"memory_mb must be >= 32 (an interpreter needs that), got {request.memory_mb}"
        )
    if request.network not in ("none", "host"):
        problems.append(f"network must be 'none' or 'host', got {request.network!r}")
    if request.max_processes < 1 or request.max_file_mb < 1 or request.workdir_mb < 1:
        problems.append("max_processes, max_file_mb and workdir_mb must be >= 1")
    if request.max_output_bytes < 1:
        problems.append(f"max_output_bytes must be >= 1, got {request.max_output_bytes}")
    for name in request.env:
        if not ENV_NAME.match(name):
            problems.append(f"env name {name!r} is not a valid variable name")
    for path in request.files:
        try:
            safe_relative_path(path)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


@dataclass
class ExecResult:
    """What happened: ``ok`` exit 0, ``error`` nonzero exit, ``timeout`` wall clock hit,
    ``killed`` ended by a signal or a sandbox limit, ``oom`` the memory limit was hit."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    duration_ms: float
    reason: str
    workspace_tar: bytes | None = field(default=None, repr=False, compare=False)
    """The /workspace contents after the run, when the caller asked to capture them."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (CLI and HTTP); the workspace tar stays in process."""
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "duration_ms": round(self.duration_ms, 3),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExecResult:
        return cls(
            status=data["status"],
            exit_code=data["exit_code"],
            stdout=data["stdout"],
            stderr=data["stderr"],
            duration_ms=float(data["duration_ms"]),
            reason=data["reason"],
        )


def safe_relative_path(path: str) -> str:
    """Normalise a workspace-relative path, refusing escapes.

    >>> safe_relative_path("src/./main.py")
    'src/main.py'
    >>> safe_relative_path("../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: file path '../etc/passwd' must stay inside the workspace (relative, no '..')
    """
    norm = os.path.normpath(path)
    if not path or os.path.isabs(path) or norm == ".." or norm.startswith("../") or norm == ".":
        raise ValueError(f"file path {path!r} must stay inside the workspace (relative, no '..')")
    return norm


def files_to_tar(files: Mapping[str, str | bytes]) -> bytes:
    """Pack ``{relative path: content}`` into an uncompressed tar (parents implied).

    >>> import tarfile, io
    >>> tarfile.open(fileobj=io.BytesIO(files_to_tar({"a/b.txt": "hi"}))).getnames()
    ['a/b.txt']
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in sorted(files.items()):
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(safe_relative_path(path))
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0  # deterministic bytes for identical input
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


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


class _UidPool:
    """Hands each concurrent execution its own unprivileged host uid (root only), so one
    sandbox's fork bomb cannot use up the process budget of another."""

    def __init__(self, base: int, size: int) -> None:
        self._free = list(range(base + size - 1, base - 1, -1))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise SandboxError(f"more than {HOST_UID_SLOTS} concurrent sandboxes")
            return self._free.pop()

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)

    @contextlib.contextmanager
    def uid(self) -> Any:
        uid = self.acquire()
        try:
            yield uid
        finally:
            self.release(uid)


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, rewound, for passing to bwrap."""
    fd = os.memfd_create(name)  # close-on-exec; Popen's pass_fds hands it to bwrap only
    _write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _host_root_binds() -> list[str]:
    """Bind /usr and recreate /bin, /sbin, /lib* the way the host has them (usrmerge links
    or real directories)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


class Executor:
    """Runs :class:`ExecRequest` s in fresh bubblewrap sandboxes; thread-safe."""

    def __init__(self, bwrap: str | None = None, warm_pool: int = 0) -> None:
        """``warm_pool`` > 0 keeps that many sandboxes pre-started for default-shaped
        requests (see :class:`WarmPool`); the runner server uses it, one-shot callers not."""
        self.bwrap = bwrap or shutil.which("bwrap") or ""
        self.prlimit = shutil.which("prlimit") or ""
        if not self.bwrap:
            raise SandboxError(
                "bubblewrap (bwrap) is not installed; install it with "
                "`apt-get install -y bubblewrap` (Debian/Ubuntu)"
            )
        self.setpriv = shutil.which("setpriv") or ""
        if not self.prlimit or not self.setpriv:
            raise SandboxError(
                "prlimit and setpriv are needed; they ship in util-linux "
                "(`apt-get install -y util-linux`)"
            )
        if not self._supports("--size"):
            raise SandboxError(
                f"{self.bwrap} is too old: posttrain needs bubblewrap >= 0.7 for size-capped "
                "tmpfs (--size); Debian 12 and Ubuntu 24.04 ship new enough versions"
            )
        self.is_root = os.geteuid() == 0
        self._uids = _UidPool(HOST_UID_BASE, HOST_UID_SLOTS)
        self._static_args = self._build_static_args()
        self.pool: WarmPool | None = None
        if warm_pool > 0:
            from .warm_pool import WarmPool  # imports this module: import it late

            self.pool = WarmPool(self, warm_pool)

    def close(self) -> None:
        """Stop the warm pool (its idle sandboxes are killed)."""
        if self.pool is not None:
            self.pool.close()

    def _build_static_args(self) -> list[str]:
        args = [
            "--unshare-all",
            "--unshare-user",
            "--die-with-parent",
            "--new-session",  # no TIOCSTI into our terminal
            "--uid", str(SANDBOX_UID),
            "--gid", str(SANDBOX_UID),
            "--hostname", "sandbox",
            *_host_root_binds(),
            "--proc", "/proc",
            "--dev", "/dev",
        ]  # fmt: skip
        if self._supports("--disable-userns"):
            # No nested user namespaces: less kernel surface (bubblewrap >= 0.8).
            args.append("--disable-userns")
        for path in ETC_ALLOWLIST:
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        return args

    def _supports(self, option: str) -> bool:
        """Whether this bwrap knows ``option`` (older distributions ship older versions)."""
        try:
            usage = subprocess.run(
                [self.bwrap, "--help"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
        return option in usage

    def run(
        self,
        request: ExecRequest,
        *,
        workspace_tar: bytes | None = None,
        capture_workspace: bool = False,
    ) -> ExecResult:
        """Run one request in a new sandbox and wait for it (never longer than its timeout).

        ``workspace_tar`` seeds /workspace before ``request.files`` are added; with
        ``capture_workspace`` the final /workspace comes back in ``ExecResult.workspace_tar``.
        """
        with tracer.start_as_current_span("sandbox.exec") as span:
            span.set_attribute("sandbox.command", " ".join(request.command)[:200])
            span.set_attribute("sandbox.network", request.network)
            pooled = (
                self.pool.take(request)
                if self.pool is not None and workspace_tar is None and not capture_workspace
                else None
            )
            span.set_attribute("sandbox.warm", pooled is not None)
            if pooled is not None:
                try:
                    result = self._run_pooled(pooled, request)
                finally:
                    pooled.release()
                    self._pool_finished()
            else:
                uid_context = self._uids.uid() if self.is_root else contextlib.nullcontext(None)
                with uid_context as host_uid:
                    result = self._run(request, host_uid, workspace_tar, capture_workspace)
            self._record(span, request, result)
        return result

    async def run_async(self, request: ExecRequest) -> ExecResult:
        """:meth:`run` for an event loop (the runner): waits on loop readers instead of
        blocking a thread. Workspaces are not supported here (use :meth:`run`)."""
        with tracer.start_as_current_span("sandbox.exec") as span:
            span.set_attribute("sandbox.command", " ".join(request.command)[:200])
            span.set_attribute("sandbox.network", request.network)
            pooled = self.pool.take(request) if self.pool is not None else None
            span.set_attribute("sandbox.warm", pooled is not None)
            if pooled is not None:
                try:
                    started = self._dispatch(pooled, request)
                    collected = await _collect_async(
                        pooled.proc, request, started, pooled.status_read
                    )
                finally:
                    os.close(pooled.status_read)
                    pooled.release()
                    self._pool_finished()
            else:
                host_uid = self._uids.acquire() if self.is_root else None
                try:
                    command, inherited = list(request.command), []
                    if request.files:
                        seed_fd = _memfd("workspace", files_to_tar(request.files))
                        inherited.append(seed_fd)
                        command = _workspace_wrapper(seed_fd, -1, command)
                    started = time.monotonic()
                    proc, status_read = self._spawn(request, host_uid, command, inherited)
                    try:
                        collected = await _collect_async(proc, request, started, status_read)
                    finally:
                        os.close(status_read)
                finally:
                    if host_uid is not None:
                        self._uids.release(host_uid)
            result = _finish(request, collected, (time.monotonic() - started) * 1000, False)
            self._record(span, request, result)
        return result

    def _pool_finished(self) -> None:
        if self.pool is not None:
            self.pool.finished()

    @staticmethod
    def _record(span: Any, request: ExecRequest, result: ExecResult) -> None:
        span.set_attribute("sandbox.status", result.status)
        span.set_attribute(
            "sandbox.exit_code", -1 if result.exit_code is None else result.exit_code
        )
        span.set_attribute("sandbox.duration_ms", result.duration_ms)
        SANDBOX_LATENCY.observe(result.duration_ms / 1000)
        SANDBOX_EXECUTIONS.labels(result.status).inc()
        log.debug(
            "sandbox %s: %s (%.1f ms)", request.command[:1], result.reason, result.duration_ms
        )

    def _drop_to(self, host_uid: int | None) -> list[str]:
        """The ``setpriv`` prefix that switches to the unprivileged host uid.

        Not ``Popen(user=...)``: that rules out vfork, and forking a runner-sized Python
        process holds the GIL for ~13 ms per sandbox; vfork + setpriv costs ~0.2 ms here."""
        if host_uid is None:
            return []
        uid = str(host_uid)
        return [self.setpriv, "--reuid", uid, "--regid", uid, "--clear-groups"]

    def rlimits(self, request: ExecRequest) -> dict[str, tuple[int, int]]:
        """The resource limits of ``request``'s sandbox: name -> (soft, hard), in the
        kernel's units (bytes, seconds, counts)."""
        cpu = request.cpu_time_s or math.ceil(request.timeout_s) + 1
        memory = request.memory_mb << 20
        nproc = request.max_processes
        fsize = request.max_file_mb << 20
        return {
            "as": (memory, memory),
            # soft:hard one second apart, so the program gets SIGXCPU (reported as the CPU
            # limit) before the kernel's SIGKILL at the hard limit.
            "cpu": (cpu, cpu + 1),
            "nproc": (nproc, nproc),
            "fsize": (fsize, fsize),
            "nofile": (1024, 1024),
            "core": (0, 0),  # a crash dump would be a host-side file write
        }

    def _limits(self, request: ExecRequest) -> tuple[list[str], list[str]]:
        """The ``prlimit`` prefixes that apply :meth:`rlimits`: (before bwrap, inside it).

        The kernel counts ``RLIMIT_NPROC`` per user *and user namespace*: a fork fails once
        the processes of the forking uid exceed the limit in the namespace's own count or in
        any parent namespace's count, where the limit is that of the namespace's creator.
        As root every sandbox runs as its own host uid, so the limit applied before bwrap
        counts that sandbox alone. Not as root, every sandbox runs as our uid, which this
        process, our other concurrent sandboxes and, on a shared node, every other
        process of that uid also use; applied before bwrap, the limit would count them all
        and a fork bomb in one sandbox (or an unrelated busy pod) would fail the next
        sandbox's forks, scoring an innocent program as broken. So then the process limit
        is set inside the sandbox's fresh user namespace, whose count holds only its own
        processes, and bwrap keeps our (much larger) limit for the parent's count."""
        limits = self.rlimits(request)
        inside: list[str] = []
        if not self.is_root:
            soft, hard = limits.pop("nproc")
            inside = [self.prlimit, f"--nproc={soft}:{hard}", "--"]
        outside = [
            self.prlimit,
            *(f"--{name}={soft}:{hard}" for name, (soft, hard) in limits.items()),
            "--",
        ]
        return outside, inside

    def _spawn(
        self,
        request: ExecRequest,
        host_uid: int | None,
        command: list[str],
        inherited_fds: list[int],
        *,
        limits_inside: bool = False,
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Start bwrap for ``request``'s limits running ``command``; returns the process and
        the read end of its --json-status-fd. ``inherited_fds`` are handed to the sandbox and
        closed here (the child holds its copies, so EOF arrives when it exits).
        ``limits_inside``: ``command`` applies :meth:`rlimits` itself before it runs anything
        untrusted (the warm pool's launcher does, saving the ``prlimit`` exec)."""
        owned: list[int] = []
        outside, inside = ([], []) if limits_inside else self._limits(request)
        try:
            args = [*self._drop_to(host_uid), *outside, self.bwrap, *self._static_args]
            if request.network != "none":
                args.append("--share-net")
                args += [a for p in ETC_NETWORK if os.path.exists(p) for a in ("--ro-bind", p, p)]
            size = str(request.workdir_mb << 20)
            args += ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", WORKDIR]
            for path, content in (
                (
                    "/etc/passwd",
                    f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::{WORKDIR}:/bin/sh\n"
                    "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n",
                ),
                ("/etc/group", f"sandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"),
            ):
                fd = _memfd(os.path.basename(path), content.encode())
                owned.append(fd)
                args += ["--ro-bind-data", str(fd), path]
            status_read, status_write = os.pipe()
            owned.append(status_write)
            args += ["--json-status-fd", str(status_write), "--chdir", WORKDIR, "--clearenv"]
            env = {
                "PATH": SANDBOX_PATH,
                "HOME": WORKDIR,
                "LANG": "C.UTF-8",
                "TMPDIR": "/tmp",
                "USER": "sandbox",
                **request.env,
            }
            for name, value in env.items():
                args += ["--setenv", name, value]
            args += ["--", *inside, *command]
            try:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=[*owned, *inherited_fds],
                    cwd="/",
                    env={},
                    start_new_session=True,  # our own process group, killed as one
                )
            except OSError as exc:
                os.close(status_read)
                raise SandboxError(f"could not start bubblewrap ({self.bwrap}): {exc}") from exc
            return proc, status_read
        finally:
            for fd in [*owned, *inherited_fds]:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _run(
        self,
        request: ExecRequest,
        host_uid: int | None,
        workspace_tar: bytes | None,
        capture_workspace: bool,
    ) -> ExecResult:
        command = list(request.command)
        inherited: list[int] = []
        out_read = -1
        seed = _merge_seed(workspace_tar, request.files)
        if seed is not None or capture_workspace:
            seed_fd = _memfd("workspace", seed or files_to_tar({}))
            inherited.append(seed_fd)
            out_write = -1
            if capture_workspace:
                out_read, out_write = os.pipe()
                inherited.append(out_write)
            command = _workspace_wrapper(seed_fd, out_write, command)
        started = time.monotonic()
        try:
            proc, status_read = self._spawn(request, host_uid, command, inherited)
        except BaseException:
            if out_read >= 0:
                os.close(out_read)
            raise
        return _wait_for(proc, request, started, status_read, out_read, capture_workspace)

    def _run_pooled(self, sandbox: PooledSandbox, request: ExecRequest) -> ExecResult:
        """Hand ``request`` to a pre-started sandbox: only the program's own start-up remains."""
        started = self._dispatch(sandbox, request)
        return _wait_for(sandbox.proc, request, started, sandbox.status_read, -1, False)

    def _dispatch(self, sandbox: PooledSandbox, request: ExecRequest) -> float:
        """Send the argv to a pooled sandbox's launcher, then let the pool refill if it ran
        low; returns the start time. A refill starts only after the hand-off, so building
        the next sandbox never delays handing this one its program."""
        started = time.monotonic()
        try:
            _write_all(sandbox.control, b"\0".join(a.encode() for a in request.command) + b"\0")
        except BrokenPipeError:
            pass  # the launcher died; collecting reports what happened
        finally:
            os.close(sandbox.control)
            if self.pool is not None:
                self.pool.replenish()
        return started


def _wait_for(
    proc: subprocess.Popen[bytes],
    request: ExecRequest,
    started: float,
    status_read: int,
    out_read: int,
    capture_workspace: bool,
) -> ExecResult:
    try:
        collected = _collect(
            proc, request, started, status_read, out_read if capture_workspace else None
        )
        duration_ms = (time.monotonic() - started) * 1000
        return _finish(request, collected, duration_ms, capture_workspace)
    finally:
        for fd in (status_read, out_read):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _merge_seed(workspace_tar: bytes | None, files: Mapping[str, str]) -> bytes | None:
    """One tar with the workspace state and the request's files on top (None if neither)."""
    if workspace_tar is None and not files:
        return None
    if workspace_tar is None:
        return files_to_tar(files)
    if not files:
        return workspace_tar
    merged = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(workspace_tar)) as base,
        tarfile.open(fileobj=merged, mode="w", format=tarfile.PAX_FORMAT) as out,
    ):
        overridden = {safe_relative_path(p) for p in files}
        for member in base.getmembers():
            if os.path.normpath(member.name) not in overridden:
                out.addfile(member, base.extractfile(member) if member.isfile() else None)
        with tarfile.open(fileobj=io.BytesIO(files_to_tar(files))) as extra:
            for member in extra.getmembers():
                out.addfile(member, extra.extractfile(member))
    return merged.getvalue()


def _workspace_wrapper(seed_fd: int, out_fd: int, command: list[str]) -> list[str]:
    """Wrap ``command`` in a bash prologue that unpacks the seed tar into /workspace and,
    when ``out_fd`` >= 0, an epilogue that streams /workspace back as a tar. The program runs
    with both descriptors closed, so it can neither read the seed twice nor forge the output.
    """
    script = (
        "seed=$1; out=$2; shift 2; "
        # Redirections, not /dev/fd/N paths: reopening a pipe created by the host is denied.
        'eval "tar -xf - -C /workspace --no-same-owner --no-same-permissions <&$seed" '
        '|| { echo "sandbox: could not unpack the workspace" >&2; exit 125; }; '
        'eval "exec $seed<&-"; '
        'if [ "$out" -lt 0 ]; then exec "$@"; fi; '
        'eval "\\"\\$@\\" $out>&-"; rc=$?; '
        'eval "tar -cf - -C /workspace . >&$out" 2>/dev/null; exit $rc'
    )
    # bash, not dash: inherited descriptors are often >= 10, which dash cannot redirect.
    return ["bash", "-c", script, "sandbox-workspace", str(seed_fd), str(out_fd), *command]


@dataclass
class _Collected:
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


def _collect(
    proc: subprocess.Popen[bytes],
    request: ExecRequest,
    started: float,
    status_fd: int,
    workspace_fd: int | None,
) -> _Collected:
    """Feed stdin and drain every pipe until the sandbox is gone or the deadline passes."""
    got = _Collected()
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
            _kill(proc)
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
                _kill(proc)
    selector.close()
    # After a kill the pid namespace dies with bwrap; the wait is short either way.
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic() + 1.0))
    except subprocess.TimeoutExpired:
        _kill(proc)
        proc.wait()
    _close_out(proc, got, status_fd)
    return got


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL bwrap's process group; pid 1 of the sandbox dies with it, and with pid 1
    every process in the sandbox."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _close_out(proc: subprocess.Popen[bytes], got: _Collected, status_fd: int) -> None:
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


async def _collect_async(
    proc: subprocess.Popen[bytes], request: ExecRequest, started: float, status_fd: int
) -> _Collected:
    """:func:`_collect` for an event loop: the same bookkeeping, driven by loop readers, so a
    server needs no thread (and no GIL hand-off) per execution."""
    loop = asyncio.get_running_loop()
    got = _Collected()
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
            _kill(proc)

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
            _kill(proc)
        finally:
            for fd in list(readers):
                loop.remove_reader(fd)
            if not proc.stdin.closed:
                loop.remove_writer(stdin_fd)
        # Pipes close as bwrap exits; its exit status follows within moments.
        await _exited(proc, deadline + 1.0)
    except asyncio.CancelledError:
        # The caller went away (client disconnect, shutdown): the sandbox must not outlive it.
        _kill(proc)
        proc.wait()
        _close_out(proc, got, status_fd)
        raise
    _close_out(proc, got, status_fd)
    return got


async def _exited(proc: subprocess.Popen[bytes], kill_at: float) -> None:
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
                _kill(proc)
            await asyncio.sleep(0.0005)
        return
    exited: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
    try:
        await asyncio.wait_for(exited, max(0.0, kill_at - time.monotonic()))
    except TimeoutError:
        _kill(proc)  # the pid namespace dies with bwrap: the reap below is immediate
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


def _finish(
    request: ExecRequest, got: _Collected, duration_ms: float, capture_workspace: bool
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


_default: Executor | None = None
_default_lock = threading.Lock()


def default_executor() -> Executor:
    """A process-wide executor (building one resolves binaries and host binds once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Executor()
        return _default
