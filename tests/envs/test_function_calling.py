"""The function-calling environment on a real BFCL item, driven by scripted replies."""

from __future__ import annotations

from typing import Any

from posttrain.envs.episode import ChatTokens, agent_metrics, run_episode
from posttrain.envs.function_calling import FunctionCallingEnv
from posttrain.rollout.protocol import SamplingParams
from posttrain.trainer.data.datasets import Task, builtin_tasks

from .conftest import ScriptedPolicy


def triangle_task() -> Task:
    tasks = builtin_tasks("bfcl_simple_python", "train", 0) + builtin_tasks(
        "bfcl_simple_python", "eval", 0
    )
    (task,) = [t for t in tasks if t.extra["bfcl_id"] == "simple_python_0"]
    return task


def play(tokenizer: Any, replies: list[str], **options: Any) -> Any:
    return run_episode(
        ScriptedPolicy(tokenizer, replies),
        ChatTokens(tokenizer),
        FunctionCallingEnv(**options),
        triangle_task(),
        SamplingParams(),
    )


def test_bfcl_chat_is_played_with_its_system_prompt(tokenizer: Any) -> None:
    messages = FunctionCallingEnv().reset(triangle_task())
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("You are an expert in composing functions.")
    assert messages[1]["content"].startswith("Find the area of a triangle")


def test_accepted_call_wrong_arguments_and_format_reward(tokenizer: Any) -> None:
    right = play(tokenizer, ["[calculate_triangle_area(base=10, height=5)]"])
    assert right.passed and right.reward == 1.0 and len(right.turns) == 1
    wrong = play(tokenizer, ["[calculate_triangle_area(base=5, height=5)]"])
    assert not wrong.passed and wrong.reward == 0.0
    assert "Invalid value for parameter 'base'" in wrong.details["error"][0]
    shaped = play(tokenizer, ["[calculate_triangle_area(base=5, height=5)]"], format_reward=0.2)
    assert not shaped.passed and shaped.reward == 0.2  # format learnt, BFCL still says no
    unknown = play(tokenizer, ["[area(base=10, height=5)]"], format_reward=0.2)
    assert unknown.reward == 0.0 and unknown.turns[0].info["valid_tool_calls"] == 0


def test_unparseable_reply_gets_the_error_and_may_recover(tokenizer: Any) -> None:
    episode = play(
        tokenizer, ["The area is 25.", "[calculate_triangle_area(base=10, height=5)]"], max_turns=2
    )
    first = episode.turns[0]
    assert first.observation.startswith(
        "Your reply could not be parsed as function calls: not python call syntax"
    )
    assert episode.passed and len(episode.turns) == 2 and episode.status == "done"
    metrics = agent_metrics([episode])
    assert metrics["valid_tool_call_rate"] == 0.5 and metrics["success_rate"] == 1.0
    assert metrics["recovery_rate"] == 1.0
    single = play(tokenizer, ["The area is 25."])
    assert single.status == "done" and not single.passed and len(single.turns) == 1
