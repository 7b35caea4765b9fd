"""Agent episodes: tool-call parsing, the turn loop, and one episode over real HTTP."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from posttrain.rollout.agent import (
    MAX_OBSERVATION_CHARS,
    parse_tool_call,
    run_agent_episode,
)
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.protocol import Completion, SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread


class ScriptedModel:
    """Plays back fixed assistant replies (the model is not what these tests exercise)."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)
        self.seen: list[list[dict[str, str]]] = []

    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> list[Completion]:
        self.seen.append([dict(m) for m in messages])
        text = self.replies.pop(0)
        return [Completion(0, text, [1, 2], [-0.1, -0.2], "stop", 7)]


def shell(name: str, arguments: dict) -> str:
    """A real (local) shell tool, standing in for the sandbox executor."""
    assert name == "shell"
    done = subprocess.run(
        ["bash", "-c", arguments["cmd"]], capture_output=True, text=True, timeout=10
    )
    return done.stdout + done.stderr


CALL = 'Let me check.\n```json\n{"name": "shell", "arguments": {"cmd": "echo $((6 * 7))"}}\n```'


def test_parse_tool_call_variants() -> None:
    assert parse_tool_call(CALL).arguments == {"cmd": "echo $((6 * 7))"}
    assert parse_tool_call('```\n{"name": "shell", "arguments": {}}\n```').name == "shell"
    assert parse_tool_call("```python\nprint(1)\n```") is None  # code, not a call
    assert parse_tool_call('```json\n{"name": 3}\n```') is None
    assert parse_tool_call('```json\n{"oops"\n```\n```json\n{"name": "a"}\n```').name == "a"


def test_episode_runs_tool_and_feeds_observation_back() -> None:
    model = ScriptedModel([CALL, "The answer is 42."])
    episode = run_agent_episode(model, [{"role": "user", "content": "6*7?"}], shell, max_turns=4)
    assert episode.finish_reason == "answer"
    assert episode.final_answer == "The answer is 42."
    assert [t.tool_call is not None for t in episode.turns] == [True, False]
    assert episode.turns[0].observation == "42\n"
    observation_turn = model.seen[1][-1]
    assert observation_turn["role"] == "user"
    assert "42" in observation_turn["content"]
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "user", "assistant"]
    assert all(t.completion.weight_version == 7 for t in episode.turns)


def test_episode_stops_at_max_turns_and_survives_tool_errors() -> None:
    def broken(name: str, arguments: dict) -> str:
        raise TimeoutError("sandbox timed out")

    model = ScriptedModel([CALL, CALL, CALL])
    episode = run_agent_episode(model, [{"role": "user", "content": "go"}], broken, max_turns=2)
    assert episode.finish_reason == "max_turns"
    assert len(episode.turns) == 2
    assert episode.turns[0].observation == "error: TimeoutError: sandbox timed out"


def test_long_observations_are_truncated() -> None:
    model = ScriptedModel([CALL, "done"])
    episode = run_agent_episode(
        model, [{"role": "user", "content": "go"}], lambda n, a: "x" * 10_000, max_turns=3
    )
    assert len(episode.messages[2]["content"]) < MAX_OBSERVATION_CHARS + 200
    assert "truncated" in episode.messages[2]["content"]


def test_episode_rejects_group_sampling() -> None:
    with pytest.raises(ValueError, match="n=4"):
        run_agent_episode(ScriptedModel([]), [], shell, params=SamplingParams(n=4))


def test_episode_over_http_with_real_model(tiny_model_dir: Path) -> None:
    server = ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
    try:
        with RolloutClient([server.url]) as client:
            episode = run_agent_episode(
                client,
                [{"role": "user", "content": "List files."}],
                shell,
                params=SamplingParams(max_tokens=8, seed=0),
                max_turns=2,
            )
        assert episode.turns, "at least one assistant turn"
        assert all(len(t.completion.token_ids) == 8 for t in episode.turns)
        assert all(t.completion.weight_version == 0 for t in episode.turns)
    finally:
        server.stop()
