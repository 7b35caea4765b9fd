"""RolloutPool autoscaling: the pure decision (signal + state -> replicas, reason).

The signal is the fraction of step time a trainer spent waiting for rollouts
(``TrainingRun.status.rolloutWait``). The rule is Kubernetes' HPA rule on it:
``desired = ceil(replicas * observed / target)``, no change within a tolerance of the
target, scale-ups at once (at most doubling, or +4, per decision), scale-downs only after a
stabilization window in which every recommendation asked for fewer replicas (then to the
highest of them, at most halving per decision: a wait of 0 says the pool is big enough, not
by how much). The reconciler (``rolloutpool/autoscaler.py``) reads the inputs from its
caches and writes the result through the scale subresource.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from posttrain.api import RolloutPool, TrainingRun
from posttrain.api.reasons import Reason
from posttrain.api.rolloutpool import PoolAutoscaling

from ..trainingrun.builders import trainer_pools


@dataclass(frozen=True)
class WaitSignal:
    """The wait fraction one run reported, and which run."""

    fraction: float
    run: str


@dataclass(frozen=True)
class ScaleDecision:
    """What to do now, and the scale-down window's state to carry to the next decision."""

    replicas: int
    reason: str
    message: str
    pending_since: datetime | None = None
    pending_replicas: int | None = None

    def scales(self, current: int) -> bool:
        return self.replicas != current


def rollout_wait_signal(
    pool: RolloutPool, runs: Iterable[TrainingRun], since: datetime | None
) -> WaitSignal | None:
    """The highest wait fraction among the Running runs whose trainer reads ``pool`` (its
    rollout pool, or a judge's or reward model's), counting only signals whose every
    averaged step started after ``since`` (the last scale). None when there is none.

    The highest, as an HPA with several metrics takes the largest proposal: the pool is
    short for as long as one of its runs waits on it.
    """
    best: WaitSignal | None = None
    for run in runs:
        wait = run.status.rollout_wait
        if (
            wait is None
            or run.metadata.namespace != pool.metadata.namespace
            or run.status.phase != "Running"
            or pool.metadata.name not in trainer_pools(run.spec)
            # status times are whole seconds: a step that started within the scale's
            # second may have started before it, so it does not count either
            or (since is not None and wait.window_start < since + timedelta(seconds=1))
        ):
            continue
        if best is None or wait.fraction > best.fraction:
            best = WaitSignal(wait.fraction, run.metadata.name)
    return best


def bounded(policy: PoolAutoscaling, current: int, recommended: int) -> int:
    """Clamp a recommendation to [min, max] and to the per-decision rate limits.

    >>> p = PoolAutoscaling(min_replicas=1, max_replicas=20)
    >>> bounded(p, 2, 50), bounded(p, 8, 30), bounded(p, 8, 1), bounded(p, 3, 0)
    (6, 16, 4, 2)
    """
    up_limit = max(2 * current, current + 4)
    down_limit = math.ceil(current / 2)
    limited = min(max(recommended, down_limit), up_limit)
    return min(max(limited, policy.min_replicas), policy.max_replicas)


def decide_replicas(
    policy: PoolAutoscaling,
    current: int,
    ready: int,
    signal: WaitSignal | None,
    now: datetime,
    pending_since: datetime | None = None,
    pending_replicas: int | None = None,
) -> ScaleDecision:
    """The replica count for the pool now (``current`` when holding), with its reason.

    >>> from datetime import UTC
    >>> p = PoolAutoscaling(min_replicas=1, max_replicas=8, target_rollout_wait_fraction=0.1)
    >>> t = datetime(2026, 1, 1, tzinfo=UTC)
    >>> d = decide_replicas(p, 2, 2, WaitSignal(0.3, "run"), t)
    >>> d.replicas, d.reason
    (6, 'ScaledUp')
    >>> decide_replicas(p, 2, 2, None, t).reason
    'NoSignal'
    """
    if current < policy.min_replicas or current > policy.max_replicas:
        target = min(max(current, policy.min_replicas), policy.max_replicas)
        reason = Reason.SCALED_UP if target > current else Reason.SCALED_DOWN
        return ScaleDecision(
            target, reason, f"{current} replica(s) outside [{policy.min_replicas}, "
            f"{policy.max_replicas}]: scaled to {target}"
        )  # fmt: skip
    if signal is None:
        return ScaleDecision(
            current, Reason.NO_SIGNAL,
            "no Running TrainingRun that samples from this pool reported a rollout wait "
            "measured since the last scale: holding",
        )  # fmt: skip
    wanted = policy.target_rollout_wait_fraction
    ratio = signal.fraction / wanted
    formula = (
        f"run {signal.run} waited {signal.fraction:.3f} of its step time "
        f"(target {wanted:g}): ceil({current} * {ratio:.2f})"
    )
    if abs(ratio - 1.0) <= policy.tolerance:
        return ScaleDecision(current, Reason.WITHIN_TOLERANCE, f"{formula}: within tolerance")
    recommended = bounded(policy, current, math.ceil(current * ratio))
    if recommended > current:
        if ready < current:
            return ScaleDecision(
                current, Reason.SCALE_IN_PROGRESS,
                f"{formula} = {recommended}, but {ready}/{current} replica(s) are ready: "
                "waiting for them before scaling up again",
            )  # fmt: skip
        return ScaleDecision(recommended, Reason.SCALED_UP, f"{formula}: {recommended}")
    if recommended == current:
        return ScaleDecision(current, Reason.AT_LIMIT, f"{formula}: held at {current} (limits)")
    return _scale_down(policy, current, recommended, formula, now, pending_since, pending_replicas)


def _scale_down(
    policy: PoolAutoscaling,
    current: int,
    recommended: int,
    formula: str,
    now: datetime,
    pending_since: datetime | None,
    pending_replicas: int | None,
) -> ScaleDecision:
    """Fewer replicas only once every recommendation for the window asked for fewer: to
    the highest of them."""
    since = pending_since or now
    highest = max(recommended, pending_replicas or 0)
    window = policy.scale_down_stabilization_seconds
    waited = (now - since).total_seconds()
    if waited >= window:
        return ScaleDecision(
            highest, Reason.SCALED_DOWN,
            f"{formula}: scaled down to {highest} (the highest recommendation "
            f"for {waited:.0f}s >= {window}s)",
        )  # fmt: skip
    return ScaleDecision(
        current, Reason.SCALE_DOWN_PENDING,
        f"{formula} = {recommended}: scaling down to {highest} once the recommendation "
        f"stays below {current} for {window}s",
        pending_since=since,
        pending_replicas=highest,
    )  # fmt: skip


def autoscaling_status(
    decision: ScaleDecision,
    signal: WaitSignal | None,
    last_scale_time: datetime | None,
) -> dict[str, object]:
    """``status.autoscaling`` on the wire (camelCase, unset fields null so that a merge
    patch clears them).

    >>> autoscaling_status(ScaleDecision(3, "ScaledUp", "m"), WaitSignal(0.4, "r"), None)[
    ...     "rolloutWaitFraction"]
    0.4
    """

    def stamp(value: datetime | None) -> str | None:
        return value.isoformat().replace("+00:00", "Z") if value is not None else None

    return {
        "rolloutWaitFraction": signal.fraction if signal is not None else None,
        "signalRun": signal.run if signal is not None else None,
        "desiredReplicas": decision.replicas,
        "reason": decision.reason,
        "message": decision.message,
        "lastScaleTime": stamp(last_scale_time),
        "scaleDownPendingSince": stamp(decision.pending_since),
        "scaleDownPendingReplicas": decision.pending_replicas,
    }
