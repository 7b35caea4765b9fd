"""Multi-turn agent episodes: the model may call a tool, we run it, it sees the output.

Protocol (kept deliberately simple so small models can learn it): the assistant emits a
fenced block holding one JSON object ``{"name": "shell", "arguments": {"cmd": "ls"}}``.
The episode runner parses the first such block, calls ``tool(name, arguments)`` (in the
cluster, a :mod:`posttrain.sandboxes` executor; in tests any callable), and appends the
result as the next user turn. The episode ends when a reply carries no tool call, or after
``max_turns`` assistant turns. Every assistant turn keeps its token ids, logprobs and
weight version, which is what the trainer needs to score and reinforce the trajectory.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.rollout.protocol import Completion, SamplingParams
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

ToolFn = Callable[[str, dict[str, Any]], str]

FENCED_BLOCK = re.compile(r"```[a-zA-Z_]*\s*\n?(.*?)```", re.DOTALL)
MAX_OBSERVATION_CHARS = 4000


class ChatClient(Protocol):
    def chat(
        self, messages: list[dict[str, str]], params: SamplingParams | None = None
    ) -> list[Completion]: ...


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class AgentTurn:
    """One assistant reply and, when it called a tool, the observation fed back."""

    completion: Completion
    tool_call: ToolCall | None = None
    observation: str | None = None


@dataclass
class AgentEpisode:
    messages: list[dict[str, str]]
    turns: list[AgentTurn] = field(default_factory=list)
    finish_reason: str = "answer"  # "answer" | "max_turns"

    @property
    def final_answer(self) -> str:
        return self.turns[-1].completion.text if self.turns else ""


def parse_tool_call(text: str) -> ToolCall | None:
    """The first fenced JSON block shaped like a tool call, else None.

    >>> parse_tool_call('run:\\n```json\\n{"name": "shell", "arguments": {"cmd": "ls"}}\\n```')
    ToolCall(name='shell', arguments={'cmd': 'ls'})
    >>> parse_tool_call("no call here") is None
    True
    """
    for block in FENCED_BLOCK.findall(text):
        try:
            payload = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        if (
            isinstance(payload, dict)
            and isinstance(payload.get("name"), str)
            and isinstance(payload.get("arguments", {}), dict)
        ):
            return ToolCall(payload["name"], payload.get("arguments", {}))
    return None


def format_observation(name: str, output: str) -> str:
    """The user turn carrying a tool's output back (truncated: prompts have a budget).

    >>> format_observation("shell", "ok")
    'Tool `shell` output:\\n```\\nok\\n```'
    """
    if len(output) > MAX_OBSERVATION_CHARS:
        output = output[:MAX_OBSERVATION_CHARS] + f"\n... [{len(output)} chars, truncated]"
    return f"Tool `{name}` output:\n```\n{output}\n```"


def run_agent_episode(
    client: ChatClient,
    messages: list[dict[str, str]],
    tool: ToolFn,
    *,
    params: SamplingParams | None = None,
    max_turns: int = 4,
) -> AgentEpisode:
    """Alternate model replies and tool calls until an answer or ``max_turns``.

    ``params.n`` must be 1 (an episode is one trajectory; run several episodes for a group).
    Tool exceptions become the observation text so one bad command does not end the episode.
    """
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"an agent episode samples one trajectory; got n={params.n}")
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    episode = AgentEpisode(messages=[dict(m) for m in messages])
    with tracer.start_as_current_span("rollout.agent_episode") as span:
        for _ in range(max_turns):
            (completion,) = client.chat(episode.messages, params)
            episode.messages.append({"role": "assistant", "content": completion.text})
            call = parse_tool_call(completion.text)
            turn = AgentTurn(completion, call)
            episode.turns.append(turn)
            if call is None:
                episode.finish_reason = "answer"
                break
            try:
                turn.observation = tool(call.name, call.arguments)
            except Exception as exc:  # the model should see its mistake and recover
                log.info("tool %s raised %s", call.name, exc)
                turn.observation = f"error: {type(exc).__name__}: {exc}"
            episode.messages.append(
                {"role": "user", "content": format_observation(call.name, turn.observation)}
            )
        else:
            episode.finish_reason = "max_turns"
        span.set_attribute("agent.turns", len(episode.turns))
        span.set_attribute("agent.finish_reason", episode.finish_reason)
    return episode
