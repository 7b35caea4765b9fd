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

from posttrain.api import (
    TrainingRun,
    TrainingRunStatus,
)
from posttrain.api.base import Condition, ConditionStatus, get_condition, set_condition
from posttrain.api.labels import (
    LABEL_GANG,
    LABEL_RANK,
)
from posttrain.api.reasons import ConditionType, Reason
from posttrain.api.trainingrun import MANAGED_BY_POSTTRAIN

from ..shared.observe import TERMINAL, EventSpec, PodView, conditions_wire, iso_time, status_diff
from .kueue import WorkloadView, workload_name
from .raycluster import ray_cluster_name


@dataclass(frozen=True)
class RayClusterView:
    """The parts of a KubeRay RayCluster the TrainingRun decisions depend on."""

    name: str
    labels: dict[str, str]
    state: str = ""
    """status.state: "" until KubeRay has looked at it, then ready / failed / suspended."""
    reason: str = ""
    available_workers: int = 0
    desired_workers: int = 0
    deleting: bool = False

    @property
    def failed(self) -> bool:
        return self.state == "failed"


def ray_cluster_view(body: dict[str, Any]) -> RayClusterView:
    """Reduce a RayCluster (as the apiserver returns it) to a RayClusterView.

    >>> ray_cluster_view({"metadata": {"name": "r-g0"}, "status": {"state": "ready",
    ...                   "availableWorkerReplicas": 3}}).available_workers
    3
    """
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    groups = (body.get("spec") or {}).get("workerGroupSpecs") or []
    desired = status.get("desiredWorkerReplicas")
    if desired is None:
        desired = sum(int(g.get("replicas") or 0) for g in groups)
    return RayClusterView(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        state=str(status.get("state") or ""),
        reason=str(status.get("reason") or ""),
        available_workers=int(status.get("availableWorkerReplicas") or 0),
        desired_workers=int(desired),
        deleting=bool(meta.get("deletionTimestamp")),
    )


@dataclass
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


def pods_to_delete_at_the_end(pods: list[PodView]) -> list[str]:
    """The trainer pods a run that ended (Succeeded or Failed) deletes: those still running
    (other ranks, Ray workers, which would otherwise block forever). Finished pods stay, so
    ``kubectl logs`` and ``posttrain logs`` read rank 0 after the run, as Kubeflow's
    ``cleanPodPolicy: Running`` keeps them; they go with the TrainingRun (ownerReferences).
    A gang restart and ``suspend`` delete every pod of the gang instead.

    >>> from posttrain.operator.shared.observe import Terminated
    >>> done = PodView("r-g0-0", {}, phase="Succeeded", terminated=Terminated(exit_code=0))
    >>> pods_to_delete_at_the_end([done, PodView("r-g0-1", {}, phase="Running")])
    ['r-g0-1']
    """
    return [p.name for p in pods if not p.finished]


def plan_training_run(  # noqa: C901, PLR0915
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
    """
    spec, status = run.spec, run.status
    gen = run.metadata.generation
    nodes = spec.resources.nodes
    plan = RunPlan(incarnation=incarnation)
    live = [p for p in pods if not p.deleting]
    live_clusters = [c for c in ray_clusters or [] if not c.deleting]
    kuberay = ray_clusters is not None
    conditions = list(status.conditions)
    desired: dict[str, Any] = {"observedGeneration": gen, "maxSteps": spec.total_steps()}

    def fail(reason: str, message: str) -> None:
        nonlocal conditions
        desired.update(phase="Failed", message=message, completionTime=iso_time(now))
        conditions = set_condition(conditions, ConditionType.FAILED, "True", reason, message, gen)
        conditions = set_condition(conditions, ConditionType.READY, "False", reason, message, gen)
        plan.delete_pods = pods_to_delete_at_the_end(live)
        plan.delete_ray_clusters = [c.name for c in live_clusters]
        plan.create_ranks = []
        plan.create_ray_cluster = False
        plan.events.append(EventSpec("Warning", reason, message))

    workload = kueue.workload if kueue is not None else None
    if status.phase in TERMINAL:
        plan.delete_pods = pods_to_delete_at_the_end(live)
        plan.delete_ray_clusters = [c.name for c in live_clusters]
        plan.finish_workload = workload is not None and not workload.finished
        return plan

    conditions = _sandbox_condition(run, conditions, plan)
    conditions = _rollout_condition(run, conditions, plan)
    if spec.suspend:
        if workload is not None and workload.active:
            plan.workload_active = False  # Kueue evicts it and gives the quota back
        plan.delete_pods = [p.name for p in live]
        plan.delete_ray_clusters = [c.name for c in live_clusters]
        if status.ray_cluster is not None:
            # JSON merge patch: null removes the mirrored RayCluster fields with the cluster.
            desired.update(rayCluster=None, rayClusterState=None, availableWorkers=None)
        if status.phase != "Suspended":
            desired.update(phase="Suspended", message="suspended: trainer pods deleted")
            plan.events.append(
                EventSpec("Normal", Reason.SUSPENDED, "spec.suspend=true: deleted the trainer pods")
            )
        conditions = set_condition(
            conditions,
            ConditionType.SUSPENDED,
            "True",
            Reason.SUSPENDED,
            "spec.suspend is true",
            gen,
        )
        conditions = set_condition(
            conditions, ConditionType.READY, "False", Reason.SUSPENDED, "suspended", gen
        )
        desired["conditions"] = conditions_wire(conditions)
        plan.status_patch = status_diff(status.to_wire(), desired)
        return plan

    if status.phase == "Suspended":
        plan.incarnation = incarnation = incarnation + 1
        conditions = set_condition(
            conditions,
            ConditionType.SUSPENDED,
            "False",
            Reason.RESUMED,
            "resumed from the last checkpoint",
            gen,
        )
        plan.events.append(
            EventSpec(
                "Normal",
                Reason.RESUMED,
                f"resumed from {status.last_checkpoint or 'the start (no checkpoint yet)'}",
            )
        )
    elif get_condition(conditions, ConditionType.SUSPENDED) is None:
        conditions = set_condition(
            conditions, ConditionType.SUSPENDED, "False", Reason.NOT_SUSPENDED, "", gen
        )

    if kueue is not None:
        waiting = _plan_kueue_admission(run, kueue, live, live_clusters, plan, desired, conditions)
        if waiting is not None:
            desired["conditions"] = conditions_wire(waiting)
            plan.status_patch = status_diff(status.to_wire(), desired)
            return plan
        conditions = _mark_admitted(run, kueue, plan, conditions)
        incarnation = plan.incarnation

    start = status.start_time or now
    if status.start_time is None:
        desired["startTime"] = iso_time(now)
    deadline = spec.active_deadline_seconds
    if deadline is not None and now >= start + timedelta(seconds=deadline):
        fail(
            Reason.DEADLINE_EXCEEDED,
            f"ran longer than activeDeadlineSeconds={deadline}; raise it or resume from "
            f"{status.last_checkpoint or 'scratch'} in a new run",
        )
        desired["conditions"] = conditions_wire(conditions)
        plan.status_patch = status_diff(status.to_wire(), desired)
        return plan

    if kuberay:
        conditions, failure = _plan_ray_cluster_gang(
            run, live, live_clusters, plan, desired, conditions, now
        )
        if failure is not None:
            fail(*failure)
        desired["conditions"] = conditions_wire(conditions)
        plan.status_patch = status_diff(status.to_wire(), desired)
        return plan

    gang = {
        p.labels.get(LABEL_RANK): p for p in live if p.labels.get(LABEL_GANG) == str(incarnation)
    }
    stale = [p.name for p in live if p.labels.get(LABEL_GANG) != str(incarnation)]
    plan.delete_pods = stale
    failed = [p for p in gang.values() if p.phase == "Failed"]
    head = gang.get("0")
    restarts = status.restarts

    if failed:
        restarts += 1
        desired["restarts"] = restarts
        why = ", ".join(f"{p.name} ({p.reason or _exit_text(p)})" for p in failed)
        if restarts > spec.backoff_limit:
            fail(
                Reason.BACKOFF_LIMIT_EXCEEDED, _backoff_exceeded(restarts, spec.backoff_limit, why)
            )
        else:
            plan.delete_pods = stale + [p.name for p in gang.values()]
            plan.incarnation = incarnation + 1
            plan.create_ranks = list(range(nodes))
            plan.ensure_children = True
            desired.update(
                phase="Pending", message=f"restart {restarts}/{spec.backoff_limit} after {why}"
            )
            conditions = set_condition(
                conditions,
                ConditionType.READY,
                "False",
                Reason.GANG_RESTART,
                desired["message"],
                gen,
            )
            plan.events.append(
                EventSpec(
                    "Warning",
                    Reason.GANG_RESTART,
                    f"{why} failed: recreating all {nodes} pod(s) as gang {plan.incarnation} "
                    f"(restart {restarts} of {spec.backoff_limit})",
                )
            )
    elif head is not None and head.phase == "Succeeded":
        conditions = _mark_trainer_succeeded(status, desired, conditions, plan, now, gen)
        plan.delete_pods = stale + pods_to_delete_at_the_end(list(gang.values()))
    else:
        missing = [r for r in range(nodes) if str(r) not in gang]
        if missing:
            plan.create_ranks = missing
            plan.ensure_children = True
        if not missing and all(p.phase == "Running" for p in gang.values()):
            if status.phase != "Running":
                plan.events.append(
                    EventSpec("Normal", Reason.RUNNING, f"all {nodes} trainer pod(s) running")
                )
            desired.update(phase="Running", message=f"{nodes} trainer pod(s) running")
            conditions = set_condition(
                conditions, ConditionType.READY, "True", Reason.RUNNING, desired["message"], gen
            )
        else:
            if status.phase in (None, "Suspended"):
                plan.events.append(
                    EventSpec(
                        "Normal",
                        Reason.PODS_CREATED,
                        f"creating gang {incarnation} of {nodes} pod(s)",
                    )
                )
            pending = nodes - sum(p.phase == "Running" for p in gang.values())
            desired.update(phase="Pending", message=f"waiting for {pending}/{nodes} pod(s)")
            conditions = set_condition(
                conditions,
                ConditionType.READY,
                "False",
                Reason.PODS_PENDING,
                desired["message"],
                gen,
            )
    desired["conditions"] = conditions_wire(conditions)
    plan.status_patch = status_diff(status.to_wire(), desired)
    return plan


def _sandbox_condition(
    run: TrainingRun, conditions: list[Condition], plan: RunPlan
) -> list[Condition]:
    """SandboxAvailable from what the trainer reported in status.sandbox (absent until the
    trainer first verified with it); a change posts an event naming the sandbox."""
    health = run.status.sandbox
    if health is None:
        return conditions
    gen = run.metadata.generation
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
    before = get_condition(conditions, ConditionType.SANDBOX_AVAILABLE)
    if before is None or before.status != status:
        plan.events.append(EventSpec("Normal" if status == "True" else "Warning", reason, message))
    return set_condition(
        conditions, ConditionType.SANDBOX_AVAILABLE, status, reason, message[:1000], gen
    )


def _rollout_condition(
    run: TrainingRun, conditions: list[Condition], plan: RunPlan
) -> list[Condition]:
    """RolloutAvailable from what the trainer reported in status.rollout (absent until a
    trainer looked for its pool's replicas); turning False posts a Warning event.

    >>> from posttrain.api.trainingrun import RolloutHealth
    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> run.status.rollout = RolloutHealth(pool="p", available=False, message="0 ready")
    >>> plan = RunPlan(incarnation=0)
    >>> [(c.type, c.status, c.reason) for c in _rollout_condition(run, [], plan)]
    [('RolloutAvailable', 'False', 'NoReadyReplica')]
    >>> plan.events[0].reason
    'NoReadyReplica'
    """
    health = run.status.rollout
    if health is None:
        return conditions
    gen = run.metadata.generation
    status: ConditionStatus
    if health.available:
        status, reason = "True", Reason.REPLICAS_READY
        message = f"RolloutPool {health.pool}: {health.ready_replicas} ready replica(s)"
    else:
        status, reason = "False", Reason.NO_READY_REPLICA
        message = f"RolloutPool {health.pool} has no ready replica: {health.message or ''}"
    before = get_condition(conditions, ConditionType.ROLLOUT_AVAILABLE)
    if status == "False" and (before is None or before.status != status):
        plan.events.append(EventSpec("Warning", reason, message))
    return set_condition(
        conditions, ConditionType.ROLLOUT_AVAILABLE, status, reason, message[:1000], gen
    )


def _plan_kueue_admission(
    run: TrainingRun,
    kueue: KueueGate,
    live: list[PodView],
    live_clusters: list[RayClusterView],
    plan: RunPlan,
    desired: dict[str, Any],
    conditions: list[Condition],
) -> list[Condition] | None:
    """Hold the run back until Kueue admits its Workload: the conditions to write while it
    waits (no pods, no RayCluster), or None once it is admitted."""
    gen = run.metadata.generation
    workload = kueue.workload
    if workload is None:
        plan.create_workload = True
    elif not workload.active:
        plan.workload_active = True  # resumed after a suspend
    if workload is not None and workload.admitted and workload.active:
        return None
    name = workload_name(run)
    evicted = workload is not None and bool(workload.evicted_reason) and bool(live or live_clusters)
    if evicted:
        assert workload is not None
        reason = Reason.EVICTED
        message = (
            f"Kueue evicted Workload {name} ({workload.evicted_reason}: "
            f"{workload.evicted_message or 'no message'}); the trainer pods were deleted "
            "and the run resumes from its last checkpoint when admitted again"
        )
        plan.events.append(EventSpec("Warning", reason, message))
    else:
        previous = get_condition(conditions, ConditionType.SUSPENDED)
        reason = (
            previous.reason
            if previous is not None
            and previous.status == "True"
            and (previous.reason == Reason.EVICTED)
            else Reason.WAITING_FOR_ADMISSION
        )
        why = workload.pending_message if workload is not None else ""
        message = f"waiting for Kueue to admit Workload {name} in LocalQueue {kueue.queue}" + (
            f": {why}" if why else ""
        )
        if previous is None or previous.status != "True" or previous.reason not in _KUEUE_WAITING:
            plan.events.append(EventSpec("Normal", Reason.WAITING_FOR_ADMISSION, message))
    plan.delete_pods = [p.name for p in live]
    plan.delete_ray_clusters = [c.name for c in live_clusters]
    desired.update(phase="Pending", message=message)
    conditions = set_condition(conditions, ConditionType.SUSPENDED, "True", reason, message, gen)
    return set_condition(conditions, ConditionType.READY, "False", reason, message, gen)


def _mark_admitted(
    run: TrainingRun, kueue: KueueGate, plan: RunPlan, conditions: list[Condition]
) -> list[Condition]:
    """Admitted: Suspended=False; after an eviction the gang restarts as a new incarnation
    (the old pods may still be terminating under the old names)."""
    previous = get_condition(conditions, ConditionType.SUSPENDED)
    if previous is None or previous.status != "True" or previous.reason not in _KUEUE_WAITING:
        return conditions
    assert kueue.workload is not None
    if previous.reason == Reason.EVICTED:
        plan.incarnation += 1
    message = (
        f"Kueue admitted Workload {kueue.workload.name} to ClusterQueue "
        f"{kueue.workload.cluster_queue or '?'}"
    )
    plan.events.append(EventSpec("Normal", Reason.ADMITTED, message))
    return set_condition(
        conditions,
        ConditionType.SUSPENDED,
        "False",
        Reason.ADMITTED,
        message,
        run.metadata.generation,
    )


def _mark_trainer_succeeded(
    status: TrainingRunStatus,
    desired: dict[str, Any],
    conditions: list[Condition],
    plan: RunPlan,
    now: datetime,
    gen: int | None,
) -> list[Condition]:
    """The head pod (rank 0) succeeded: the run is Succeeded, for pod gangs and RayClusters."""
    message = (
        f"trainer finished at step {status.step}"
        if status.step is not None
        else ("trainer finished")
    )
    desired.update(phase="Succeeded", message=message, completionTime=iso_time(now))
    conditions = set_condition(
        conditions, ConditionType.SUCCEEDED, "True", Reason.TRAINER_SUCCEEDED, message, gen
    )
    conditions = set_condition(
        conditions, ConditionType.READY, "False", Reason.TRAINER_SUCCEEDED, message, gen
    )
    plan.events.append(EventSpec("Normal", Reason.TRAINER_SUCCEEDED, message))
    return conditions


def _backoff_exceeded(restarts: int, limit: int, why: str) -> str:
    """
    >>> _backoff_exceeded(3, 2, "r-g2-0 (Error)")
    'gang failed 3 times, more than backoffLimit=2; last failure: r-g2-0 (Error)'
    """
    return f"gang failed {restarts} times, more than backoffLimit={limit}; last failure: {why}"


def _plan_ray_cluster_gang(
    run: TrainingRun,
    live: list[PodView],
    clusters: list[RayClusterView],
    plan: RunPlan,
    desired: dict[str, Any],
    conditions: list[Condition],
    now: datetime,
) -> tuple[list[Condition], tuple[str, str] | None]:
    """The gang part of :func:`plan_training_run` when the gang is a KubeRay RayCluster.

    Returns the new conditions and, when the run must fail, (reason, message). The pods are
    KubeRay's (they carry our labels from the templates): a failed one fails the gang at once,
    before KubeRay deletes and replaces it, and the head pod succeeding is the trainer
    finishing. ``status.rayCluster``, ``rayClusterState`` and ``availableWorkers`` mirror the
    cluster so ``kubectl get tr`` shows what KubeRay is doing.
    """
    spec, status = run.spec, run.status
    gen = run.metadata.generation
    incarnation = plan.incarnation
    workers = spec.resources.nodes - 1
    name = ray_cluster_name(run.metadata.name, incarnation)
    current = next((c for c in clusters if c.name == name), None)
    gang = [p for p in live if p.labels.get(LABEL_GANG) == str(incarnation)]
    plan.delete_ray_clusters = [c.name for c in clusters if c.name != name]
    plan.delete_pods = [p.name for p in live if p.labels.get(LABEL_GANG) != str(incarnation)]
    head = next((p for p in gang if p.labels.get(LABEL_RANK) == "0"), None)
    failed = [f"{p.name} ({p.reason or _exit_text(p)})" for p in gang if p.phase == "Failed"]
    if current is not None and current.failed:
        failed.insert(0, f"RayCluster {name} failed ({current.reason or 'no reason given'})")
    desired.update(
        rayCluster=name,
        rayClusterState=current.state if current else None,
        availableWorkers=current.available_workers if current else 0,
    )
    if desired["rayClusterState"] is None:
        del desired["rayClusterState"]

    if failed:
        restarts = status.restarts + 1
        desired["restarts"] = restarts
        why = ", ".join(failed)
        if restarts > spec.backoff_limit:
            return conditions, (
                Reason.BACKOFF_LIMIT_EXCEEDED,
                _backoff_exceeded(restarts, spec.backoff_limit, why),
            )
        plan.delete_ray_clusters.append(name)
        plan.delete_pods += [p.name for p in gang]
        plan.incarnation = incarnation + 1
        plan.create_ray_cluster = True
        plan.ensure_children = True
        new_name = ray_cluster_name(run.metadata.name, plan.incarnation)
        desired.update(
            phase="Pending",
            rayCluster=new_name,
            availableWorkers=0,
            message=f"restart {restarts}/{spec.backoff_limit} after {why}",
        )
        desired.pop("rayClusterState", None)
        conditions = set_condition(
            conditions, ConditionType.READY, "False", Reason.GANG_RESTART, desired["message"], gen
        )
        plan.events.append(
            EventSpec(
                "Warning",
                Reason.GANG_RESTART,
                f"{why}: recreating the RayCluster as {new_name} "
                f"(restart {restarts} of {spec.backoff_limit})",
            )
        )
    elif head is not None and head.phase == "Succeeded":
        conditions = _mark_trainer_succeeded(status, desired, conditions, plan, now, gen)
        plan.delete_ray_clusters.append(name)
        plan.delete_pods += [p.name for p in gang if not p.finished]
    elif current is None:
        plan.create_ray_cluster = True
        plan.ensure_children = True
        if status.phase in (None, "Suspended"):
            plan.events.append(
                EventSpec(
                    "Normal",
                    Reason.RAY_CLUSTER_CREATED,
                    f"creating RayCluster {name}: a head and {workers} worker(s)",
                )
            )
        desired.update(phase="Pending", message=f"waiting for RayCluster {name}")
        conditions = set_condition(
            conditions,
            ConditionType.READY,
            "False",
            Reason.RAY_CLUSTER_PENDING,
            desired["message"],
            gen,
        )
    elif current.state == "ready":
        message = (
            f"RayCluster {name} ready: {current.available_workers}/{workers} worker(s) available"
        )
        if status.phase != "Running":
            plan.events.append(EventSpec("Normal", Reason.RUNNING, message))
        desired.update(phase="Running", message=message)
        conditions = set_condition(
            conditions, ConditionType.READY, "True", Reason.RUNNING, message, gen
        )
    else:
        desired.update(
            phase="Pending",
            message=(
                f"waiting for RayCluster {name} (state {current.state or 'not reported yet'}, "
                f"{current.available_workers}/{workers} worker(s) available)"
            ),
        )
        conditions = set_condition(
            conditions,
            ConditionType.READY,
            "False",
            Reason.RAY_CLUSTER_PENDING,
            desired["message"],
            gen,
        )
    return conditions, None


def _exit_text(pod: PodView) -> str:
    return f"exit {pod.terminated.exit_code}" if pod.terminated else "failed"
