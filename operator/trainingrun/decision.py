"""What one phase of a TrainingRun's plan decides: an immutable :class:`Decision`.

:func:`.plan.plan_training_run` asks its phases in order (health reports, suspension,
admission, deadline, the gang), each returning a Decision, and folds them once into the
RunPlan and its status patch, as KubeRay's ``calculateStatus`` computes a RayCluster's status
in one place. No phase mutates another's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from posttrain.api.base import ConditionStatus
from posttrain.api.reasons import ConditionType

from ..shared.views import EventSpec, PodView, iso_time


@dataclass(frozen=True)
class ConditionChange:
    """One ``set_condition`` to apply (the generation is the run's)."""

    type: str
    status: ConditionStatus
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    """One phase's verdict. The fold applies ``conditions`` in order, appends ``events``,
    sets the status ``fields`` (a later decision's value wins) and moves to ``incarnation``
    when set; the actions are those of the last decision, the one that ends the plan."""

    conditions: tuple[ConditionChange, ...] = ()
    events: tuple[EventSpec, ...] = ()
    fields: tuple[tuple[str, Any], ...] = ()
    """Operator-owned status fields: phase, message, restarts, startTime, rayCluster..."""
    incarnation: int | None = None
    """The gang incarnation from here on (resume, re-admission, gang restart)."""
    delete_pods: tuple[str, ...] = ()
    delete_ray_clusters: tuple[str, ...] = ()
    create_ranks: tuple[int, ...] = ()
    create_ray_cluster: bool = False
    ensure_children: bool = False
    create_workload: bool = False
    workload_active: bool | None = None


def pods_to_delete_at_the_end(pods: list[PodView] | tuple[PodView, ...]) -> list[str]:
    """The trainer pods a run that ended (Succeeded or Failed) deletes: those still running
    (other ranks, Ray workers, which would otherwise block forever). Finished pods stay, so
    ``kubectl logs`` and ``posttrain logs`` read rank 0 after the run, as Kubeflow's
    ``cleanPodPolicy: Running`` keeps them; they go with the TrainingRun (ownerReferences).
    A gang restart and ``suspend`` delete every pod of the gang instead.

    >>> from posttrain.operator.shared.views import Terminated
    >>> done = PodView("r-g0-0", {}, phase="Succeeded", terminated=Terminated(exit_code=0))
    >>> pods_to_delete_at_the_end([done, PodView("r-g0-1", {}, phase="Running")])
    ['r-g0-1']
    """
    return [p.name for p in pods if not p.finished]


def run_failed(
    reason: str,
    message: str,
    now: datetime,
    live: tuple[PodView, ...],
    clusters: tuple[str, ...],
    fields: tuple[tuple[str, Any], ...] = (),
) -> Decision:
    """The run fails: Failed=True, Ready=False, a Warning event, and every pod still running
    and every RayCluster (``clusters``) deleted; ``fields`` are kept (e.g. restarts).

    >>> d = run_failed("DeadlineExceeded", "too long", datetime(2026, 1, 1), (), ("r-g0",))
    >>> dict(d.fields)["phase"], d.delete_ray_clusters, [c.type for c in d.conditions]
    ('Failed', ('r-g0',), ['Failed', 'Ready'])
    """
    return Decision(
        conditions=(
            ConditionChange(ConditionType.FAILED, "True", reason, message),
            ConditionChange(ConditionType.READY, "False", reason, message),
        ),
        events=(EventSpec("Warning", reason, message),),
        fields=(
            *fields,
            ("phase", "Failed"),
            ("message", message),
            ("completionTime", iso_time(now)),
        ),
        delete_pods=tuple(pods_to_delete_at_the_end(live)),
        delete_ray_clusters=clusters,
    )
