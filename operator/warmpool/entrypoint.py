"""The waiting entrypoint of a SandboxWarmPool pod (stdlib only: it runs in the task image).

The operator starts it as ``python3 -c <this file's source>``. It waits until the pod is
claimed, i.e. until the operator has written the task into the pod's ``posttrain.io/claim``
annotation, which the kubelet projects into ``$POSTTRAIN_CLAIM_FILE`` (a downward-API file:
empty until the annotation exists). Then it writes the task's files into the workdir and
``exec``s the command, so from there on the pod is exactly a cold sandbox pod: same PID,
same exit code, same /dev/termination-log result protocol, and the kubelet enforces the
task's deadline through the activeDeadlineSeconds the claim set.

Why the pod's own annotation and not an HTTP call from the operator: a sandbox pod with
network=none accepts no traffic at all (default-deny NetworkPolicy), and it holds no API
credentials, so nothing in it can be talked into claiming a different task.
"""

from __future__ import annotations

import json
import os
import posixpath
import sys
import time
from typing import Any

POLL_SECONDS = 0.05
# Copies of posttrain/api/env.py's names (this file runs with the stdlib only; a test keeps
# them equal).
CLAIM_FILE_ENV = "POSTTRAIN_CLAIM_FILE"
WORKDIR_ENV = "POSTTRAIN_WORKDIR"
TASK_ENV = "POSTTRAIN_SANDBOX_TASK"
ATTEMPT_ENV = "POSTTRAIN_SANDBOX_ATTEMPT"


def read_claim(path: str) -> dict[str, Any] | None:
    """The claimed task, or None while the pod is idle (file missing or empty)."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return None
    if not text.strip():
        return None
    claim = json.loads(text)
    if not isinstance(claim, dict):
        raise ValueError(f"claim in {path} is not a JSON object")
    return claim


def safe_path(workdir: str, name: str) -> str:
    """``workdir/name`` for a plain relative name; anything escaping the workdir is refused.

    >>> safe_path("/w", "tests/t.py")
    '/w/tests/t.py'
    >>> safe_path("/w", "../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: file name '../etc/passwd' escapes the workdir
    """
    normalised = posixpath.normpath(name)
    if not name or name.startswith("/") or normalised.startswith("..") or normalised != name:
        raise ValueError(f"file name {name!r} escapes the workdir")
    return posixpath.join(workdir, name)


def write_files(workdir: str, files: dict[str, str]) -> None:
    for name, content in files.items():
        path = safe_path(workdir, name)
        os.makedirs(posixpath.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(content)


def main() -> None:
    claim_file = os.environ[CLAIM_FILE_ENV]
    workdir = os.environ.get(WORKDIR_ENV, os.getcwd())
    claim = read_claim(claim_file)
    while claim is None:
        time.sleep(POLL_SECONDS)
        claim = read_claim(claim_file)
    files = claim.get("files") or {}
    write_files(workdir, files)
    command = list(claim.get("command") or []) or ["python", "main.py"]
    os.chdir(workdir)
    os.environ[TASK_ENV] = str(claim.get("task", ""))
    os.environ[ATTEMPT_ENV] = "1"
    stdin = claim.get("stdin")
    if stdin is not None:
        stdin_path = os.path.join(workdir, ".stdin")
        with open(stdin_path, "w", encoding="utf-8") as handle:
            handle.write(stdin)
        fd = os.open(stdin_path, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    sys.stdout.flush()
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
