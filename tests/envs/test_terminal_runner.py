"""The terminal environment through the cluster's sandbox path: a real runner process.

``posttrain sandbox serve`` runs as its own process (as the operator's per-run runner pod
does); episodes reach it only through :class:`SandboxClient`, the way ``sandbox.mode:
runner`` wires them (``EpisodeSampler`` -> ``terminal_executor``). The workspace travels as
a tar in and out of each command, so snapshots and rollback stay with the trainer.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.api.env import TrainerEnv
from posttrain.envs.episode import ChatTokens, agent_metrics, run_episode
from posttrain.envs.training import EpisodeSampler, terminal_executor
from posttrain.errors import UsageError
from posttrain.processes import ManagedProcess, free_port, http_ok
from posttrain.rollout.protocol import SamplingParams
from posttrain.sandboxes.client import SandboxClient
from posttrain.sandboxes.executor import ExecRequest, files_to_tar

from .conftest import ScriptedPolicy
from .test_terminal import TASK, call

TERMINAL = SimpleNamespace(
    kind="terminal", max_turns=8, command_timeout_seconds=60.0, max_context_tokens=4096
)


@pytest.fixture(scope="module")
def runner_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = ManagedProcess(
        "sandbox runner",
        [
            *(sys.executable, "-m", "posttrain", "sandbox", "serve"),
            *("--host", "127.0.0.1", "--port", str(port), "--concurrency", "2"),
        ],
        Path(tmp_path_factory.mktemp("runner")) / "runner.log",
        ready=lambda: http_ok(f"{url}/health"),
    )
    process.start(timeout_s=300.0)  # generous: a loaded machine starts Python slowly
    try:
        yield url
    finally:
        process.stop()


def runner_policy(url: str) -> Any:
    return SimpleNamespace(mode="runner", runner_url=url, timeout_seconds=120.0, memory_mb=512)


def play(url: str, tokenizer: Any, replies: list[str]) -> Any:
    sampler = EpisodeSampler(
        ScriptedPolicy(tokenizer, replies),
        tokenizer,
        {"terminal": TERMINAL},
        max_concurrency=1,
        sandbox=runner_policy(url),
    )
    assert isinstance(sampler.executor, SandboxClient) and sampler.executor.url == url
    (group,) = sampler.episodes([TASK], SamplingParams(seed=1), 1)
    return group[0]


def test_a_policy_solving_the_task_in_3_turns_through_the_runner_gets_1(
    runner_url: str, tokenizer: Any
) -> None:
    episode = play(
        runner_url,
        tokenizer,
        [
            call("cat data.csv"),
            call("echo 'hello world' > hello.txt && sort -n data.csv > sorted.csv"),
            "Both files are written.",
        ],
    )
    assert episode.status == "done" and episode.passed and episode.reward == 1.0
    assert len(episode.turns) == 3
    assert "exit code: 0" in episode.turns[0].observation and "10" in episode.turns[0].observation
    assert [c["passed"] for c in episode.details["checks"]] == [True, True]


def test_a_failing_policy_through_the_runner_gets_0(runner_url: str, tokenizer: Any) -> None:
    episode = play(
        runner_url,
        tokenizer,
        [
            call("cat missing.txt"),
            call("echo hello > hello.txt && sort data.csv > sorted.csv"),
            "x",
        ],
    )
    assert episode.status == "done" and not episode.passed and episode.reward == 0.0
    assert episode.turns[0].info["command_failed"] and "exit code: 1" in (
        episode.turns[0].observation or ""
    )
    # It ran a working command after the failure (recovered), yet did the job wrong.
    metrics = agent_metrics([episode])
    assert metrics["recovery_rate"] == 1.0 and metrics["success_rate"] == 0.0


def test_workspace_state_snapshot_and_rollback_through_the_runner(runner_url: str) -> None:
    from posttrain.sandboxes.snapshot import Workspace

    with SandboxClient(runner_url) as client:
        workspace = Workspace(client, timeout_s=60.0)
        workspace.run(["sh", "-c", "echo v1 > state.txt"], files={"notes.md": "keep\n"})
        checkpoint = workspace.snapshot()
        workspace.run(["sh", "-c", "echo v2 > state.txt; rm notes.md"])
        assert workspace.read_file("state.txt") == b"v2\n" and "notes.md" not in workspace.files()
        workspace.rollback(checkpoint)
        seen = workspace.run(["sh", "-c", "cat state.txt notes.md"])
        assert seen.stdout == "v1\nkeep\n"
        # A command that times out leaves the state as it was (no tar comes back).
        slow = workspace.run(["sh", "-c", "echo v3 > state.txt; sleep 30"], timeout_s=1.0)
        assert slow.status == "timeout" and workspace.read_file("state.txt") == b"v1\n"
        # Without the workspace fields the runner answers as before (no tar).
        plain = client.run(ExecRequest(command=["true"]))
        assert plain.status == "ok" and plain.workspace_tar is None
        seeded = client.run(
            ExecRequest(command=["cat", "a"]), workspace_tar=files_to_tar({"a": "x"})
        )
        assert seeded.stdout == "x" and seeded.workspace_tar is None


def test_bad_workspace_fields_are_a_clear_422(runner_url: str) -> None:
    import http.client
    import json

    host, port = runner_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request(
        "POST",
        "/v1/exec",
        json.dumps({"command": ["true"], "workspace_tar": "not base64!"}),
        {"Content-Type": "application/json"},
    )
    response = connection.getresponse()
    assert response.status == 422
    assert "workspace_tar is not a base64-encoded tar" in json.loads(response.read())["error"]
    connection.close()


def test_sandbox_modes_for_terminal_environments() -> None:
    with pytest.raises(UsageError, match="need a runner"):
        terminal_executor(SimpleNamespace(mode="runner", runner_url=None), TrainerEnv())
    with pytest.raises(UsageError, match=r"cannot use sandbox\.mode 'task'"):
        terminal_executor(SimpleNamespace(mode="task"), TrainerEnv())
    from_env = terminal_executor(
        SimpleNamespace(mode="runner", runner_url=None),
        TrainerEnv.from_env({"POSTTRAIN_SANDBOX_RUNNER_URL": "http://127.0.0.1:9"}),
    )
    assert isinstance(from_env, SandboxClient) and from_env.url == "http://127.0.0.1:9"


def test_an_unreachable_runner_marks_the_episode_errored(tokenizer: Any) -> None:
    """The sandbox (not the policy) failed: retried, then errored, never scored as wrong."""
    from posttrain.envs.terminal import TerminalEnv

    client = SandboxClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01)
    episode = run_episode(
        ScriptedPolicy(tokenizer, [call("ls")]),
        ChatTokens(tokenizer),
        TerminalEnv(client, command_timeout_s=5.0),
        TASK,
        SamplingParams(),
    )
    assert episode.status == "errored" and "sandbox" in episode.error and episode.reward == 0.0
