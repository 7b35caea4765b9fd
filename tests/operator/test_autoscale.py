"""The RolloutPool autoscaler's decision (operator/rolloutpool/autoscale.py): the HPA rule on the
trainers' rollout wait fraction, without a cluster."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from posttrain.api import RolloutPool, TrainingRun
from posttrain.api.reasons import Reason
from posttrain.api.rolloutpool import PoolAutoscaling
from posttrain.api.trainingrun import ColocatedRollout
from posttrain.operator.rolloutpool.autoscale import (
    ScaleDecision,
    WaitSignal,
    autoscaling_status,
    decide_replicas,
    rollout_wait_signal,
)

T0 = datetime(2026, 12, 6, 7, 0, tzinfo=UTC)
POLICY = PoolAutoscaling(
    min_replicas=1,
    max_replicas=10,
    target_rollout_wait_fraction=0.1,
    scale_down_stabilization_seconds=300,
)


def signal(fraction: float) -> WaitSignal:
    return WaitSignal(fraction, "run-a")


def test_scale_up_is_proportional_and_immediate() -> None:
    d = decide_replicas(POLICY, current=2, ready=2, signal=signal(0.25), now=T0)
    assert (d.replicas, d.reason) == (5, Reason.SCALED_UP)  # ceil(2 * 0.25 / 0.1)
    assert "ceil(2 * 2.50)" in d.message and "run-a" in d.message


def test_scale_up_rate_limited_and_clamped_to_max() -> None:
    # ceil(2 * 9) = 18: at most doubling or +4 per decision -> 6
    assert decide_replicas(POLICY, 2, 2, signal(0.9), T0).replicas == 6
    # ceil(8 * 9) = 72, up to 16 by rate, then clamped to max 10
    assert decide_replicas(POLICY, 8, 8, signal(0.9), T0).replicas == 10
    d = decide_replicas(POLICY, 10, 10, signal(0.9), T0)
    assert (d.replicas, d.reason) == (10, Reason.AT_LIMIT)


def test_within_tolerance_holds() -> None:
    for fraction in (0.091, 0.1, 0.109):
        d = decide_replicas(POLICY, 4, 4, signal(fraction), T0)
        assert (d.replicas, d.reason) == (4, Reason.WITHIN_TOLERANCE), fraction
    # just outside: 0.115 / 0.1 = 1.15 -> ceil(4.6) = 5
    assert decide_replicas(POLICY, 4, 4, signal(0.115), T0).replicas == 5


def test_no_signal_holds_and_clears_a_pending_scale_down() -> None:
    d = decide_replicas(POLICY, 4, 4, None, T0, pending_since=T0, pending_replicas=2)
    assert (d.replicas, d.reason) == (4, Reason.NO_SIGNAL)
    assert d.pending_since is None and d.pending_replicas is None


def test_no_scale_up_while_the_last_one_is_not_ready() -> None:
    d = decide_replicas(POLICY, 4, 2, signal(0.5), T0)
    assert (d.replicas, d.reason) == (4, Reason.SCALE_IN_PROGRESS)
    assert "2/4" in d.message


def test_scale_down_waits_for_the_window_then_takes_the_highest_recommendation() -> None:
    # 4 replicas at wait 0.05: ceil(4 * 0.5) = 2 -> pending, not yet
    first = decide_replicas(POLICY, 4, 4, signal(0.05), T0)
    assert (first.replicas, first.reason) == (4, Reason.SCALE_DOWN_PENDING)
    assert (first.pending_since, first.pending_replicas) == (T0, 2)
    # a later, higher recommendation (3) within the window raises the floor
    later = T0 + timedelta(seconds=120)
    second = decide_replicas(POLICY, 4, 4, signal(0.07), later, T0, first.pending_replicas)
    assert (second.replicas, second.pending_replicas, second.pending_since) == (4, 3, T0)
    # window passed: down to the highest recommendation seen, 3 (not 2)
    done = T0 + timedelta(seconds=300)
    third = decide_replicas(POLICY, 4, 4, signal(0.05), done, T0, second.pending_replicas)
    assert (third.replicas, third.reason) == (3, Reason.SCALED_DOWN)
    assert third.pending_since is None


def test_a_recommendation_at_or_above_current_resets_the_window() -> None:
    pending = decide_replicas(POLICY, 4, 4, signal(0.05), T0)
    back = decide_replicas(POLICY, 4, 4, signal(0.1), T0 + timedelta(seconds=200), T0, 2)
    assert back.reason == Reason.WITHIN_TOLERANCE and back.pending_since is None
    assert pending.pending_since == T0


def test_scale_down_at_most_halves_and_respects_min() -> None:
    policy = POLICY.model_copy(update={"scale_down_stabilization_seconds": 0, "min_replicas": 3})
    # wait 0: ceil(8 * 0) = 0 -> at most halving (4), and never below min
    assert decide_replicas(policy, 8, 8, signal(0.0), T0).replicas == 4
    assert decide_replicas(policy, 4, 4, signal(0.0), T0).replicas == 3
    d = decide_replicas(policy, 3, 3, signal(0.0), T0)
    assert (d.replicas, d.reason) == (3, Reason.AT_LIMIT)


def test_replicas_outside_the_bounds_are_clamped_at_once() -> None:
    assert decide_replicas(POLICY, 0, 0, None, T0) == ScaleDecision(
        1, Reason.SCALED_UP, "0 replica(s) outside [1, 10]: scaled to 1"
    )
    assert decide_replicas(POLICY, 12, 12, signal(0.5), T0).replicas == 10


def test_the_policy_validates_its_bounds() -> None:
    with pytest.raises(ValueError, match=r"minReplicas \(5\) must be <= .*maxReplicas \(2\)"):
        PoolAutoscaling(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError):
        PoolAutoscaling(min_replicas=0, max_replicas=2)  # a pool at zero sees no demand
    with pytest.raises(ValueError):
        PoolAutoscaling(max_replicas=2, target_rollout_wait_fraction=0)
    with pytest.raises(ValueError):
        PoolAutoscaling.model_validate({"minReplicas": 1})  # maxReplicas is required


def _pool(name: str = "p") -> RolloutPool:
    return RolloutPool.model_validate({
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"model": "m", "engine": "cpu", "autoscaling": {"maxReplicas": 4}},
    })  # fmt: skip


def _run(name: str, pool: str, fraction: float, start: datetime, phase: str = "Running",
         namespace: str = "ns") -> TrainingRun:  # fmt: skip
    return TrainingRun.model_validate({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": "m", "rollout": {"pool": pool},
                 "domains": [{"name": "d", "dataset": "builtin:arith",
                              "verifier": {"kind": "numeric"}}]},
        "status": {"phase": phase, "rolloutWait": {
            "fraction": fraction, "waitSeconds": 1.0, "stepSeconds": 2.0, "steps": 4,
            "windowStart": start.isoformat()}},
    })  # fmt: skip


def test_signal_is_the_highest_of_the_running_runs_on_the_pool_measured_since_the_scale() -> None:
    pool = _pool()
    since = T0
    runs = [
        _run("a", "p", 0.2, T0 + timedelta(seconds=5)),
        _run("b", "p", 0.4, T0 + timedelta(seconds=5)),
        _run("old", "p", 0.9, T0 - timedelta(seconds=5)),  # measured partly before the scale
        _run("done", "p", 0.8, T0 + timedelta(seconds=5), phase="Succeeded"),
        _run("other-pool", "q", 0.7, T0 + timedelta(seconds=5)),
        _run("other-ns", "p", 0.6, T0 + timedelta(seconds=5), namespace="ns2"),
    ]
    assert rollout_wait_signal(pool, runs, since) == WaitSignal(0.4, "b")
    assert rollout_wait_signal(pool, runs, None) == WaitSignal(0.9, "old")
    assert rollout_wait_signal(pool, runs[3:], since) is None
    # within the scale's second (status times are whole seconds): may predate it
    same_second = [_run("a", "p", 0.2, T0 + timedelta(milliseconds=500))]
    assert rollout_wait_signal(pool, same_second, since) is None


def test_status_clears_what_is_not_pending() -> None:
    wire = autoscaling_status(ScaleDecision(3, Reason.SCALED_UP, "m"), signal(0.3), T0)
    assert wire["lastScaleTime"] == "2026-12-06T07:00:00Z"
    assert wire["scaleDownPendingSince"] is None  # a merge patch with null removes it
    assert wire["desiredReplicas"] == 3 and wire["signalRun"] == "run-a"


def test_status_reads_back_equal_so_an_unchanged_decision_patches_nothing() -> None:
    """pool_autoscaler compares the wire form with the stored status: a decision that did
    not change must compare equal after the apiserver round trip (no patch per resync)."""
    from posttrain.api.rolloutpool import AutoscalingStatus

    decision = decide_replicas(POLICY, 4, 4, signal(0.05), T0)
    wire = autoscaling_status(decision, signal(0.05), T0)
    stored = AutoscalingStatus.model_validate({k: v for k, v in wire.items() if v is not None})
    assert stored.to_wire() == {k: v for k, v in wire.items() if v is not None}


def test_a_run_with_colocated_replicas_does_not_drive_its_template_pools_scale() -> None:
    """rollout.colocated samples from servers in the trainer pod: its wait says nothing
    about the pool's own replicas (the pool is only their template), so it is no signal."""
    pool = _pool()
    colocated = _run("colocated", "p", 0.9, T0 + timedelta(seconds=5))
    colocated.spec.rollout.colocated = ColocatedRollout(replicas=2)
    plain = _run("plain", "p", 0.3, T0 + timedelta(seconds=5))
    assert rollout_wait_signal(pool, [colocated, plain], T0) == WaitSignal(0.3, "plain")
    assert rollout_wait_signal(pool, [colocated], T0) is None
