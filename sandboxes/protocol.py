"""What callers and the sandbox exchange: one execution's request and result, and the error
that says the sandbox (not the program) failed.

The wire contract of the CLI, the runner's HTTP API and the trainer's verifiers; plain
dataclasses and validation, no process handling, so any side imports it cheaply
(:mod:`.executor` runs requests, :mod:`.client` sends them to a runner).
"""

from __future__ import annotations

import io
import math
import os
import re
import reprlib
import tarfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "killed", "oom"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "killed", "oom")

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Values quoted in error messages are shortened: a request may carry megabytes in one field,
# or lists nested hundreds deep, and the message must stay one readable line.
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist = 2, 60, 60, 4


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
    # Requests arrive as JSON from other processes: check types, not just values.
    problems = _type_problems(request)
    if problems:
        return problems
    return [*_value_problems(request), *_name_problems(request)]


# Each field's accepted JSON types (bool is refused wherever an int is wanted).
_FIELD_TYPES: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("stdin", str),
    ("files", dict),
    ("env", dict),
    ("timeout_s", (int, float)),
    ("memory_mb", int),
    ("cpu_time_s", (int, type(None))),
    ("max_processes", int),
    ("max_file_mb", int),
    ("workdir_mb", int),
    ("max_output_bytes", int),
)


def _type_problems(request: ExecRequest) -> list[str]:
    problems = []
    for name, kind in _FIELD_TYPES:
        value = getattr(request, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"{name} has the wrong type: {_SHORT.repr(value)}")
    return problems


def _value_problems(request: ExecRequest) -> list[str]:
    problems = []
    if not all(isinstance(v, str) for v in [*request.files.values(), *request.env.values()]):
        problems.append("files and env values must be strings")
    if (
        not isinstance(request.command, list)
        or not request.command
        or not all(isinstance(a, str) for a in request.command)
    ):
        problems.append(
            f"command must be a non-empty list of strings, got {_SHORT.repr(request.command)}"
        )
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
    if request.cpu_time_s is not None and request.cpu_time_s < 1:
        problems.append(f"cpu_time_s must be >= 1, got {request.cpu_time_s}")
    return problems


def _name_problems(request: ExecRequest) -> list[str]:
    problems = []
    for name in request.env:
        if not ENV_NAME.match(name):
            problems.append(f"env name {_SHORT.repr(name)} is not a valid variable name")
    for path in request.files:
        try:
            safe_relative_path(path)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


@dataclass(frozen=True)
class ExecLimits:
    """The most a request may ask of a runner: its operator's policy (``posttrain sandbox
    serve`` flags). A request may ask for less, never more; a value over a limit is refused
    with the field and the limit named, not silently lowered, so the caller learns its
    verifier asks for something this runner will not give. The defaults are generous for a
    standalone runner; the operator's runner for a TrainingRun gets the run's
    ``spec.sandbox.timeoutSeconds`` and ``memoryMb``."""

    allow_host_network: bool = False
    """Whether ``network: "host"`` is allowed. Off: a sandbox on a shared runner reaching the
    network (the cluster, the metadata service) is an escape, so it needs an explicit flag."""
    max_timeout_s: float = 600.0
    """Wall-clock seconds (``timeout_s``); also bounds ``cpu_time_s`` (at most
    ceil(max_timeout_s) + 1, the default CPU limit of the longest run). Ten minutes: a slot
    held longer starves every other caller."""
    max_memory_mb: int = 4096
    """Address space in MiB (``memory_mb``; requests default to 512)."""
    max_processes: int = 256
    """Processes per sandbox (``max_processes``; requests default to 64)."""
    max_file_mb: int = 512
    """Largest file a program may write, in MiB (``max_file_mb``; default 64)."""
    max_workdir_mb: int = 512
    """Size of each of the /workspace and /tmp tmpfs, in MiB (``workdir_mb``; default 64):
    memory-backed, so it counts against the runner pod's memory."""
    max_output_bytes: int = 16 << 20
    """Bytes of stdout and of stderr kept (``max_output_bytes``; default 1 MiB)."""

    def __post_init__(self) -> None:
        for name in LIMITED_FIELDS.values():
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def max_cpu_time_s(self) -> int:
        return math.ceil(self.max_timeout_s) + 1

    def violations(self, request: ExecRequest) -> list[str]:
        """Every way ``request`` asks for more than these limits (empty list = within them).

        >>> ExecLimits(max_processes=8).violations(ExecRequest(["true"], max_processes=9))
        ["max_processes=9 is over this runner's limit of 8 (posttrain sandbox serve --max-processes); ask for at most 8"]
        """
        problems = [
            _over(field_name, getattr(request, field_name), getattr(self, limit))
            for field_name, limit in LIMITED_FIELDS.items()
            if getattr(request, field_name) > getattr(self, limit)
        ]
        if request.cpu_time_s is not None and request.cpu_time_s > self.max_cpu_time_s:
            problems.append(
                _over("cpu_time_s", request.cpu_time_s, self.max_cpu_time_s, "max-timeout-s")
            )
        if request.network != "none" and not self.allow_host_network:
            problems.append(
                f"network={request.network!r} is not allowed by this runner (started without "
                "posttrain sandbox serve --allow-host-network); use network 'none'"
            )
        return problems


# Request field -> the ExecLimits field that caps it (and names its serve flag).
LIMITED_FIELDS = {
    "timeout_s": "max_timeout_s",
    "memory_mb": "max_memory_mb",
    "max_processes": "max_processes",
    "max_file_mb": "max_file_mb",
    "workdir_mb": "max_workdir_mb",
    "max_output_bytes": "max_output_bytes",
}


def _over(name: str, value: float, limit: float, flag: str | None = None) -> str:
    """The message for ``name=value`` over ``limit``, naming the serve flag that sets it.

    >>> _over("timeout_s", 900.5, 600.0)
    "timeout_s=900.5 is over this runner's limit of 600 (posttrain sandbox serve --max-timeout-s); ask for at most 600"
    """
    flag = flag or LIMITED_FIELDS[name].replace("_", "-")
    value_text, limit_text = (f"{v:g}" if isinstance(v, float) else str(v) for v in (value, limit))
    return (
        f"{name}={value_text} is over this runner's limit of {limit_text} "
        f"(posttrain sandbox serve --{flag}); ask for at most {limit_text}"
    )


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
