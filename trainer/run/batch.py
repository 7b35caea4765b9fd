"""From a sampled batch to loss inputs: score, group advantages, filter, coefficients.

The glue between the rollout, reward, advantage and loss stages, written as one pure
function of its inputs so the loop stays short and this part is testable by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from posttrain.trainer.algorithms.advantages import compute_advantages
from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.algorithms.loss import LossConfig, sequence_coefficients
from posttrain.trainer.data.rollouts import RolloutBatch
from posttrain.trainer.observe.audit import Trajectory, round_logprobs, verifier_record
from posttrain.trainer.rewards.scoring import ScoredSample, VerifyFn, score_samples

if TYPE_CHECKING:
    from posttrain.api import AlgorithmSpec


@dataclass
class PreparedBatch:
    """Loss inputs plus the per-domain statistics the step reports."""

    samples: list[TrainSample]
    domain_rewards: dict[str, float]
    domain_pass_rates: dict[str, float]
    group_pass_rates: list[float | None]  # one per prompt, for the curriculum; None: errored
    reward_mean: float
    response_length: float
    kept_groups: int
    trajectories: list[Trajectory] = field(default_factory=list)
    masked_samples: int = 0  # a judge / reward model could not score them: not trained on


def score_batch(
    batch: RolloutBatch,
    verifiers: dict[str, tuple[str | None, dict[str, Any]]],
    algorithm: AlgorithmSpec,
    *,
    max_concurrency: int,
    verify: VerifyFn | None = None,
) -> list[list[ScoredSample]]:
    """Score every completion of the batch; ``result[i][j]`` is sample j of prompt i."""
    flat = [
        (task, c)
        for task, group in zip(batch.request.tasks, batch.completions, strict=True)
        for c in group
    ]
    # Episodes (multi-turn, see posttrain.envs.training) come judged by their environment.
    plain = [k for k, (_, c) in enumerate(flat) if not is_episode(c)]
    judged = score_samples(
        [flat[k][1].text for k in plain],
        [len(flat[k][1].token_ids) for k in plain],
        [flat[k][0] for k in plain],
        verifiers,
        max_new_tokens=algorithm.max_new_tokens,
        overlong_buffer=algorithm.overlong_buffer_tokens,
        overlong_penalty_value=algorithm.overlong_penalty,
        max_concurrency=max_concurrency,
        verify=verify,
    )
    judged_at = dict(zip(plain, judged, strict=True))
    scored = [judged_at[k] if k in judged_at else episode_score(c) for k, (_, c) in enumerate(flat)]
    sizes = [len(group) for group in batch.completions]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [scored[start : start + size] for start, size in zip(starts, sizes, strict=True)]


def is_episode(completion: Any) -> bool:
    """A multi-turn episode (``EpisodeCompletion``) rather than one sampled completion."""
    return hasattr(completion, "loss_mask") and hasattr(completion, "environment")


def episode_score(episode: Any) -> ScoredSample:
    """An episode's reward is its environment's task-completion verdict."""
    return ScoredSample(
        reward=episode.reward,
        verifier_reward=episode.reward,
        overlong_penalty=0.0,
        passed=episode.passed,
        verifier=f"env:{episode.environment}",
        details={
            "status": episode.status,
            "error": episode.error,
            "stats": episode.stats,
            "judge": episode.details,
            "turns": episode.turns,
        },
    )


def is_errored(completion: Any) -> bool:
    """An episode the environment failed on: counted, never scored or trained on."""
    return is_episode(completion) and completion.status == "errored"


def _model_tokens(completion: Any) -> int:
    mask = getattr(completion, "loss_mask", None)
    return int(sum(mask)) if mask is not None else len(completion.token_ids)


def _prompt_ids(batch: RolloutBatch, i: int, completion: Any) -> list[int]:
    """An episode starts from the environment's first message, not the request's prompt."""
    own = getattr(completion, "prompt_ids", None)
    return list(own) if own else batch.request.prompt_ids[i]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def prepare_batch(
    batch: RolloutBatch,
    scored: Sequence[Sequence[ScoredSample]],  # scored[i][j]: sample j of prompt i
    *,
    algorithm: str,
    dynamic_sampling: bool,
    loss_config: LossConfig,
    step: int,
) -> PreparedBatch:
    """Advantages per group, drop no-signal groups, attach normalisation coefficients."""
    completions = batch.completions
    # Errored episodes (the environment failed, not the policy) and samples a judge or reward
    # model could not score take no part in a group: masked, never scored 0.
    usable = [
        [j for j, c in enumerate(group) if not is_errored(c) and not scored[i][j].errored]
        for i, group in enumerate(completions)
    ]
    rewards = [[scored[i][j].reward for j in members] for i, members in enumerate(usable)]
    kept = _kept_with_advantages(batch, usable, rewards, algorithm, dynamic_sampling)
    advantage_of = {(i, j): a for i, j, a in kept}
    trajectories, by_domain_reward, by_domain_pass = _trajectories(
        batch, scored, step, advantage_of
    )
    all_rewards = [r for group in rewards for r in group]
    return PreparedBatch(
        samples=_train_samples(batch, kept, loss_config),
        domain_rewards={d: _mean(v) for d, v in sorted(by_domain_reward.items())},
        domain_pass_rates={d: _mean(v) for d, v in sorted(by_domain_pass.items())},
        group_pass_rates=[
            _mean([float(scored[i][j].passed) for j in members]) if members else None
            for i, members in enumerate(usable)
        ],
        reward_mean=_mean(all_rewards),
        response_length=_mean([_model_tokens(c) for g in completions for c in g]),
        kept_groups=len({i for i, _, _ in kept}),
        trajectories=trajectories,
        masked_samples=sum(s.errored for group in scored for s in group),
    )


def _kept_with_advantages(
    batch: RolloutBatch,
    usable: list[list[int]],
    rewards: list[list[float]],
    algorithm: str,
    dynamic_sampling: bool,
) -> list[tuple[int, int, float]]:
    """(prompt, sample, advantage) of every usable sample in a group that keeps its signal."""
    completions = batch.completions
    groups = compute_advantages(
        [r or [0.0] for r in rewards],
        algorithm=algorithm,
        dynamic_sampling=dynamic_sampling,
        lengths=[
            [_model_tokens(completions[i][j]) for j in m] or [0] for i, m in enumerate(usable)
        ],
    )
    kept: list[tuple[int, int, float]] = []
    for i, group in enumerate(groups):
        if group.kept and usable[i]:
            for j, a in zip(usable[i], group.advantages, strict=True):
                kept.append((i, j, a))
    return kept


def _train_samples(
    batch: RolloutBatch, kept: list[tuple[int, int, float]], loss_config: LossConfig
) -> list[TrainSample]:
    """The loss inputs of the kept samples, with the batch's normalisation coefficients."""
    completions = batch.completions
    # Only the policy's tokens count towards the normaliser (episodes carry tool output).
    lengths = [_model_tokens(completions[i][j]) for i, j, _ in kept]
    coefficients = sequence_coefficients(
        lengths, loss_config.aggregation, loss_config.max_new_tokens
    )
    return [
        TrainSample(
            prompt_ids=_prompt_ids(batch, i, completions[i][j]),
            completion_ids=list(completions[i][j].token_ids),
            behaviour_logprobs=list(completions[i][j].logprobs),
            advantage=advantage,
            coefficient=coefficient,
            loss_mask=getattr(completions[i][j], "loss_mask", None),
        )
        for (i, j, advantage), coefficient in zip(kept, coefficients, strict=True)
    ]


def _trajectories(
    batch: RolloutBatch,
    scored: Sequence[Sequence[ScoredSample]],
    step: int,
    advantage_of: dict[tuple[int, int], float],
) -> tuple[list[Trajectory], dict[str, list[float]], dict[str, list[float]]]:
    """Every sample's trajectory record, and the rewards and passes of the usable ones by
    domain."""
    tasks, completions = batch.request.tasks, batch.completions
    by_domain_reward: dict[str, list[float]] = {}
    by_domain_pass: dict[str, list[float]] = {}
    trajectories = []
    for i, group_scores in enumerate(scored):
        domain = tasks[i].domain
        for j, s in enumerate(group_scores):
            c = completions[i][j]
            prompt_ids = tuple(_prompt_ids(batch, i, c))
            if not is_errored(c) and not s.errored:
                by_domain_reward.setdefault(domain, []).append(s.reward)
                by_domain_pass.setdefault(domain, []).append(float(s.passed))
            trajectories.append(
                Trajectory(
                    step,
                    domain,
                    tasks[i].task_id,
                    tasks[i].prompt,
                    c.text,
                    s.reward,
                    s.passed,
                    c.weight_version,
                    tuple(s.hack_signals),
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=tuple(c.token_ids),
                    completion_logprobs=round_logprobs(c.logprobs),
                    advantage=advantage_of.get((i, j)),
                    finish_reason=c.finish_reason,
                    verifier=verifier_record(
                        s.verifier, s.verifier_reward, s.overlong_penalty, s.details
                    ),
                )
            )
    return trajectories, by_domain_reward, by_domain_pass
