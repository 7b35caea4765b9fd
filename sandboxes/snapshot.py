"""A persistent workspace for multi-step agent episodes, with snapshots and rollback.

Every step still runs in a brand-new sandbox (no process survives between steps); what
persists is the contents of /workspace, carried as a tar stream in and out of each sandbox
(see ``Executor.run(workspace_tar=..., capture_workspace=True)``). Keeping the state as
bytes on the host, never unpacked, has three consequences we want:

* a snapshot is just the current bytes, and rollback is an assignment: O(1), no copies of
  directory trees, nothing the program wrote is ever materialised on the host filesystem;
* steps are atomic: a step that times out or kills its own shell returns no tar, so the
  workspace stays exactly as it was before the step;
* a failed step can be replayed from the identical state it started from.
"""

from __future__ import annotations

import hashlib
import io
import logging
import tarfile
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from prometheus_client import Counter

from .protocol import ExecRequest, ExecResult, files_to_tar, safe_relative_path

log = logging.getLogger(__name__)

WORKSPACE_OPERATIONS = Counter(
    "posttrain_sandbox_workspace_operations_total",
    "Workspace snapshot/rollback/replay operations.",
    ["operation"],
)


class WorkspaceExecutor(Protocol):
    """What a workspace needs from an executor (the local bubblewrap :class:`Executor`)."""

    def run(
        self,
        request: ExecRequest,
        *,
        workspace_tar: bytes | None = ...,
        capture_workspace: bool = ...,
    ) -> ExecResult: ...


@dataclass(frozen=True)
class Step:
    """One executed step: enough to replay it from the same starting state."""

    request: ExecRequest
    state_before: bytes = field(repr=False)
    result: ExecResult


def snapshot_id(state: bytes) -> str:
    """Content address of a workspace state: equal contents give equal ids.

    >>> snapshot_id(b"abc")
    'ba7816bf8f01cfea'
    """
    return hashlib.sha256(state).hexdigest()[:16]


class Workspace:
    """A /workspace that outlives single executions.

    >>> # ws = Workspace(Executor()); ws.run(["sh", "-c", "echo 1 > a"]); sid = ws.snapshot()
    >>> # ws.run(["rm", "a"]); ws.rollback(sid); ws.read_file("a") == b"1\\n"
    """

    def __init__(self, executor: WorkspaceExecutor, **request_defaults: Any) -> None:
        """``request_defaults`` are :class:`ExecRequest` fields applied to every step
        (timeout_s, memory_mb, network, ...)."""
        self.executor = executor
        self.request_defaults = request_defaults
        self._state: bytes = files_to_tar({})
        self._snapshots: dict[str, bytes] = {}
        self.history: list[Step] = []

    def run(
        self,
        command: list[str],
        *,
        stdin: str = "",
        files: dict[str, str] | None = None,
        **overrides: Any,
    ) -> ExecResult:
        """Run one step in a fresh sandbox seeded with the current workspace; keep its
        changes unless it timed out or lost its state (then nothing changes)."""
        request = ExecRequest(
            command=command,
            stdin=stdin,
            files=files or {},
            **{**self.request_defaults, **overrides},
        )
        return self._execute(request, self._state)

    def _execute(self, request: ExecRequest, state_before: bytes) -> ExecResult:
        result = self.executor.run(request, workspace_tar=state_before, capture_workspace=True)
        if result.workspace_tar is not None:
            self._state = result.workspace_tar
        else:
            self._state = state_before
            log.info("step %s kept no workspace changes: %s", request.command[:1], result.reason)
        self.history.append(Step(request, state_before, result))
        return result

    def snapshot(self) -> str:
        """Remember the current contents; returns the id to roll back to."""
        sid = snapshot_id(self._state)
        self._snapshots[sid] = self._state
        WORKSPACE_OPERATIONS.labels("snapshot").inc()
        return sid

    def rollback(self, sid: str) -> None:
        """Make the workspace exactly what it was at snapshot ``sid``."""
        try:
            self._state = self._snapshots[sid]
        except KeyError:
            raise KeyError(
                f"unknown snapshot {sid!r}; this workspace has {sorted(self._snapshots)}"
            ) from None
        WORKSPACE_OPERATIONS.labels("rollback").inc()

    def replay(self, step: int = -1, **overrides: Any) -> ExecResult:
        """Run step ``step`` of the history again from the state it started from
        (e.g. a failed step with a longer timeout: ``replay(-1, timeout_s=60)``).
        The workspace is reset to that state first; later history stays for the record."""
        try:
            original = self.history[step]
        except IndexError:
            raise IndexError(
                f"no step {step}; the history has {len(self.history)} step(s)"
            ) from None
        WORKSPACE_OPERATIONS.labels("replay").inc()
        return self._execute(replace(original.request, **overrides), original.state_before)

    def restore(self, state: bytes) -> str:
        """Make the workspace the exported ``state`` (e.g. another workspace's set-up state,
        so episodes branch from it without redoing the set-up); returns its snapshot id."""
        with tarfile.open(fileobj=io.BytesIO(state)):  # refuse bytes that are not a tar
            pass
        self._state = state
        return self.snapshot()

    def export(self, sid: str | None = None) -> bytes:
        """The tar bytes of snapshot ``sid`` (or of the current state), e.g. to store them."""
        return self._state if sid is None else self._snapshots[sid]

    def files(self) -> dict[str, bytes]:
        """Regular files in the workspace, read straight from the tar (never extracted)."""
        contents: dict[str, bytes] = {}
        with tarfile.open(fileobj=io.BytesIO(self._state)) as tar:
            for member in tar.getmembers():
                extracted = tar.extractfile(member) if member.isfile() else None
                if extracted is not None:
                    name = member.name[2:] if member.name.startswith("./") else member.name
                    contents[name] = extracted.read()
        return contents

    def read_file(self, path: str) -> bytes:
        """One file's bytes; ``FileNotFoundError`` names what exists instead."""
        files = self.files()
        wanted = safe_relative_path(path)
        if wanted not in files:
            raise FileNotFoundError(f"{path!r} is not in the workspace; it has {sorted(files)}")
        return files[wanted]
