"""Start one untrusted program (model output) in a fresh bubblewrap sandbox.

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

import contextlib
import io
import math
import os
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator, Mapping

from .protocol import ExecRequest, SandboxError, files_to_tar, safe_relative_path

WORKDIR = "/workspace"
SANDBOX_UID = 1000
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
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


class UidPool:
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
    def uid(self) -> Iterator[int]:
        uid = self.acquire()
        try:
            yield uid
        finally:
            self.release(uid)


def memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding ``data``, rewound, for passing to bwrap."""
    fd = os.memfd_create(name)  # close-on-exec; Popen's pass_fds hands it to bwrap only
    write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def write_all(fd: int, data: bytes) -> None:
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


class Bubblewrap:
    """Starts bwrap processes for requests: binaries resolved and host binds listed once;
    thread-safe. Waiting for the program and reading its output is :mod:`.collect`'s."""

    def __init__(self, bwrap: str | None = None) -> None:
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
        if not self.supports("--size"):
            raise SandboxError(
                f"{self.bwrap} is too old: posttrain needs bubblewrap >= 0.7 for size-capped "
                "tmpfs (--size); Debian 12 and Ubuntu 24.04 ship new enough versions"
            )
        self.is_root = os.geteuid() == 0
        self.uids = UidPool(HOST_UID_BASE, HOST_UID_SLOTS)
        self.static_args = self._build_static_args()

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
        if self.supports("--disable-userns"):
            # No nested user namespaces: less kernel surface (bubblewrap >= 0.8).
            args.append("--disable-userns")
        for path in ETC_ALLOWLIST:
            if os.path.exists(path):
                args += ["--ro-bind", path, path]
        return args

    def supports(self, option: str) -> bool:
        """Whether this bwrap knows ``option`` (older distributions ship older versions)."""
        try:
            usage = subprocess.run(
                [self.bwrap, "--help"], capture_output=True, text=True, timeout=10
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return False
        return option in usage

    def drop_to(self, host_uid: int | None) -> list[str]:
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

    def limits(self, request: ExecRequest) -> tuple[list[str], list[str]]:
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

    def spawn(
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
        outside, inside = ([], []) if limits_inside else self.limits(request)
        try:
            args = [*self.drop_to(host_uid), *outside, self.bwrap, *self.static_args]
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
                fd = memfd(os.path.basename(path), content.encode())
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


def merge_seed(workspace_tar: bytes | None, files: Mapping[str, str]) -> bytes | None:
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


def workspace_wrapper(seed_fd: int, out_fd: int, command: list[str]) -> list[str]:
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
