"""What callers and the sandbox exchange: one execution's request and result, and the error
that says the sandbox (not the program) failed.

The wire contract of the CLI, the runner's HTTP API and the trainer's verifiers; plain
dataclasses and validation, no process handling, so any side imports it cheaply
(:mod:`.executor` runs requests, :mod:`.client` sends them to a runner).
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "killed", "oom"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "killed", "oom")

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
