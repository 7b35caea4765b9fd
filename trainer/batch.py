"""From a sampled batch to loss inputs: score, group advantages, filter, coefficients.

The glue between the rollout, reward, advantage and loss stages, written as one pure
function of its inputs so the loop stays short and this part is testable by itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.trainer.advantages import compute_advantages
from posttrain.trainer.audit import Trajectory, round_logprobs, verifier_record
from posttrain.trainer.loss import LossConfig, sequence_coefficients
from posttrain.trainer.policy import TrainSample
from posttrain.trainer.rewards import ScoredSample, VerifyFn, score_samples
from posttrain.trainer.rollouts import RolloutBatch


@dataclass
class PreparedBatch:
    """Loss inputs plus the per-domain statistics the step reports."""

    samples: list[TrainSample]
    domain_rewards: dict[str, float]
    domain_pass_rates: dict[str, float]
    group_pass_rates: list[float]  # one per prompt, for the curriculum
    reward_mean: float
    response_length: float
    kept_groups: int
    trajectories: list[Trajectory] = field(default_factory=list)


def score_batch(
    batch: RolloutBatch,
    verifiers: dict[str, tuple[str | None, dict[str, Any]]],
    algorithm: Any,  # AlgorithmSpec
    *,
    max_concurrency: int,
    verify: VerifyFn | None = None,
) -> list[list[ScoredSample]]:
    """Score every completion of the batch; ``result[i][j]`` is sample j of prompt i."""
    flat = [(task, c) for task, group in zip(batch.request.tasks, batch.completions, strict=True)
            for c in group]
    scored = score_samples(
        [c.text for _, c in flat],
        [len(c.token_ids) for _, c in flat],
        [task for task, _ in flat],
        verifiers,
        max_new_tokens=algorithm.max_new_tokens,
        overlong_buffer=algorithm.overlong_buffer_tokens,
        overlong_penalty_value=algorithm.overlong_penalty,
        max_concurrency=max_concurrency,
        verify=verify,
    )
    sizes = [len(group) for group in batch.completions]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [scored[start : start + size] for start, size in zip(starts, sizes, strict=True)]


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
    tasks = batch.request.tasks
    rewards = [[s.reward for s in group] for group in scored]
    groups = compute_advantages(rewards, algorithm=algorithm, dynamic_sampling=dynamic_sampling)
    kept: list[tuple[int, int, float]] = []  # (prompt, sample, advantage)
    for i, group in enumerate(groups):
        if group.kept:
            kept += [(i, j, a) for j, a in enumerate(group.advantages)]
    completions = batch.completions
    lengths = [len(completions[i][j].token_ids) for i, j, _ in kept]
    coefficients = sequence_coefficients(lengths, loss_config.aggregation,
                                         loss_config.max_new_tokens)
    samples = [
        TrainSample(
            prompt_ids=batch.request.prompt_ids[i],
            completion_ids=list(completions[i][j].token_ids),
            behaviour_logprobs=list(completions[i][j].logprobs),
            advantage=advantage,
            coefficient=coefficient,
        )
        for (i, j, advantage), coefficient in zip(kept, coefficients, strict=True)
    ]
    by_domain_reward: dict[str, list[float]] = {}
    by_domain_pass: dict[str, list[float]] = {}
    trajectories = []
    for i, group in enumerate(scored):
        domain = tasks[i].domain
        prompt_ids = tuple(batch.request.prompt_ids[i])
        for j, s in enumerate(group):
            by_domain_reward.setdefault(domain, []).append(s.reward)
            by_domain_pass.setdefault(domain, []).append(float(s.passed))
            c = completions[i][j]
            trajectories.append(
                Trajectory(
                    step, domain, tasks[i].task_id, tasks[i].prompt, c.text, s.reward,
                    s.passed, c.weight_version, tuple(s.hack_signals),
                    prompt_token_ids=prompt_ids,
                    completion_token_ids=tuple(c.token_ids),
                    completion_logprobs=round_logprobs(c.logprobs),
                    advantage=groups[i].advantages[j] if groups[i].kept else None,
                    finish_reason=c.finish_reason,
                    verifier=verifier_record(s.verifier, s.verifier_reward, s.overlong_penalty,
                                             s.details),
                )
            )
    all_rewards = [r for group in rewards for r in group]
    return PreparedBatch(
        samples=samples,
        domain_rewards={d: _mean(v) for d, v in sorted(by_domain_reward.items())},
        domain_pass_rates={d: _mean(v) for d, v in sorted(by_domain_pass.items())},
        group_pass_rates=[_mean([float(s.passed) for s in group]) for group in scored],
        reward_mean=_mean(all_rewards),
        response_length=_mean([len(c.token_ids) for g in completions for c in g]),
        kept_groups=sum(g.kept for g in groups),
        trajectories=trajectories,
    )
