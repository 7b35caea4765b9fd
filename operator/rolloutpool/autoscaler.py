"""RolloutPool autoscaling, applied: read the runs' wait signal from the cache, decide
(:func:`..autoscale.decide_replicas`, pure), write ``spec.replicas`` through the pool's
scale subresource and say why (an Event and ``status.autoscaling``).

Called at every pool reconcile, which the resync runs every ``resyncSeconds`` (15 s by
default, the HPA's own period), so a changed signal is acted on within one period.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from posttrain.api import RolloutPool, TrainingRun
from posttrain.api.reasons import Reason
from posttrain.api.rolloutpool import AutoscalingStatus

from ..shared.state import Body, OperatorState, now
from ..shared.views import EventSpec
from .autoscale import autoscaling_status, decide_replicas, rollout_wait_signal

log = logging.getLogger(__name__)


@dataclass
class AutoscaleResult:
    """The pool as the rest of the reconcile should see it (its new replicas), the
    ``status.autoscaling`` patch (None: unchanged) and the Events to post."""

    pool: RolloutPool
    status_patch: dict[str, Any] | None = None
    events: list[EventSpec] = field(default_factory=list)


def runs_in(state: OperatorState, namespace: str) -> list[TrainingRun]:
    """The cached TrainingRuns of ``namespace`` that report a rollout wait."""
    runs = []
    for run_namespace, name in state.runs.snapshot_keys():
        body = state.runs.get(run_namespace, name) if run_namespace == namespace else None
        if body is None or not (body.get("status") or {}).get("rolloutWait"):
            continue
        try:
            runs.append(TrainingRun.model_validate(body))
        except ValidationError:
            continue  # an invalid run is reported on the run itself; it has no demand here
    return runs


def autoscale_pool(
    state: OperatorState, pool: RolloutPool, body: Body, ready: int
) -> AutoscaleResult:
    """Decide the pool's size and, when it changes, write it through ``/scale``."""
    policy = pool.spec.autoscaling
    status = pool.status.autoscaling
    if policy is None:  # not (or no longer) autoscaled: clear what an earlier spec left
        return AutoscaleResult(pool, {"autoscaling": None} if status is not None else None)
    status = status or AutoscalingStatus()
    signal = rollout_wait_signal(
        pool, runs_in(state, pool.metadata.namespace), status.last_scale_time
    )
    current = pool.spec.replicas
    at = now()
    decision = decide_replicas(
        policy, current, ready, signal, at,
        status.scale_down_pending_since, status.scale_down_pending_replicas,
    )  # fmt: skip
    result = AutoscaleResult(pool)
    last_scale = status.last_scale_time
    if decision.scales(current):
        path = state.kube.path_of(body, with_name=True)
        state.kube.patch(path, {"spec": {"replicas": decision.replicas}}, subresource="scale")
        last_scale = at
        result.events.append(EventSpec(
            "Normal", decision.reason,
            f"{current} -> {decision.replicas} replica(s): {decision.message}",
        ))  # fmt: skip
        spec = pool.spec.model_copy(update={"replicas": decision.replicas})
        result.pool = pool.model_copy(update={"spec": spec})
    elif decision.reason == Reason.SCALE_DOWN_PENDING and status.scale_down_pending_since is None:
        result.events.append(EventSpec("Normal", decision.reason, decision.message))
    wire = autoscaling_status(decision, signal, last_scale)
    if {k: v for k, v in wire.items() if v is not None} != status.to_wire():
        result.status_patch = {"autoscaling": wire}
    return result
