"""Entrypoint of SandboxTask pods that store artifacts: restore, run, keep logs, snapshot.

Shipped *into* the sandbox pod (the operator mounts this file from a ConfigMap) and run by
the task image's own ``python3``, so it uses the standard library only and never imports
posttrain. It holds no credentials: the operator hands it presigned URLs, each good for one
object only (this attempt's log, this attempt's snapshot, the snapshot to restore), so the
untrusted program, which can read the same environment, can do nothing with them that it
could not do through its own output anyway.

    python3 entrypoint.py -- CMD [ARG...]

1. ``POSTTRAIN_SANDBOX_RESTORE_URL``: GET a workdir tar and unpack it into the workdir
   (members that would escape it, links and devices are skipped; files already there, i.e.
   spec.files, win).
2. Run CMD with stdout+stderr on one pipe (the order ``kubectl logs`` shows), echoed to our
   stdout and kept (up to ``POSTTRAIN_SANDBOX_LOG_LIMIT`` bytes, head kept, the cut noted).
   ``POSTTRAIN_SANDBOX_TIMEOUT`` seconds is the program's wall clock: at expiry its process
   group is killed and the result says Timeout (the pod's activeDeadlineSeconds, set a
   little longer by the operator, leaves time for the uploads that follow).
3. PUT the log to ``POSTTRAIN_SANDBOX_LOGS_URL``; with ``POSTTRAIN_SANDBOX_SNAPSHOT_URL`` PUT
   a tar of the workdir (the uncompressed tar ``posttrain.sandboxes.snapshot`` uses).
4. Write the result JSON to the termination-message file, merged over whatever JSON the
   program wrote there itself (its reward/reason win), adding ``logs_uploaded`` and
   ``snapshot_uploaded``; exit with the program's exit code.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WORKDIR_ENV = "POSTTRAIN_SANDBOX_WORKDIR"
RESULT_PATH_ENV = "POSTTRAIN_SANDBOX_RESULT_PATH"
TIMEOUT_ENV = "POSTTRAIN_SANDBOX_TIMEOUT"
LOG_LIMIT_ENV = "POSTTRAIN_SANDBOX_LOG_LIMIT"
LOGS_URL_ENV = "POSTTRAIN_SANDBOX_LOGS_URL"
SNAPSHOT_URL_ENV = "POSTTRAIN_SANDBOX_SNAPSHOT_URL"
RESTORE_URL_ENV = "POSTTRAIN_SANDBOX_RESTORE_URL"

DEFAULT_LOG_LIMIT = 8 * 1024 * 1024
# The kubelet keeps at most 4 KiB of a termination message.
RESULT_LIMIT = 4096
TIMEOUT_EXIT_CODE = 124
HTTP_TIMEOUT_S = 60.0
CGROUP_MEMORY_EVENTS = Path("/sys/fs/cgroup/memory.events")


def log(message: str) -> None:
    """Our own notes go to stderr with a prefix, so they are told apart from the program's."""
    print(f"[posttrain-entrypoint] {message}", file=sys.stderr, flush=True)


def http(method: str, url: str, data: bytes | None = None) -> bytes:
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/octet-stream")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        body: bytes = response.read()
        return body


def safe_member(member: tarfile.TarInfo, workdir: Path) -> Path | None:
    """Where a tar member may be unpacked inside ``workdir``, or None to skip it.

    Only regular files and directories; nothing absolute, nothing climbing out with ``..``.

    >>> info = tarfile.TarInfo("../etc/passwd")
    >>> safe_member(info, Path("/w")) is None
    True
    >>> str(safe_member(tarfile.TarInfo("./src/a.py"), Path("/w")))
    '/w/src/a.py'
    """
    if not (member.isfile() or member.isdir()):
        return None
    name = os.path.normpath(member.name)
    if name in (".", "") or os.path.isabs(name) or name == ".." or name.startswith("../"):
        return None
    return workdir / name


def restore(tar_bytes: bytes, workdir: Path) -> int:
    """Unpack a workdir tar into ``workdir`` without overwriting existing files.

    Returns how many files were written.
    """
    written = 0
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for member in tar.getmembers():
            target = safe_member(member, workdir)
            if target is None:
                continue
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if target.exists():
                continue  # spec.files were copied in first: they win over the snapshot
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            if source is None:
                continue
            target.write_bytes(source.read())
            target.chmod(member.mode & 0o755 | 0o600)
            written += 1
    return written


def snapshot(workdir: Path) -> bytes:
    """A PAX tar of the workdir: regular files, directories and symlinks (links are stored as
    links, never followed), names relative to the workdir."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(workdir, followlinks=False):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                path = Path(root) / name
                arcname = str(path.relative_to(workdir))
                if path.is_symlink() or path.is_file() or path.is_dir():
                    tar.add(str(path), arcname=arcname, recursive=False)
    return buffer.getvalue()


class LogTee:
    """Copies the program's output to our stdout and keeps the first ``limit`` bytes."""

    def __init__(self, stream: Any, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.total = 0
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: Any) -> None:
        out = sys.stdout.buffer
        for chunk in iter(lambda: stream.read1(65536), b""):
            out.write(chunk)
            out.flush()
            self.total += len(chunk)
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]

    def text(self, wait_s: float = 5.0) -> bytes:
        """What was kept; a note at the end says how much was cut."""
        self._thread.join(wait_s)
        if self.total > len(self.kept):
            cut = self.total - len(self.kept)
            return bytes(self.kept) + f"\n[posttrain: {cut} more byte(s) not kept]\n".encode()
        return bytes(self.kept)


def oom_kills() -> int:
    """The container cgroup's OOM-kill count (cgroup v2); 0 when unreadable."""
    try:
        for line in CGROUP_MEMORY_EVENTS.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def run_program(
    command: Sequence[str], timeout_s: float | None, log_limit: int
) -> tuple[int, str, float, bytes]:
    """Run ``command``; returns (exit code, reason, duration in ms, kept log bytes)."""
    oom_before = oom_kills()
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        message = f"cannot start {command[0]!r}: {exc}\n".encode()
        return 127, "Error", 0.0, message
    tee = LogTee(proc.stdout, log_limit)
    reason = ""
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: background children too
        proc.wait()
        code, reason = TIMEOUT_EXIT_CODE, "Timeout"
    duration_ms = (time.monotonic() - started) * 1000.0
    if code < 0:
        code = 128 - code  # killed by signal N: the shell convention 128 + N
    if not reason and oom_kills() > oom_before:
        reason = "OOMKilled"
    if not reason:
        reason = "Completed" if code == 0 else "Error"
    return code, reason, duration_ms, tee.text()


# What we measured ourselves; a program cannot overwrite these in its own result JSON.
MEASURED = ("exit_code", "duration_ms", "logs_uploaded", "snapshot_uploaded")
# Reasons we decide over the program's (it was killed; whatever it wrote before is moot).
FORCED_REASONS = ("Timeout", "OOMKilled")


def merged_result(program_message: str, ours: dict[str, Any]) -> str:
    """Our result JSON merged with the program's own: its reward (and its reason, unless we
    killed it) win; exit code, duration and upload flags are ours.

    >>> merged_result('{"reward": 0.5, "exit_code": 0}', {"exit_code": 1, "reason": "Error"})
    '{"exit_code": 1, "reason": "Error", "reward": 0.5}'
    >>> merged_result('{"reason": "Completed"}', {"exit_code": 124, "reason": "Timeout"})
    '{"exit_code": 124, "reason": "Timeout"}'
    >>> merged_result("not json", {"exit_code": 1})
    '{"exit_code": 1}'
    """
    result = dict(ours)
    try:
        theirs = json.loads(program_message) if program_message.strip().startswith("{") else {}
    except ValueError:
        theirs = {}
    if isinstance(theirs, dict):
        for key, value in theirs.items():
            if key in MEASURED or (key == "reason" and ours.get("reason") in FORCED_REASONS):
                continue
            result[key] = value
    return json.dumps(result)[:RESULT_LIMIT]


def main(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    env = dict(os.environ) if env is None else env
    command = list(argv[1:] if argv and argv[0] == "--" else argv)
    if not command:
        log("usage: entrypoint.py -- CMD [ARG...]")
        return 2
    workdir = Path(env.get(WORKDIR_ENV, "/workspace"))
    result_path = Path(env.get(RESULT_PATH_ENV, "/dev/termination-log"))
    timeout = float(env[TIMEOUT_ENV]) if env.get(TIMEOUT_ENV) else None
    log_limit = int(env.get(LOG_LIMIT_ENV) or DEFAULT_LOG_LIMIT)

    if env.get(RESTORE_URL_ENV):
        try:
            count = restore(http("GET", env[RESTORE_URL_ENV]), workdir)
            log(f"restored {count} file(s) from the snapshot")
        except (OSError, tarfile.TarError) as exc:
            # The program still runs, from spec.files only; the log says why.
            log(f"could not restore the snapshot: {exc}")

    code, reason, duration_ms, output = run_program(command, timeout, log_limit)

    logs_uploaded = snapshot_uploaded = False
    if env.get(LOGS_URL_ENV):
        try:
            http("PUT", env[LOGS_URL_ENV], output)
            logs_uploaded = True
        except OSError as exc:
            log(f"could not store the log: {exc}")
    if env.get(SNAPSHOT_URL_ENV):
        try:
            http("PUT", env[SNAPSHOT_URL_ENV], snapshot(workdir))
            snapshot_uploaded = True
        except (OSError, tarfile.TarError) as exc:
            log(f"could not store the workdir snapshot: {exc}")

    try:
        program_message = result_path.read_text(errors="replace") if result_path.exists() else ""
    except OSError:
        program_message = ""
    result = merged_result(
        program_message,
        {
            "exit_code": code,
            "duration_ms": round(duration_ms, 3),
            "reason": reason,
            "logs_uploaded": logs_uploaded,
            "snapshot_uploaded": snapshot_uploaded,
        },
    )
    try:
        result_path.write_text(result)
    except OSError as exc:
        log(f"could not write the result to {result_path}: {exc}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
