"""BFCL multi-turn as a stateful environment, cross-checked with BFCL's own checker.

Scripted policies play every item of ``BFCL_v4_multi_turn_base``: one that replays the
ground-truth calls (keyword form, as BFCL's decoder reads calls) must get reward 1, one that
drops the last call of each turn or does nothing must not; on every item and policy the
environment's verdict must equal ``multi_turn_checker``'s, BFCL's own, run on the same calls.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from posttrain.envs import bfcl_multi_turn as mt
from posttrain.envs.episode import ChatTokens, agent_metrics, run_episode
from posttrain.rollout.protocol import SamplingParams
from posttrain.trainer.data.datasets import Task, builtin_tasks

from .conftest import ScriptedPolicy

DONE = "All requested operations are complete."
_names = itertools.count()


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    found = builtin_tasks("bfcl_multi_turn_base", "train", 0) + builtin_tasks(
        "bfcl_multi_turn_base", "eval", 0
    )
    assert len(found) == 200
    return sorted(found, key=lambda t: int(t.extra["bfcl_id"].rsplit("_", 1)[1]))


def ground_truth_calls(task: Task) -> list[list[str]]:
    docs = mt.function_docs(task.extra["involved_classes"])
    return [[mt.keyword_call(c, docs) for c in turn] for turn in task.extra["ground_truth"]]


def replies_for(turn_calls: list[list[str]]) -> list[str]:
    """Per user turn: one reply with the turn's calls (if any), then prose ending the turn."""
    replies = []
    for calls in turn_calls:
        if calls:
            replies.append("[" + ", ".join(calls) + "]")
        replies.append(DONE)
    return replies


def play_directly(task: Task, replies: list[str]) -> Any:
    env = mt.BfclMultiTurnEnv()
    env.reset(task)
    for reply in replies:
        result = env.step(reply)
        if result.done:
            return result
    return env.score()


def bfcl_verdict(task: Task, turn_calls: list[list[str]]) -> bool:
    """BFCL's ``multi_turn_checker`` on the same calls (one step per turn, as played)."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    model_name = f"posttrain_test_{next(_names)}"
    entry = {
        "id": task.extra["bfcl_id"],
        "initial_config": task.extra["initial_config"],
        "involved_classes": task.extra["involved_classes"],
    }
    decoded = [[calls] if calls else [] for calls in turn_calls]
    try:
        verdict = multi_turn_checker(
            decoded, task.extra["ground_truth"], entry, mt.CATEGORY, model_name
        )
    finally:  # BFCL keeps its instances in the module's globals, keyed by model name
        for key in [k for k in vars(multi_turn_utils) if k.startswith(model_name)]:
            del vars(multi_turn_utils)[key]
    return bool(verdict["valid"])


def test_ground_truth_replay_solves_every_item_and_bfcl_agrees(tasks: list[Task]) -> None:
    for task in tasks:
        calls = ground_truth_calls(task)
        result = play_directly(task, replies_for(calls))
        assert result.done and result.reward == 1.0 and result.info["passed"], (
            task.extra["bfcl_id"],
            result.info["details"]["verdicts"][-1],
        )
        assert bfcl_verdict(task, calls), task.extra["bfcl_id"]


def test_wrong_policies_fail_and_bfcl_agrees_on_every_item(tasks: list[Task]) -> None:
    failed = 0
    for task in tasks:
        calls = [turn[:-1] for turn in ground_truth_calls(task)]  # last call of each turn dropped
        result = play_directly(task, replies_for(calls))
        assert result.done
        assert result.info["passed"] == bfcl_verdict(task, calls), task.extra["bfcl_id"]
        failed += not result.info["passed"]
        nothing = play_directly(task, [DONE] * len(calls))
        assert nothing.reward == 0.0 and not nothing.info["passed"]
        assert nothing.info["details"]["verdicts"][0]["error_type"] == (
            "multi_turn:empty_turn_model_response"
        )
    assert failed >= 190  # a dropped call almost always changes state or a response


def test_episode_through_the_driver(tasks: list[Task], tokenizer: Any) -> None:
    """Token-level episode: tool results come back, a failing call is an observation, the
    next user turn arrives after the model ends its turn, and the verdict is BFCL's."""
    task = next(t for t in tasks if t.extra["bfcl_id"] == "multi_turn_base_1")
    calls = ground_truth_calls(task)
    replies = replies_for(calls)
    replies.insert(0, "[cd(folder='no_such_dir')]")  # fails, the episode goes on
    policy = ScriptedPolicy(tokenizer, replies)
    episode = run_episode(
        policy,
        ChatTokens(tokenizer),
        mt.BfclMultiTurnEnv(max_turns=32),
        task,
        SamplingParams(),
        max_context_tokens=100_000,
    )
    assert episode.status == "done" and episode.passed and episode.reward == 1.0
    first = episode.turns[0]
    assert first.info["command_failed"] and "No such file or directory" in (first.observation or "")
    assert episode.turns[1].observation and "ls(a=True) -> " in episode.turns[1].observation
    # The reply ending user turn 1 is answered with user turn 2's question.
    assert episode.turns[2].observation == task.extra["questions"][1][0]["content"]
    metrics = agent_metrics([episode])
    assert metrics["success_rate"] == 1.0 and metrics["recovery_rate"] == 1.0
    assert len(episode.turns) == len(replies)


def test_step_limit_and_max_turns(tasks: list[Task], tokenizer: Any) -> None:
    task = next(t for t in tasks if t.extra["bfcl_id"] == "multi_turn_base_1")
    env = mt.BfclMultiTurnEnv(max_steps_per_turn=2)
    env.reset(task)
    assert not env.step("[pwd()]").done and not env.step("[pwd()]").done
    third = env.step("[pwd()]")  # the step past the limit ends the user turn: judged now
    assert third.done and third.reward == 0.0 and third.info["turn_ended"] == "step limit"
    truncated = run_episode(
        ScriptedPolicy(tokenizer, ["[pwd()]"] * 3),
        ChatTokens(tokenizer),
        mt.BfclMultiTurnEnv(max_turns=3),
        task,
        SamplingParams(),
        max_context_tokens=100_000,
    )
    assert truncated.status == "truncated" and not truncated.passed
    assert truncated.details["turns_passed"] == 0


def test_bad_input_is_an_observation_never_a_crash(tasks: list[Task]) -> None:
    task = next(t for t in tasks if t.extra["bfcl_id"] == "multi_turn_base_1")
    env = mt.BfclMultiTurnEnv()
    env.reset(task)
    result = env.step("[open(file='/etc/passwd', mode='w'), kill(pid=1), ls(bogus=1)]")
    assert not result.done and result.info["valid_tool_calls"] == 1
    lines = (result.observation or "").splitlines()
    assert "Error during execution: name 'open' is not defined" in lines[0]
    assert "Function call kill is not allowed." in lines[1]
    assert "Error during execution:" in lines[2] and "bogus" in lines[2]
    broken = Task("d", "p", extra={"questions": [[]]})
    with pytest.raises(mt.EnvFailure, match="no 'initial_config'"):
        mt.BfclMultiTurnEnv().reset(broken)
