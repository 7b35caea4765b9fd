"""The terminal environment through the real bubblewrap sandbox, driven by scripted policies."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.envs.episode import ChatTokens, agent_metrics, run_episode
from posttrain.envs.terminal import TerminalEnv
from posttrain.rollout.protocol import SamplingParams
from posttrain.sandboxes.executor import SandboxError
from posttrain.trainer.data.datasets import Task

from .conftest import ScriptedPolicy

TASK = Task(
    domain="terminal",
    prompt="Write 'hello world' to hello.txt and data.csv sorted numerically to sorted.csv.",
    answer="",
    extra={
        "files": {"data.csv": "3\n10\n2\n"},
        "verify": [
            "grep -qx 'hello world' hello.txt",
            "printf '2\\n3\\n10\\n' | cmp -s - sorted.csv",
        ],
    },
)


def call(cmd: str) -> str:
    return f'Running it.\n```json\n{{"name": "shell", "arguments": {{"cmd": "{cmd}"}}}}\n```'


def play(tokenizer: Any, replies: list[str], **env_options: Any) -> Any:
    policy = ScriptedPolicy(tokenizer, replies)
    env = TerminalEnv(**env_options)
    episode = run_episode(policy, ChatTokens(tokenizer), env, TASK, SamplingParams(seed=1))
    return episode, policy


def test_a_policy_that_does_the_job_gets_reward_1(tokenizer: Any) -> None:
    episode, _ = play(
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
    assert agent_metrics([episode])["valid_tool_call_rate"] == 1.0


def test_a_policy_that_fails_gets_reward_0(tokenizer: Any) -> None:
    episode, _ = play(
        tokenizer, [call("echo hello > hello.txt && sort data.csv > sorted.csv"), "Done."]
    )
    assert episode.status == "done" and not episode.passed and episode.reward == 0.0
    assert [c["passed"] for c in episode.details["checks"]] == [False, False]


def test_malformed_call_unknown_tool_and_failing_command_are_observations(tokenizer: Any) -> None:
    episode, _ = play(
        tokenizer,
        [
            '```json\n{"name": "shell", "arguments": {"cmd": "ls"}\n```',  # missing brace
            '```json\n{"name": "python", "arguments": {"code": "1"}}\n```',
            call("cat missing.txt"),
            call("echo 'hello world' > hello.txt && sort -n data.csv > sorted.csv"),
            "done",
        ],
    )
    first, second, third = episode.turns[:3]
    assert first.observation.startswith("error: could not parse your tool call: invalid JSON")
    assert first.info["parse_error"].startswith("invalid JSON: Expecting ','")
    assert "unknown tool 'python'" in second.observation
    assert third.info["command_failed"] and "No such file" in third.observation
    assert episode.passed  # it recovered
    stats = episode.stats()
    assert stats["recovered"] is True and stats["valid_tool_calls"] == 2
    metrics = agent_metrics([episode])
    assert metrics["recovery_rate"] == 1.0 and metrics["valid_tool_call_rate"] == 0.5


def test_hanging_command_is_killed_and_the_episode_continues(tokenizer: Any) -> None:
    episode, _ = play(
        tokenizer, [call("sleep 600"), call("echo hi > x"), "done"], command_timeout_s=2.0
    )
    assert episode.turns[0].info["command_status"] == "timeout"
    assert "did not finish within 2 s and was killed" in episode.turns[0].observation
    assert len(episode.turns) == 3 and episode.status == "done"
    assert not episode.passed


def test_max_turns_sets_truncated_and_the_final_state_is_judged(tokenizer: Any) -> None:
    episode, _ = play(
        tokenizer,
        [
            call("echo 'hello world' > hello.txt && sort -n data.csv > sorted.csv"),
            call("ls"),
            call("ls"),
        ],
        max_turns=2,
    )
    assert episode.status == "truncated" and len(episode.turns) == 2
    assert episode.passed and episode.reward == 1.0  # the job was done before turns ran out
    assert episode.turns[-1].observation_ids == []  # nothing after the last model turn


class BrokenSandbox:
    """An executor whose sandbox cannot start (bwrap refused): the infrastructure's fault."""

    def __init__(self) -> None:
        self.calls = 0

    def run(self, request: Any, **_: Any) -> Any:
        self.calls += 1
        raise SandboxError("bwrap: creating new namespace failed")


def test_environment_failure_marks_the_episode_errored_not_wrong(tokenizer: Any) -> None:
    broken = BrokenSandbox()
    episode, _ = play(tokenizer, [call("ls")], executor=broken)
    assert episode.status == "errored" and "sandbox failed 3 times" in episode.error
    assert broken.calls == 3  # retried from the same state before giving up
    metrics = agent_metrics([episode])
    assert metrics["errored"] == 1.0 and metrics["success_rate"] == 0.0
    no_checks = Task("terminal", "do something", "", extra={})
    env_episode = run_episode(
        ScriptedPolicy(tokenizer, []),
        ChatTokens(tokenizer),
        TerminalEnv(),
        no_checks,
        SamplingParams(),
    )
    assert env_episode.status == "errored" and 'no "verify" checks' in env_episode.error


def test_episodes_of_a_task_branch_from_one_setup(tokenizer: Any) -> None:
    from posttrain.envs.terminal import SetupCache

    cache = SetupCache()
    task = Task(
        "terminal",
        "count",
        "",
        extra={"setup": "seq 5 > n.txt; date +%N > stamp", "verify": ["test -s n.txt"]},
    )
    stamps = []
    for _ in range(2):
        env = TerminalEnv(setup_cache=cache)
        env.reset(task)
        stamps.append(env.workspace.read_file("stamp"))
    assert stamps[0] == stamps[1]  # the set-up ran once; the second episode branched from it


@pytest.mark.parametrize("reply", ["All done.", "```bash\nls\n```"])
def test_a_reply_without_a_call_ends_the_episode(tokenizer: Any, reply: str) -> None:
    episode, _ = play(tokenizer, [reply])
    assert episode.status == "done" and len(episode.turns) == 1 and not episode.passed
