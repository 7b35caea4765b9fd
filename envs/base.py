"""The environment interface and the records a multi-turn episode is made of.

An environment turns a task into a conversation the policy acts in:

* ``reset(task)`` returns the first messages (chat form) and starts a fresh state;
* ``step(model_turn)`` takes the policy's whole reply and returns the next observation
  (a message the environment writes), a reward, and whether the episode is over;
* ``score()`` judges the final state when the driver stops an episode at ``max_turns``
  (an agent that ran out of turns may still have got the job done);
* ``tools`` are the JSON schemas of the tools it offers (shown in the first message).

Bad input is the policy's to recover from, never a crash: an unparseable tool call comes
back as an observation naming the parse error. An exception raised *by the environment*
(its sandbox broke, its task is malformed) is the infrastructure's fault: the driver marks
the episode ``errored``, which is counted and reported but never scored as a wrong answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.envs.task import Task


@dataclass
class StepResult:
    """What one environment step returns."""

    observation: str | None  # the next message to the policy; None when done
    reward: float = 0.0
    done: bool = False
    # tool_calls: calls the reply made; valid_tool_calls: of those, well-formed and known;
    # parse_error: why the reply's call could not be read; command_failed: a tool ran and
    # failed (non-zero exit, timeout); details: the judge's verdict at the end.
    info: dict[str, Any] = field(default_factory=dict)


class EnvFailure(RuntimeError):
    """The environment itself failed (not the policy): the episode is marked errored."""


class Environment(Protocol):
    """One episode's world; a new instance (or a ``reset``) per episode."""

    name: str
    max_turns: int
    observation_role: str  # the chat role environment messages are written as

    @property
    def tools(self) -> list[dict[str, Any]]: ...

    def reset(self, task: Task) -> list[dict[str, str]]: ...

    def step(self, model_turn: str) -> StepResult: ...

    def score(self) -> StepResult: ...

    def close(self) -> None: ...
