"""The TrainingRun decision: ``(run, observed pods/RayCluster/Workload, now) -> RunPlan``.

Pure (unit-tested without a cluster) and level-triggered. Status ownership: the plan only
ever sets the operator's fields (phase, conditions, observedGeneration, restarts, maxSteps,
startTime, completionTime, message, rayCluster, rayClusterState, availableWorkers); trainer
fields (step, rewardMean, domainRewards, evalAccuracy, lastCheckpoint, weightVersion) never
appear in a run's patch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from posttrain.api import TrainingRun
from posttrain.api.base import Condition, ConditionStatus, get_condition, set_condition
from posttrain.api.reasons import ConditionType, Reason
from posttrain.api.trainingrun import MANAGED_BY_POSTTRAIN

from ..shared.views import TERMINAL, EventSpec, PodView, conditions_wire, iso_time, status_diff
from . import evaluator, sandbox_runner
from .decision import ConditionChange, Decision, pods_to_delete_at_the_end, run_failed
from .gang import RayClusterView, plan_gang, pod_gang, ray_cluster_gang
from .kueue import WorkloadView, workload_name
from .raycluster import HEAD_OUTCOME_FINALIZER


@dataclass(frozen=True)
class RunPlan:
    """What to do for one TrainingRun."""

    incarnation: int
    """Gang incarnation the pods should belong to (stored in an annotation on the run)."""
    create_ranks: list[int] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    ensure_children: bool = False
    """Create-or-adopt ConfigMap, RBAC and head Service before creating pods."""
    create_ray_cluster: bool = False
    """Create the RayCluster of ``incarnation`` (KubeRay path only)."""
    delete_ray_clusters: list[str] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)
    create_workload: bool = False
    """Create the run's Kueue Workload (admission through Kueue, see kueue.py)."""
    workload_active: bool | None = None
    """Set the Workload's spec.active (False on suspend gives the quota back)."""
    finish_workload: bool = False
    """Mark the Workload Finished (the run ended), so Kueue releases its quota."""
    release: list[tuple[str, str, str]] = field(default_factory=list)
    """(apiVersion, kind, name) of children that only serve a training run, deleted when it
    ends: its own sandbox runner's Deployment, and on failure its evaluator Job."""


@dataclass(frozen=True)
class KueueGate:
    """A run admitted through Kueue: its LocalQueue and its Workload (None: not created yet)."""

    queue: str
    workload: WorkloadView | None


# Reasons for Suspended=True while Kueue holds the run back.
_KUEUE_WAITING = (Reason.WAITING_FOR_ADMISSION, Reason.EVICTED)


def managed_elsewhere(managed_by: str | None) -> str | None:
    """Why the operator must leave a run alone, given its ``spec.managedBy``; None: it is ours.

    ``managedBy`` as Kubeflow Trainer and JobSet define it: unset or
    ``posttrain.io/trainingrun-controller`` means this operator; any other value names the
    controller that owns the run (e.g. ``kueue.x-k8s.io/multikueue``, which mirrors the run to
    a worker cluster), and this operator must create nothing and write no status for it.

    >>> managed_elsewhere(None) is None, managed_elsewhere(MANAGED_BY_POSTTRAIN) is None
    (True, True)
    >>> print(managed_elsewhere("kueue.x-k8s.io/multikueue"))
    spec.managedBy is 'kueue.x-k8s.io/multikueue', not 'posttrain.io/trainingrun-controller': that controller owns this run, so the posttrain operator creates nothing for it and writes no status
    """
    if managed_by is None or managed_by == MANAGED_BY_POSTTRAIN:
        return None
    return (
        f"spec.managedBy is {managed_by!r}, not {MANAGED_BY_POSTTRAIN!r}: that controller "
        "owns this run, so the posttrain operator creates nothing for it and writes no "
        "status"
    )


def plan_training_run(
    run: TrainingRun,
    pods: list[PodView],
    incarnation: int,
    now: datetime,
    ray_clusters: list[RayClusterView] | None = None,
    kueue: KueueGate | None = None,
) -> RunPlan:
    """Decide the next step of a TrainingRun from its pods (gang semantics).

    All pods of a gang share an incarnation. One failed pod fails the gang: every pod of it
    is deleted and a new incarnation is created, counting one restart; more than
    spec.backoffLimit restarts fail the run. Suspend deletes the gang and keeps the run;
    resuming starts a new incarnation (the trainer resumes from its last checkpoint).

    ``ray_clusters`` (a list, possibly empty) selects the KubeRay path for a multi-node run:
    the gang is one RayCluster ``<run>-g<incarnation>`` whose pods KubeRay creates; a
    RayCluster in state ``failed`` or any failed pod of it is a gang failure, with the same
    backoffLimit accounting. None = the plain pod path.

    ``kueue`` (a run labelled with a LocalQueue while Kueue is installed): no pod or
    RayCluster exists until Kueue admits the run's Workload; an eviction deletes the gang and
    re-admission starts a new one from the last checkpoint; suspend deactivates the Workload
    and a finished run marks it Finished, so the quota is released either way.

    The phases (:func:`_decide`) each return an immutable :class:`.decision.Decision`; the
    status is calculated once from all of them (:func:`_calculate`).
    """
    # A deleted pod no longer counts, except a KubeRay head held for its outcome: KubeRay
    # deletes it as soon as rank 0's container ends (raycluster.HEAD_OUTCOME_FINALIZER).
    live = tuple(p for p in pods if not p.deleting or HEAD_OUTCOME_FINALIZER in p.finalizers)
    clusters = None if ray_clusters is None else tuple(c for c in ray_clusters if not c.deleting)
    if run.status.phase in TERMINAL:
        return _ended(incarnation, live, clusters or (), kueue)
    return _calculate(run, incarnation, _decide(run, live, clusters, incarnation, now, kueue))


def _decide(
    run: TrainingRun,
    live: tuple[PodView, ...],
    clusters: tuple[RayClusterView, ...] | None,
    incarnation: int,
    now: datetime,
    kueue: KueueGate | None,
) -> list[Decision]:
    """The run's phases in order: health reports, suspension, admission, start and
    deadline, then the gang. The last decision is the one whose actions the plan carries."""
    names = tuple(c.name for c in clusters or ())
    decisions = [_sandbox_health(run), _rollout_health(run)]
    if run.spec.suspend:
        return [*decisions, _suspend(run, live, names, kueue)]
    decisions.append(_suspension_lifted(run, incarnation))
    if kueue is not None:
        conditions = _conditions_after(run, decisions)
        workload = kueue.workload
        if workload is None or not (workload.admitted and workload.active):
            return [*decisions, _wait_for_admission(run, kueue, live, names, conditions)]
        current = _incarnation_after(incarnation, decisions)
        decisions.append(_admitted(run, kueue, conditions, current))
    if run.status.start_time is None:
        decisions.append(Decision(fields=(("startTime", iso_time(now)),)))
    deadline = _deadline_exceeded(run, now)
    if deadline is not None:
        return [*decisions, run_failed(Reason.DEADLINE_EXCEEDED, deadline, now, live, names)]
    current = _incarnation_after(incarnation, decisions)
    if clusters is None:
        gang = pod_gang(run, live, current)
    else:
        gang = ray_cluster_gang(run, live, clusters, current)
    return [*decisions, plan_gang(run, gang, live, names, now)]


def _conditions_after(run: TrainingRun, decisions: list[Decision]) -> list[Condition]:
    """The run's conditions with every decision's changes applied, in order."""
    conditions = list(run.status.conditions)
    for decision in decisions:
        for c in decision.conditions:
            conditions = set_condition(
                conditions, c.type, c.status, c.reason, c.message, run.metadata.generation
            )
    return conditions


def _incarnation_after(incarnation: int, decisions: list[Decision]) -> int:
    for decision in decisions:
        if decision.incarnation is not None:
            incarnation = decision.incarnation
    return incarnation


def _calculate(run: TrainingRun, incarnation: int, decisions: list[Decision]) -> RunPlan:
    """The one place the status is computed: every decision's fields and conditions over
    the run's observedGeneration and maxSteps, sent as the diff against the current status."""
    desired: dict[str, Any] = {
        "observedGeneration": run.metadata.generation,
        "maxSteps": run.spec.total_steps(),
    }
    for decision in decisions:
        desired.update(decision.fields)
    desired["conditions"] = conditions_wire(_conditions_after(run, decisions))
    status_patch = status_diff(run.status.to_wire(), desired)
    last = decisions[-1]
    return RunPlan(
        incarnation=_incarnation_after(incarnation, decisions),
        create_ranks=list(last.create_ranks),
        delete_pods=list(last.delete_pods),
        ensure_children=last.ensure_children,
        create_ray_cluster=last.create_ray_cluster,
        delete_ray_clusters=list(last.delete_ray_clusters),
        status_patch=status_patch,
        events=[event for decision in decisions for event in decision.events],
        create_workload=last.create_workload,
        workload_active=last.workload_active,
        release=_released_when_ended(run, status_patch.get("phase")),
    )


def _released_when_ended(run: TrainingRun, phase: str | None) -> list[tuple[str, str, str]]:
    """What a run that ends now frees: its own sandbox runner has nothing left to verify (its
    Service and NetworkPolicy cost nothing and go with the run); after a failure no more
    checkpoints will come, so the evaluator would wait for the final one forever (after
    Succeeded it still scores the last checkpoint, then ends)."""
    release = []
    if phase in TERMINAL and sandbox_runner.needs_own_runner(run):
        release.append(("apps/v1", "Deployment", sandbox_runner.runner_name(run)))
    if phase == "Failed" and evaluator.needs_evaluator(run):
        release.append(("batch/v1", "Job", evaluator.evaluator_name(run)))
    return release


def _ended(
    incarnation: int,
    live: tuple[PodView, ...],
    clusters: tuple[RayClusterView, ...],
    kueue: KueueGate | None,
) -> RunPlan:
    """A run that ended keeps its status: what still runs goes, and Kueue gets its quota back."""
    workload = kueue.workload if kueue is not None else None
    return RunPlan(
        incarnation=incarnation,
        delete_pods=pods_to_delete_at_the_end(live),
        delete_ray_clusters=[c.name for c in clusters],
        finish_workload=workload is not None and not workload.finished,
    )


def _suspend(
    run: TrainingRun, live: tuple[PodView, ...], clusters: tuple[str, ...], kueue: KueueGate | None
) -> Decision:
    """spec.suspend: the gang goes (pods or RayCluster), and Kueue's quota with it."""
    status = run.status
    workload = kueue.workload if kueue is not None else None
    fields: list[tuple[str, Any]] = []
    if status.ray_cluster is not None:
        # JSON merge patch: null removes the mirrored RayCluster fields with the cluster.
        fields += [("rayCluster", None), ("rayClusterState", None), ("availableWorkers", None)]
    events: tuple[EventSpec, ...] = ()
    if status.phase != "Suspended":
        fields += [("phase", "Suspended"), ("message", "suspended: trainer pods deleted")]
        events = (
            EventSpec("Normal", Reason.SUSPENDED, "spec.suspend=true: deleted the trainer pods"),
        )
    return Decision(
        conditions=(
            ConditionChange(
                ConditionType.SUSPENDED, "True", Reason.SUSPENDED, "spec.suspend is true"
            ),
            ConditionChange(ConditionType.READY, "False", Reason.SUSPENDED, "suspended"),
        ),
        events=events,
        fields=tuple(fields),
        delete_pods=tuple(p.name for p in live),
        delete_ray_clusters=clusters,
        # Kueue evicts an inactive Workload and gives the quota back.
        workload_active=False if workload is not None and workload.active else None,
    )


def _suspension_lifted(run: TrainingRun, incarnation: int) -> Decision:
    """Not suspended: a resumed run starts the next incarnation from its last checkpoint."""
    status = run.status
    if status.phase == "Suspended":
        resumed = f"resumed from {status.last_checkpoint or 'the start (no checkpoint yet)'}"
        return Decision(
            conditions=(
                ConditionChange(
                    ConditionType.SUSPENDED,
                    "False",
                    Reason.RESUMED,
                    "resumed from the last checkpoint",
                ),
            ),
            events=(EventSpec("Normal", Reason.RESUMED, resumed),),
            incarnation=incarnation + 1,
        )
    if get_condition(status.conditions, ConditionType.SUSPENDED) is None:
        return Decision(
            conditions=(
                ConditionChange(ConditionType.SUSPENDED, "False", Reason.NOT_SUSPENDED, ""),
            )
        )
    return Decision()


def _deadline_exceeded(run: TrainingRun, now: datetime) -> str | None:
    """Why the run ran out of activeDeadlineSeconds (counted from startTime), if it did."""
    deadline = run.spec.active_deadline_seconds
    start = run.status.start_time or now
    if deadline is None or now < start + timedelta(seconds=deadline):
        return None
    return (
        f"ran longer than activeDeadlineSeconds={deadline}; raise it or resume from "
        f"{run.status.last_checkpoint or 'scratch'} in a new run"
    )


def _sandbox_health(run: TrainingRun) -> Decision:
    """SandboxAvailable from what the trainer reported in status.sandbox (absent until the
    trainer first verified with it); a change posts an event naming the sandbox."""
    health = run.status.sandbox
    if health is None:
        return Decision()
    where = f"{health.mode} sandbox {health.endpoint or ''}".rstrip()
    status: ConditionStatus
    if health.available:
        status, reason = "True", Reason.SANDBOX_WORKING
        message = f"{where} performs executions ({health.infra_failures} failure(s) retried)"
    else:
        status, reason = "False", Reason.SANDBOX_UNAVAILABLE
        message = (
            f"{where}: {health.last_error or 'executions fail'}; retried "
            f"{health.infra_failures} time(s), no sample scored while it fails"
        )
    before = get_condition(run.status.conditions, ConditionType.SANDBOX_AVAILABLE)
    changed = before is None or before.status != status
    kind = "Normal" if status == "True" else "Warning"
    return Decision(
        conditions=(
            ConditionChange(ConditionType.SANDBOX_AVAILABLE, status, reason, message[:1000]),
        ),
        events=(EventSpec(kind, reason, message),) if changed else (),
    )


def _rollout_health(run: TrainingRun) -> Decision:
    """RolloutAvailable from what the trainer reported in status.rollout (absent until a
    trainer looked for its pool's replicas); turning False posts a Warning event.

    >>> from posttrain.api.trainingrun import RolloutHealth
    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> run.status.rollout = RolloutHealth(pool="p", available=False, message="0 ready")
    >>> decision = _rollout_health(run)
    >>> [(c.type, c.status, c.reason) for c in decision.conditions]
    [('RolloutAvailable', 'False', 'NoReadyReplica')]
    >>> decision.events[0].reason
    'NoReadyReplica'
    """
    health = run.status.rollout
    if health is None:
        return Decision()
    status: ConditionStatus
    if health.available:
        status, reason = "True", Reason.REPLICAS_READY
        message = f"RolloutPool {health.pool}: {health.ready_replicas} ready replica(s)"
    else:
        status, reason = "False", Reason.NO_READY_REPLICA
        message = f"RolloutPool {health.pool} has no ready replica: {health.message or ''}"
    before = get_condition(run.status.conditions, ConditionType.ROLLOUT_AVAILABLE)
    warn = status == "False" and (before is None or before.status != status)
    return Decision(
        conditions=(
            ConditionChange(ConditionType.ROLLOUT_AVAILABLE, status, reason, message[:1000]),
        ),
        events=(EventSpec("Warning", reason, message),) if warn else (),
    )


def _wait_for_admission(
    run: TrainingRun,
    kueue: KueueGate,
    live: tuple[PodView, ...],
    clusters: tuple[str, ...],
    conditions: list[Condition],
) -> Decision:
    """Hold the run back until Kueue admits its Workload: no pods, no RayCluster,
    Suspended=True with Kueue's reason, and the Workload created or reactivated."""
    workload = kueue.workload
    name = workload_name(run)
    previous = get_condition(conditions, ConditionType.SUSPENDED)
    events: tuple[EventSpec, ...] = ()
    if workload is not None and workload.evicted_reason and (live or clusters):
        reason = Reason.EVICTED
        message = (
            f"Kueue evicted Workload {name} ({workload.evicted_reason}: "
            f"{workload.evicted_message or 'no message'}); the trainer pods were deleted "
            "and the run resumes from its last checkpoint when admitted again"
        )
        events = (EventSpec("Warning", reason, message),)
    else:
        still_evicted = (
            previous is not None and previous.status == "True" and previous.reason == Reason.EVICTED
        )
        reason = Reason.EVICTED if still_evicted else Reason.WAITING_FOR_ADMISSION
        why = workload.pending_message if workload is not None else ""
        message = f"waiting for Kueue to admit Workload {name} in LocalQueue {kueue.queue}" + (
            f": {why}" if why else ""
        )
        if previous is None or previous.status != "True" or previous.reason not in _KUEUE_WAITING:
            events = (EventSpec("Normal", Reason.WAITING_FOR_ADMISSION, message),)
    return Decision(
        conditions=(
            ConditionChange(ConditionType.SUSPENDED, "True", reason, message),
            ConditionChange(ConditionType.READY, "False", reason, message),
        ),
        events=events,
        fields=(("phase", "Pending"), ("message", message)),
        delete_pods=tuple(p.name for p in live),
        delete_ray_clusters=clusters,
        create_workload=workload is None,
        # Resumed after a suspend: the Workload competes for quota again.
        workload_active=True if workload is not None and not workload.active else None,
    )


def _admitted(
    run: TrainingRun, kueue: KueueGate, conditions: list[Condition], incarnation: int
) -> Decision:
    """Admitted: Suspended=False; after an eviction the gang restarts as a new incarnation
    (the old pods may still be terminating under the old names)."""
    previous = get_condition(conditions, ConditionType.SUSPENDED)
    if previous is None or previous.status != "True" or previous.reason not in _KUEUE_WAITING:
        return Decision()
    assert kueue.workload is not None
    message = (
        f"Kueue admitted Workload {kueue.workload.name} to ClusterQueue "
        f"{kueue.workload.cluster_queue or '?'}"
    )
    return Decision(
        conditions=(ConditionChange(ConditionType.SUSPENDED, "False", Reason.ADMITTED, message),),
        events=(EventSpec("Normal", Reason.ADMITTED, message),),
        incarnation=incarnation + 1 if previous.reason == Reason.EVICTED else None,
    )
