"""The multi-turn rollout driver: episodes as token sequences, through the rollout server.

The conversation is kept as chat-templated **token ids** from the first message on; the
server samples each model turn after exactly those ids (``/v1/completions`` with a
token-id prompt, so nothing is re-tokenised between turns) and the environment's reply is
appended as the template's own tokens for a new turn. An episode is therefore one prompt
plus one long "completion" in which every token is either the policy's (sampled, with its
logprob and weight version: ``loss_mask`` 1) or the environment's (``loss_mask`` 0, logprob
0.0, never a target). That is exactly the shape the trainer's loss takes.

Every turn is kept: text, token ids, logprobs, weight version, the observation and what the
environment said about the turn (tool call valid? command failed?), so the trajectory store
and the evaluation can count turns, tool-call validity and recovery after failures.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client import Counter

from posttrain.envs.base import Environment, StepResult
from posttrain.envs.task import Task
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

EPISODES = Counter(
    "posttrain_env_episodes_total", "Finished agent episodes", ["environment", "status"]
)

_PROBE_USER, _PROBE_MODEL = "posttrain-probe-user", "posttrain-probe-assistant"


class ChatTokens:
    """Chat-template arithmetic on token ids for a conversation that grows turn by turn.

    The tokens of an environment turn are what the template writes between the end of the
    model's reply and the start of the next model reply: the closing of the assistant turn
    (minus the end-of-turn token when the model sampled it itself), the new message, and
    the next assistant header. They are found by rendering a probe conversation with and
    without the new message, so any append-only template works (ChatML, Llama 3, ...).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.decode([self.eos_id])
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_MODEL},
        ]
        self._before = self._render(probe, generation_prompt=False)
        self._probe = probe
        self.turn_closer = self._before[self._before.rindex(_PROBE_MODEL) + len(_PROBE_MODEL) :]

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The first messages, ending with the assistant header (same ids as the trainer's
        ``encode_prompt`` for a single user message)."""
        return self._ids(self._render(messages, generation_prompt=True))

    def observation_ids(self, role: str, content: str, *, model_ended_turn: bool) -> list[int]:
        """Tokens that close the model's turn, add ``{role: content}`` and open the next
        model turn. ``model_ended_turn``: the reply ended with the end-of-turn token (the
        model closed its turn itself; otherwise it hit max_tokens and we close it)."""
        after = self._render(
            [*self._probe, {"role": role, "content": content}], generation_prompt=True
        )
        if not after.startswith(self._before):
            raise ValueError(
                "the chat template rewrites earlier turns when a message is "
                "appended; multi-turn token sequences need an append-only "
                "template"
            )
        text = self.turn_closer + after[len(self._before) :]
        if model_ended_turn and text.startswith(self.eos_text):
            text = text[len(self.eos_text) :]
        return self._ids(text)


@dataclass
class EpisodeTurn:
    """One model reply and the environment's answer to it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    observation: str | None = None
    observation_ids: list[int] = field(default_factory=list)  # empty when nothing followed
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """A finished episode: the prompt, every turn, and the outcome.

    ``status``: ``done`` (the environment ended it), ``truncated`` (``max_turns`` or the
    context budget ran out; scored by :meth:`Environment.score`), ``errored`` (the
    environment failed: not the policy's fault, excluded from training and accuracy).
    """

    task: Task
    environment: str
    prompt_ids: list[int]
    turns: list[EpisodeTurn] = field(default_factory=list)
    status: str = "done"
    reward: float = 0.0
    passed: bool = False
    error: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def completion_ids(self) -> list[int]:
        """Every token after the prompt: model turns with the observations between them."""
        return [t for turn in self.turns for t in turn.token_ids + turn.observation_ids]

    @property
    def logprobs(self) -> list[float]:
        """Behaviour log-probs aligned with :attr:`completion_ids` (0.0 on environment tokens)."""
        return [
            lp for turn in self.turns for lp in turn.logprobs + [0.0] * len(turn.observation_ids)
        ]

    @property
    def loss_mask(self) -> list[int]:
        """1 on the policy's tokens, 0 on the environment's, aligned with completion_ids."""
        return [
            m
            for turn in self.turns
            for m in [1] * len(turn.token_ids) + [0] * len(turn.observation_ids)
        ]

    @property
    def weight_version(self) -> int:
        """The oldest weights any turn was sampled from."""
        return min((t.weight_version for t in self.turns), default=-1)

    @property
    def model_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    def transcript(self) -> str:
        """The turns as readable text (trajectory records, reports)."""
        parts = []
        for i, turn in enumerate(self.turns, start=1):
            parts.append(f"[model turn {i}]\n{turn.text}")
            if turn.observation is not None:
                parts.append(f"[environment]\n{turn.observation}")
        return "\n".join(parts)

    def stats(self) -> dict[str, Any]:
        """Agent metrics of this episode (see :func:`agent_metrics` for the aggregates)."""
        tool_calls = sum(int(t.info.get("tool_calls", 0)) for t in self.turns)
        valid = sum(int(t.info.get("valid_tool_calls", 0)) for t in self.turns)
        # A failure the policy can recover from: a command that failed or a call that did
        # not parse.
        failed_at = [
            i
            for i, t in enumerate(self.turns)
            if t.info.get("command_failed") or t.info.get("parse_error")
        ]
        recovered = None
        if failed_at:  # did a later turn run a command that worked, or the episode pass?
            later = self.turns[failed_at[0] + 1 :]
            recovered = self.passed or any(
                t.info.get("tool_calls")
                and not t.info.get("command_failed")
                and not t.info.get("parse_error")
                for t in later
            )
        return {
            "turns": len(self.turns),
            "tool_calls": tool_calls,
            "valid_tool_calls": valid,
            "had_failure": bool(failed_at),
            "recovered": recovered,
            "status": self.status,
        }


def agent_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Success rate, mean turns, valid-tool-call rate and recovery rate of a set of episodes.

    Errored episodes are counted (``errored``) and left out of the rates: an environment
    failure says nothing about the policy.

    >>> from posttrain.envs.task import Task
    >>> t = Task("d", "p", "a")
    >>> ok = Episode(t, "e", [], [EpisodeTurn("", [1], [0.0], 0, "stop",
    ...              info={"tool_calls": 1, "valid_tool_calls": 1})], passed=True)
    >>> bad = Episode(t, "e", [], [], status="errored")
    >>> agent_metrics([ok, bad])["success_rate"], agent_metrics([ok, bad])["errored"]
    (1.0, 1.0)
    """
    scored = [e for e in episodes if e.status != "errored"]
    stats = [e.stats() for e in scored]
    calls = sum(s["tool_calls"] for s in stats)
    failures = [s for s in stats if s["had_failure"]]
    n = max(len(scored), 1)
    return {
        "episodes": float(len(episodes)),
        "errored": float(len(episodes) - len(scored)),
        "success_rate": sum(e.passed for e in scored) / n,
        "truncated_rate": sum(e.status == "truncated" for e in scored) / n,
        "mean_turns": sum(s["turns"] for s in stats) / n,
        "valid_tool_call_rate": (
            sum(s["valid_tool_calls"] for s in stats) / calls if calls else 0.0
        ),
        "recovery_rate": (
            sum(bool(s["recovered"]) for s in failures) / len(failures) if failures else 0.0
        ),
        "episodes_with_failure": float(len(failures)),
    }


def run_episode(
    client: Any,
    chat: ChatTokens,
    env: Environment,
    task: Task,
    params: Any,
    *,
    max_context_tokens: int = 4096,
) -> Episode:
    """Play one episode of ``task`` in ``env`` with the policy behind ``client``.

    ``params`` (SamplingParams) applies to every turn, with ``n = 1`` and, when seeded, a
    different seed per turn. The episode stops when the environment says done, after
    ``env.max_turns`` model turns, or when the context budget is spent (both: truncated).
    """
    with tracer.start_as_current_span("env.episode") as span:
        span.set_attribute("env.name", env.name)
        span.set_attribute("task.id", task.task_id)
        try:
            messages = env.reset(task)
        except Exception as exc:  # the environment's failure, not the policy's
            log.warning("%s reset failed on task %s: %s", env.name, task.task_id, exc)
            EPISODES.labels(env.name, "errored").inc()
            return Episode(
                task, env.name, [], status="errored", error=f"reset: {type(exc).__name__}: {exc}"
            )
        episode = Episode(task, env.name, chat.prompt_ids(messages), status="truncated")
        result = _play_turns(client, chat, env, episode, params, max_context_tokens)
        _judge(env, episode, result)
        span.set_attribute("env.status", episode.status)
        span.set_attribute("env.turns", len(episode.turns))
        span.set_attribute("env.reward", episode.reward)
    EPISODES.labels(env.name, episode.status).inc()
    return episode


def _play_turns(
    client: Any,
    chat: ChatTokens,
    env: Environment,
    episode: Episode,
    params: Any,
    max_context_tokens: int,
) -> StepResult | None:
    """Alternate policy turns and environment steps into ``episode.turns`` until the
    environment says done (status ``done``), it fails (``errored``), or turns or context run
    out (status stays ``truncated``). Returns the last step's result (None: no step ran)."""
    task = episode.task
    context = list(episode.prompt_ids)
    result: StepResult | None = None
    for turn_index in range(env.max_turns):
        if episode.turns:  # the previous observation's tokens start this turn's context
            previous = episode.turns[-1]
            ended = bool(previous.token_ids) and previous.token_ids[-1] == chat.eos_id
            previous.observation_ids = chat.observation_ids(
                env.observation_role, previous.observation or "", model_ended_turn=ended
            )
            context += previous.observation_ids
        room = max_context_tokens - len(context)
        if room <= 0 and not episode.turns:
            # The task's opening messages alone fill the budget: the policy never acts,
            # so there is nothing to judge or train on. Counted as errored (reported,
            # never scored), with the sizes, rather than scored as a failure.
            episode.status = "errored"
            episode.error = (
                f"reset: the first prompt is {len(context)} tokens, over maxContextTokens "
                f"{max_context_tokens}"
            )
            log.warning("%s task %s: %s", env.name, task.task_id, episode.error)
            break
        if room <= 0:  # context budget spent: the observation is kept as text only
            episode.turns[-1].observation_ids = []
            break
        seed = None if params.seed is None else params.seed * 1009 + turn_index
        turn_params = replace(params, n=1, max_tokens=min(params.max_tokens, room), seed=seed)
        (completion,) = client.generate([context], turn_params)[0]
        turn = EpisodeTurn(
            completion.text,
            list(completion.token_ids),
            list(completion.logprobs),
            completion.weight_version,
            completion.finish_reason,
        )
        episode.turns.append(turn)
        context += turn.token_ids
        try:
            result = env.step(completion.text)
        except Exception as exc:  # the environment's failure, not the policy's
            log.warning("%s step failed on task %s: %s", env.name, task.task_id, exc)
            episode.status, episode.error = "errored", f"step: {type(exc).__name__}: {exc}"
            break
        turn.info, turn.observation = dict(result.info), result.observation
        if result.done:
            episode.status = "done"
            break
    return result


def _judge(env: Environment, episode: Episode, result: StepResult | None) -> None:
    """Set the episode's reward and verdict from the final step, or from ``env.score()``
    when turns or context ran out; an environment failure leaves it errored, unscored."""
    if episode.status == "truncated":  # out of turns or context: judge the final state
        try:
            result = env.score()
        except Exception as exc:
            episode.status, episode.error = "errored", f"score: {type(exc).__name__}: {exc}"
    if episode.status != "errored" and result is not None:
        episode.reward = float(result.reward)
        episode.passed = bool(result.info.get("passed", result.reward >= 1.0))
        episode.details = dict(result.info.get("details", {}))


def run_episodes(
    client: Any,
    chat: ChatTokens,
    make_env: Any,
    tasks: list[Task],
    params: Any,
    *,
    group_size: int,
    max_context_tokens: int = 4096,
    max_concurrency: int = 8,
    label: str = "episodes",
) -> list[list[Episode]]:
    """``group_size`` episodes of every task, concurrently (the server batches their turns);
    ``result[i][j]`` is episode j of ``tasks[i]``. ``make_env(task)`` builds a fresh
    environment per episode (closed afterwards). Progress is logged as episodes finish."""
    from posttrain.progresslog import ItemProgress

    progress = ItemProgress(label, len(tasks) * group_size, unit="episodes")

    def one(index: int) -> Episode:
        task = tasks[index // group_size]
        env = make_env(task)
        seed = None if params.seed is None else params.seed + 7919 * index
        try:
            return run_episode(
                client,
                chat,
                env,
                task,
                replace(params, seed=seed),
                max_context_tokens=max_context_tokens,
            )
        finally:
            env.close()
            progress.advance(1)

    with ThreadPoolExecutor(
        max_workers=max(1, max_concurrency), thread_name_prefix="episode"
    ) as pool:
        flat = list(pool.map(one, range(len(tasks) * group_size)))
    progress.finish()
    return [flat[i * group_size : (i + 1) * group_size] for i in range(len(tasks))]
