"""Episodes in the training loop: sampling groups, their rewards, and their evaluation.

The trainer's stages exchange completions; an :class:`EpisodeCompletion` is a completion
whose tokens are a whole episode (model turns and the environment's turns between them)
with the loss mask saying which tokens are the policy's, its own prompt ids (the
environment writes the first message) and the environment's verdict. The reward stage
takes that verdict instead of running a verifier, the advantage stage groups episodes of
the same task like any other group, and the loss sees the mask.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from posttrain.api.env import SANDBOX_RUNNER_URL, TrainerEnv
from posttrain.envs.episode import ChatTokens, Episode, agent_metrics, run_episodes
from posttrain.envs.task import Task
from posttrain.errors import UsageError
from posttrain.rollout.protocol import Completion

log = logging.getLogger(__name__)


@dataclass
class EpisodeCompletion(Completion):
    """An episode in the shape of a completion (``token_ids`` = everything after the prompt)."""

    prompt_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    environment: str = ""
    status: str = "done"  # done | truncated | errored
    reward: float = 0.0
    passed: bool = False
    error: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_episode(cls, episode: Episode, prompt_index: int) -> EpisodeCompletion:
        return cls(
            prompt_index=prompt_index,
            text=episode.transcript(),
            token_ids=episode.completion_ids,
            logprobs=episode.logprobs,
            finish_reason=episode.status,
            weight_version=episode.weight_version,
            prompt_ids=episode.prompt_ids,
            loss_mask=episode.loss_mask,
            environment=episode.environment,
            status=episode.status,
            reward=episode.reward,
            passed=episode.passed,
            error=episode.error,
            details=episode.details,
            stats=episode.stats(),
            turns=[
                {
                    "text": t.text,
                    "observation": t.observation,
                    "tokens": len(t.token_ids),
                    "observation_tokens": len(t.observation_ids),
                    "weight_version": t.weight_version,
                    "finish_reason": t.finish_reason,
                    "info": {k: v for k, v in t.info.items() if k != "details"},
                }
                for t in episode.turns
            ],
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": "episode"}

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)


def completion_from_json(data: dict[str, Any]) -> Completion:
    """Inverse of :meth:`EpisodeCompletion.to_json` and of a plain completion's record."""
    if data.get("kind") == "episode":
        return EpisodeCompletion(**{k: v for k, v in data.items() if k != "kind"})
    return Completion(**data)


def terminal_executor(policy: Any = None, contract: TrainerEnv | None = None) -> Any:
    """Where terminal environments run their commands, by ``spec.sandbox.mode``: ``local``
    (or no policy) the trainer's bubblewrap executor and its warm pool; ``runner`` the
    sandbox runner's HTTP service (``sandbox.runnerUrl``, else the operator's
    ``$POSTTRAIN_SANDBOX_RUNNER_URL``), which carries the workspace tar in and out of each
    command, so snapshots and rollback stay with the trainer exactly as locally; ``task`` is
    refused with the reason (one SandboxTask pod per shell command is not supported).
    ``contract``: what the operator handed the pod (default: parsed from the environment)."""
    contract = TrainerEnv.from_env() if contract is None else contract
    mode = getattr(policy, "mode", "local")
    if mode == "local":
        from posttrain.sandboxes.executor import default_executor

        return default_executor()
    if mode == "runner":
        url = policy.runner_url or contract.sandbox_runner_url or ""
        if not url:
            raise UsageError(
                "terminal environments with sandbox.mode runner need a runner: set "
                f"sandbox.runnerUrl, or run through the operator (it sets ${SANDBOX_RUNNER_URL})"
            )
        from posttrain.sandboxes.client import SandboxClient

        return SandboxClient(url)
    raise UsageError(
        f"terminal environments cannot use sandbox.mode {mode!r}: an episode runs one "
        "sandbox per shell command, which a SandboxTask pod each would make minutes long; "
        "use sandbox.mode runner (or local)"
    )


def make_environment(
    spec: Any, setup_cache: Any = None, executor: Any = None, sandbox: Any = None
) -> Any:
    """A fresh environment for one episode from a domain's ``EnvironmentSpec``.
    ``executor`` runs terminal commands (default: the local bubblewrap executor);
    ``sandbox`` (``spec.sandbox``) caps their wall clock and memory."""
    if spec.kind == "function_calling":
        from posttrain.envs.function_calling import FunctionCallingEnv

        return FunctionCallingEnv(max_turns=spec.max_turns, format_reward=spec.format_reward)
    if spec.kind == "terminal":
        from posttrain.envs.terminal import TerminalEnv

        timeout_s, memory_mb, setup_s = float(spec.command_timeout_seconds), 512, 60.0
        if sandbox is not None:  # the run's ceilings apply to every command, as to verifiers
            timeout_s = min(timeout_s, float(sandbox.timeout_seconds))
            memory_mb = min(memory_mb, int(sandbox.memory_mb))
            # and to the setup: a runner refuses what is over them (docs/sandboxes.md)
            setup_s = min(setup_s, float(sandbox.timeout_seconds))
        return TerminalEnv(
            executor,
            max_turns=spec.max_turns,
            command_timeout_s=timeout_s,
            memory_mb=memory_mb,
            setup_cache=setup_cache,
            setup_timeout_s=setup_s,
        )
    if spec.kind == "bfcl_multi_turn":
        from posttrain.envs.bfcl_multi_turn import BfclMultiTurnEnv

        return BfclMultiTurnEnv(max_turns=spec.max_turns)
    raise ValueError(
        f"unknown environment kind {spec.kind!r}; use function_calling, terminal or bfcl_multi_turn"
    )


class EpisodeSampler:
    """Samples a rollout request: single-turn domains through ``client.generate``, domains
    with an environment as ``n`` episodes per task (the group)."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        environments: dict[str, Any],
        *,
        max_concurrency: int = 8,
        sandbox: Any = None,
        contract: TrainerEnv | None = None,
    ) -> None:
        """``sandbox``: the run's ``spec.sandbox``; its mode decides where terminal
        commands run (:func:`terminal_executor`), checked here so a run that cannot work
        fails before its first step."""
        from posttrain.envs.terminal import SetupCache

        self.client = client
        self.chat = ChatTokens(tokenizer)
        self.environments = environments  # domain -> EnvironmentSpec
        self.max_concurrency = max_concurrency
        self.setup_cache = SetupCache()
        self.sandbox = sandbox
        uses_terminal = any(e.kind == "terminal" for e in environments.values())
        self.executor = terminal_executor(sandbox, contract) if uses_terminal else None

    def handles(self, task: Task) -> bool:
        return task.domain in self.environments

    def episodes(
        self, tasks: list[Task], params: Any, group_size: int, label: str = "rollout episodes"
    ) -> list[list[Episode]]:
        """``group_size`` episodes per task (tasks may mix environment domains)."""
        out: list[list[Episode]] = [[] for _ in tasks]
        by_domain: dict[str, list[int]] = {}
        for i, task in enumerate(tasks):
            by_domain.setdefault(task.domain, []).append(i)
        for domain, indices in by_domain.items():
            spec = self.environments[domain]
            groups = run_episodes(
                self.client,
                self.chat,
                lambda _t, s=spec: make_environment(
                    s, self.setup_cache, self.executor, self.sandbox
                ),
                [tasks[i] for i in indices],
                replace(params, n=1),
                group_size=group_size,
                max_context_tokens=spec.max_context_tokens,
                max_concurrency=self.max_concurrency,
                label=f"{label} ({domain})",
            )
            for i, group in zip(indices, groups, strict=True):
                out[i] = group
        return out

    def __call__(self, request: Any, params: Any) -> list[list[Completion]]:
        """The producer's sampling stage: ``result[i]`` is the group of ``request.tasks[i]``."""
        env_index = [i for i, t in enumerate(request.tasks) if self.handles(t)]
        plain_index = [i for i, t in enumerate(request.tasks) if not self.handles(t)]
        result: list[list[Completion]] = [[] for _ in request.tasks]
        if plain_index:
            sampled = self.client.generate([request.prompt_ids[i] for i in plain_index], params)
            for i, group in zip(plain_index, sampled, strict=True):
                result[i] = group
        if env_index:
            groups = self.episodes([request.tasks[i] for i in env_index], params, params.n)
            for i, group in zip(env_index, groups, strict=True):
                result[i] = [EpisodeCompletion.from_episode(e, i) for e in group]
        return result

    def evaluate(
        self, tasks: list[Task], params: Any
    ) -> tuple[list[Episode], dict[str, dict[str, float]]]:
        """One episode per task (greedy by default) and the agent metrics per domain."""
        episodes = [group[0] for group in self.episodes(tasks, params, 1, "eval episodes")]
        by_domain: dict[str, list[Episode]] = {}
        for episode in episodes:
            by_domain.setdefault(episode.task.domain, []).append(episode)
        return episodes, {d: agent_metrics(e) for d, e in sorted(by_domain.items())}
