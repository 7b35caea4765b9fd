"""Workspace: state carried across fresh sandboxes, snapshots, rollback and replay."""

from __future__ import annotations

import pytest

from posttrain.sandboxes.executor import Executor
from posttrain.sandboxes.snapshot import Workspace


@pytest.fixture(scope="module")
def executor() -> Executor:
    return Executor()


def test_steps_share_files_but_not_processes(executor: Executor) -> None:
    workspace = Workspace(executor, timeout_s=5.0)
    first = workspace.run(["sh", "-c", "mkdir src && echo 1 > src/a && (sleep 60 &) ; echo ok"])
    assert first.status == "ok"
    second = workspace.run(["sh", "-c", "cat src/a; pgrep sleep || echo no-sleep"])
    assert second.stdout == "1\nno-sleep\n"
    assert workspace.read_file("src/a") == b"1\n"


def test_snapshot_rollback_and_replay_of_a_failed_step(executor: Executor) -> None:
    workspace = Workspace(executor, timeout_s=5.0)
    workspace.run(["sh", "-c", "echo v1 > state.txt"], files={"notes.md": "keep\n"})
    checkpoint = workspace.snapshot()
    workspace.run(["sh", "-c", "echo v2 > state.txt; rm notes.md"])
    assert workspace.read_file("state.txt") == b"v2\n"
    assert "notes.md" not in workspace.files()

    workspace.rollback(checkpoint)
    assert workspace.read_file("state.txt") == b"v1\n"
    assert workspace.read_file("notes.md") == b"keep\n"
    assert workspace.snapshot() == checkpoint  # same contents, same id

    # A step that times out changes nothing (steps are atomic) ...
    slow = workspace.run(
        ["sh", "-c", "echo v3 > state.txt; sleep 2; echo done > flag"], timeout_s=0.5
    )
    assert slow.status == "timeout"
    assert workspace.read_file("state.txt") == b"v1\n"
    # ... and replaying it from the state it started with, with more time, succeeds.
    replayed = workspace.replay(-1, timeout_s=10.0)
    assert replayed.status == "ok"
    assert workspace.read_file("state.txt") == b"v3\n"
    assert workspace.read_file("flag") == b"done\n"
    assert len(workspace.history) == 4


def test_unknown_snapshot_and_step_are_explained(executor: Executor) -> None:
    workspace = Workspace(executor)
    with pytest.raises(KeyError, match="unknown snapshot 'nope'"):
        workspace.rollback("nope")
    with pytest.raises(IndexError, match="the history has 0 step"):
        workspace.replay()
    with pytest.raises(FileNotFoundError, match="is not in the workspace"):
        workspace.read_file("missing.txt")
