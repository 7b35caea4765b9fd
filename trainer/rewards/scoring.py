"""Rewards: the domain's verifier score plus DAPO's soft overlong penalty.

Verifiers (in ``posttrain.sandboxes``) say whether an answer is right; the trainer only
adds shaping that depends on generation length. The overlong penalty ramps linearly
over the last ``buffer`` tokens before ``max_new_tokens`` instead of punishing every
truncated sample equally, which (per DAPO) reduces reward noise from truncation.
Unit-test verifiers run untrusted code, so they run concurrently but bounded by the
sandbox policy's ``max_concurrency``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from posttrain.trainer.data.datasets import DEFAULT_VERIFIER_BY_DOMAIN, Task
from posttrain.trainer.rewards.scorers import (
    MODEL_KINDS,
    ModelScorers,
    ScorerConfigError,
    ScoringUnavailable,
)
from posttrain.trainer.rewards.verification import VerificationUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoredSample:
    """A completion's reward and where it came from."""

    reward: float  # what the advantages see: verifier score + overlong penalty
    verifier_reward: float
    overlong_penalty: float
    passed: bool
    hack_signals: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    verifier: str = ""  # which verifier scored it (numeric, unit_tests, ...)
    errored: bool = False  # the judge / reward model could not score it: masked, not 0


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment (a value <= 0).

    0 up to ``max_new_tokens - buffer``; then linear down to ``-penalty`` at the limit.

    >>> [overlong_penalty(n, 10, 4, 1.0) for n in (6, 8, 10, 12)]
    [0.0, -0.5, -1.0, -1.0]
    >>> overlong_penalty(10, 10, 0, 1.0)
    0.0
    """
    if buffer <= 0:
        return 0.0
    free = max_new_tokens - buffer
    if length <= free:
        return 0.0
    return -penalty * min(1.0, (length - free) / buffer)


def verifier_kind(task: Task, domain_kind: str | None) -> str:
    """The task's own verifier, else the domain spec's, else the default for the domain."""
    kind = task.verifier or domain_kind or DEFAULT_VERIFIER_BY_DOMAIN.get(task.domain)
    if kind is None:
        raise ValueError(
            f"no verifier for domain {task.domain!r}: set spec.domains[].verifier.kind or a "
            f'"verifier" key on the task'
        )
    return kind


VerifyFn = Callable[[str, str, dict[str, Any], dict[str, Any]], Any]


def _infra_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that say the sandbox, not the completion, failed: they are never a reward."""
    try:
        from posttrain.sandboxes.protocol import SandboxError
    except ImportError:  # the sandboxes component is optional
        return (VerificationUnavailable,)
    return (VerificationUnavailable, SandboxError)


def default_verify() -> VerifyFn:
    """Verification with the local executor and the default sandbox policy (tests, evals
    outside a run); a run builds its own from spec.sandbox (trainer/rewards/verification.py)."""
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.trainer.rewards.verification import build_verification

    return build_verification(SandboxPolicy()).verify


def score_samples(
    texts: Sequence[str],
    token_counts: Sequence[int],
    tasks: Sequence[Task],
    verifier_specs: dict[str, tuple[str | None, dict[str, Any]]],
    *,
    max_new_tokens: int,
    overlong_buffer: int,
    overlong_penalty_value: float,
    max_concurrency: int = 2,
    verify: VerifyFn | None = None,
) -> list[ScoredSample]:
    """Score completions ``texts[i]`` of ``tasks[i]``; ``verifier_specs[domain] = (kind, config)``.

    A verifier that raises on the task or the completion (a malformed task, a setup script
    that fails) scores 0 with the error in ``details`` and is logged. A failure of the sandbox
    itself (:func:`_infra_errors`) is raised instead: the sample was never judged, and
    training on a made-up 0 would teach the model that a right answer was wrong. A judge or
    reward model that could not score a sample (:class:`ScoringUnavailable`, after its
    retries) gives an ``errored`` sample instead: masked out of the loss and the statistics
    (as an errored episode is), the run goes on.

    Model-scored samples (judge, reward_model) run on their own threads, as many as their
    endpoints take at once, beside the sandbox's ``max_concurrency``.
    """
    verify = verify or default_verify()
    infra_errors: tuple[type[BaseException], ...] = (*_infra_errors(), ScorerConfigError)

    def score(i: int) -> ScoredSample:
        task = tasks[i]
        domain_kind, config = verifier_specs.get(task.domain, (None, {}))
        kind = verifier_kind(task, domain_kind)
        try:
            result = verify(kind, texts[i], task.to_dict(), dict(config))
            value, passed, details = float(result.reward), bool(result.passed), result.details
        except ScoringUnavailable as exc:
            log.warning("%s could not score task %s (masked out of the loss): %s",
                        kind, task.task_id, exc)  # fmt: skip
            return ScoredSample(
                reward=0.0,
                verifier_reward=0.0,
                overlong_penalty=0.0,
                passed=False,
                details={"error": str(exc), "masked": True},
                verifier=kind,
                errored=True,
            )
        except infra_errors:
            raise
        except Exception as exc:  # scored as a failure, reported, run continues
            log.warning("verifier %s failed on task %s: %s", kind, task.task_id, exc)
            value, passed, details = 0.0, False, {"error": str(exc)}
        penalty = overlong_penalty(
            token_counts[i], max_new_tokens, overlong_buffer, overlong_penalty_value
        )
        signals = list(details.get("hack_signals", [])) if isinstance(details, dict) else []
        return ScoredSample(
            reward=value + penalty,
            verifier_reward=value,
            overlong_penalty=penalty,
            passed=passed,
            hack_signals=signals,
            details=details if isinstance(details, dict) else {},
            verifier=kind,
        )

    kinds = [verifier_kind(t, verifier_specs.get(t.domain, (None, {}))[0]) for t in tasks]
    by_model = [i for i, k in enumerate(kinds) if k in MODEL_KINDS]
    by_rule = [i for i, k in enumerate(kinds) if k not in MODEL_KINDS]
    model_threads = ModelScorers.concurrency(list(verifier_specs.values())) if by_model else 1
    with (
        ThreadPoolExecutor(max_workers=max(1, max_concurrency)) as rules,
        ThreadPoolExecutor(max_workers=model_threads) as models,
    ):
        futures = {i: models.submit(score, i) for i in by_model}
        futures.update({i: rules.submit(score, i) for i in by_rule})
        return [futures[i].result() for i in range(len(texts))]
