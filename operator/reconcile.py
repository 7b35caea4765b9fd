"""Decision logic as pure functions: (spec, observed children, now) -> actions + status patch.

Handlers feed these from the operator's caches and execute the returned plan; tests call
them directly with hand-written observations. Every function is level-triggered: it looks
at the whole observed state, never at "what just happened", so replaying it after an
operator restart yields the same actions (deterministic names make creates idempotent).

Status ownership: plans only ever set the operator's fields (phase, conditions,
observedGeneration, restarts, maxSteps, startTime, completionTime, message, rayCluster,
rayClusterState, availableWorkers for runs; all
result fields for sandboxes; replica counts for pools). Trainer fields (step, rewardMean,
domainRewards, evalAccuracy, lastCheckpoint, weightVersion) never appear in a run's patch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from posttrain.api import RolloutPool, SandboxTask, TrainingRun, TrainingRunStatus
from posttrain.api.base import Condition, ConditionStatus, get_condition, set_condition
from posttrain.api.labels import (
    ANNOTATION_LOGS_URI,
    ANNOTATION_SNAPSHOT_URI,
    ANNOTATION_WEIGHT_VERSION,
    LABEL_ATTEMPT,
    LABEL_GANG,
    LABEL_RANK,
)
from posttrain.api.reasons import ConditionType, Reason, SandboxExitReason
from posttrain.api.trainingrun import MANAGED_BY_POSTTRAIN

from .builders import ray_cluster_name, sandbox_pod_name
from .kueue import WorkloadView, workload_name

TERMINAL = ("Succeeded", "Failed")


# ---------------------------------------------------------------- observations


@dataclass(frozen=True)
class Terminated:
    """A container's terminated state (what the kubelet reports)."""

    exit_code: int
    reason: str = ""
    message: str = ""
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class PodView:
    """The parts of a Pod the decisions depend on."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    phase: str = "Pending"
    reason: str = ""
    message: str = ""
    deleting: bool = False
    ready: bool = False
    terminated: Terminated | None = None
    start_time: datetime | None = None
    # Long-running servers (pool replicas) restart in place: what the kubelet says about it.
    restarts: int = 0
    ip: str = ""  # status.podIP
    waiting_reason: str = ""  # main container waiting, e.g. CrashLoopBackOff
    last_message: str = ""  # main container's last termination message
    init_failure: str = ""  # a failed init container's termination message (or reason)

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def pod_view(pod: dict[str, Any]) -> PodView:
    """Reduce a Pod manifest (as the apiserver returns it) to a PodView.

    >>> pod_view({"metadata": {"name": "p"}, "status": {"phase": "Running"}}).phase
    'Running'
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    terminated = None
    for cs in status.get("containerStatuses") or []:
        state = (cs.get("state") or {}).get("terminated")
        # The main (first) container decides; init containers are ignored.
        if state is not None:
            terminated = Terminated(
                exit_code=int(state.get("exitCode", 0)),
                reason=state.get("reason") or "",
                message=state.get("message") or "",
                started_at=_time(state.get("startedAt")),
                finished_at=_time(state.get("finishedAt")),
            )
            break
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    main = (status.get("containerStatuses") or [{}])[0]
    last = ((main.get("lastState") or {}).get("terminated")) or {}
    return PodView(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        phase=status.get("phase") or "Pending",
        reason=status.get("reason") or "",
        message=status.get("message") or "",
        deleting=bool(meta.get("deletionTimestamp")),
        ready=ready,
        terminated=terminated,
        start_time=_time(status.get("startTime")),
        restarts=int(main.get("restartCount") or 0),
        ip=status.get("podIP") or "",
        waiting_reason=((main.get("state") or {}).get("waiting") or {}).get("reason") or "",
        last_message=(last.get("message") or "").strip(),
        init_failure=_init_failure(status.get("initContainerStatuses") or []),
    )


def _init_failure(statuses: list[dict[str, Any]]) -> str:
    """The termination message (else reason) of an init container that exited non-zero.

    >>> _init_failure([{"name": "fetch-model", "lastState": {"terminated": {
    ...     "exitCode": 1, "message": "cannot fetch model s3://b/m: no such key"}}}])
    'fetch-model: cannot fetch model s3://b/m: no such key'
    """
    for cs in statuses:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            done = state.get("terminated")
            if done and int(done.get("exitCode") or 0) != 0:
                why = (done.get("message") or "").strip() or done.get("reason") or "failed"
                return f"{cs.get('name', 'init')}: {why}"
    return ""


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


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the parent: type Normal/Warning, reason, message."""

    type: str
    reason: str
    message: str


def _conditions_wire(conditions: list[Condition]) -> list[dict[str, Any]]:
    return [c.to_wire() for c in conditions]


def _iso(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def status_diff(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """Keys of ``desired`` whose value differs from ``current`` (a minimal merge patch).

    >>> status_diff({"phase": "Pending", "step": 3}, {"phase": "Running"})
    {'phase': 'Running'}
    """
    return {k: v for k, v in desired.items() if current.get(k) != v}


# ---------------------------------------------------------------- SandboxTask


@dataclass(frozen=True)
class SandboxResult:
    """What one attempt produced."""

    exit_code: int | None
    reward: float | None
    duration_ms: float | None
    reason: str
    sandbox_failed: bool
    """True when the sandbox (not the program) failed: eviction, start error, lost pod."""
    logs_uri: str | None = None
    """Where the entrypoint stored the full log (only when it says the upload worked)."""
    snapshot_uri: str | None = None
    """Where the entrypoint stored the workdir tar (spec.snapshot)."""


# Container termination reasons that mean the program never really ran.
_INFRA_REASONS = {"ContainerCannotRun", "StartError", "CreateContainerError", "Evicted"}


def parse_sandbox_result(pod: PodView) -> SandboxResult:
    """Read the result protocol from a finished sandbox pod.

    The program's wrapper writes ``{"exit_code", "reward", "duration_ms", "reason"}`` to
    /dev/termination-log; with FallbackToLogsOnError a crash leaves log text there instead,
    so anything that is not that JSON falls back to the exit code (reward 1 on exit 0).

    >>> t = Terminated(exit_code=0, message='{"exit_code": 0, "reward": 0.5, "duration_ms": 7}')
    >>> parse_sandbox_result(PodView("p", {}, phase="Succeeded", terminated=t)).reward
    0.5
    """
    if pod.reason == "DeadlineExceeded":
        return SandboxResult(
            exit_code=pod.terminated.exit_code if pod.terminated else None,
            reward=0.0,
            duration_ms=None,
            reason=SandboxExitReason.TIMEOUT,
            sandbox_failed=False,
        )
    term = pod.terminated
    if term is None or term.reason in _INFRA_REASONS:
        return SandboxResult(None, None, None, SandboxExitReason.SANDBOX_FAILED, True)
    duration_ms = None
    if term.started_at and term.finished_at:
        duration_ms = (term.finished_at - term.started_at).total_seconds() * 1000.0
    result: dict[str, Any] = {}
    try:
        parsed = json.loads(term.message) if term.message.strip().startswith("{") else {}
        result = parsed if isinstance(parsed, dict) else {}
    except ValueError:
        result = {}
    exit_code = int(result.get("exit_code", term.exit_code))
    if term.reason == "OOMKilled":
        reason = SandboxExitReason.OOM_KILLED
    else:
        reason = str(
            result.get("reason")
            or (SandboxExitReason.COMPLETED if exit_code == 0 else SandboxExitReason.ERROR)
        )
    reward = result.get("reward")
    if reward is None:
        reward = 1.0 if exit_code == 0 and reason == SandboxExitReason.COMPLETED else 0.0
    if result.get("duration_ms") is not None:
        duration_ms = float(result["duration_ms"])
    # The pod's annotations say where its entrypoint was told to store; its result says
    # whether that worked.
    logs_uri = pod.annotations.get(ANNOTATION_LOGS_URI) if result.get("logs_uploaded") else None
    snapshot_uri = (
        pod.annotations.get(ANNOTATION_SNAPSHOT_URI) if result.get("snapshot_uploaded") else None
    )
    return SandboxResult(
        exit_code,
        float(reward),
        duration_ms,
        reason,
        False,
        logs_uri=logs_uri,
        snapshot_uri=snapshot_uri,
    )


@dataclass
class SandboxPlan:
    """What to do for one SandboxTask."""

    create_attempt: int | None = None
    delete_pods: list[str] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)
    delete_task: bool = False


def plan_sandbox(task: SandboxTask, pods: list[PodView], now: datetime) -> SandboxPlan:
    """Decide the next step of a SandboxTask from its pods.

    Attempts: the pod of attempt n is ``<task>-<n>``; a sandbox failure (not a program
    failure) starts attempt n+1 while ``n < 1 + spec.retries``. Finished tasks are deleted
    ``ttlSecondsAfterFinished`` after completionTime.
    """
    status = task.status
    plan = SandboxPlan()
    gen = task.metadata.generation
    if status.phase in TERMINAL:
        ttl = task.spec.ttl_seconds_after_finished
        done_at = status.completion_time
        if ttl is not None and done_at is not None and now >= done_at + timedelta(seconds=ttl):
            plan.delete_task = True
            plan.delete_pods = [p.name for p in pods if not p.deleting]
            plan.events.append(
                EventSpec("Normal", Reason.TTL_EXPIRED, f"deleted {ttl} s after it finished")
            )
        return plan

    # Attempt 1 is implied: its pod is created without a status write, so a burst of tasks
    # costs one pod create each; attempts/podName are written with the first transition.
    attempts = max(status.attempts, 1)
    current_name = sandbox_pod_name(task.metadata.name, attempts)
    desired: dict[str, Any] = {
        "observedGeneration": gen,
        "attempts": attempts,
        "podName": current_name,
    }
    conditions = list(status.conditions)
    current = next((p for p in pods if p.name == current_name), None)
    if current is None:
        # A pod claimed from a SandboxWarmPool keeps its generated name; its attempt label
        # says which attempt it serves.
        current = next((p for p in pods if attempt_of(p) == attempts and not p.deleting), None)
        if current is not None:
            desired["podName"] = current_name = current.name
    if current is None:
        # New task, cache lag, or deleted by someone: create-or-adopt is idempotent.
        plan.create_attempt = attempts
        if status.attempts == 0:
            return plan  # nothing to record yet
    elif not current.finished:
        if current.phase == "Running" and status.phase != "Running":
            desired.update(
                phase="Running", startTime=_iso(status.start_time or current.start_time or now)
            )
            conditions = set_condition(
                conditions,
                ConditionType.READY,
                "True",
                Reason.POD_RUNNING,
                "the program is running",
                gen,
            )
        elif status.attempts == 0:
            return plan  # created, not started: still nothing to record
    else:
        result = parse_sandbox_result(current)
        if result.sandbox_failed and attempts < 1 + task.spec.retries:
            attempts += 1
            plan.create_attempt = attempts
            desired.update(
                attempts=attempts,
                podName=sandbox_pod_name(task.metadata.name, attempts),
                phase="Pending",
            )
            why = current.reason or current.message or "the pod failed before the program ran"
            plan.events.append(
                EventSpec(
                    "Warning",
                    Reason.SANDBOX_RETRY,
                    f"attempt {attempts - 1} failed ({why}); retrying as {desired['podName']} "
                    f"({attempts}/{1 + task.spec.retries})",
                )
            )
        else:
            desired["startTime"] = _iso(status.start_time or current.start_time or now)
            _finish_sandbox(task, result, attempts, now, desired, plan)
            conditions = _sandbox_final_conditions(conditions, desired, gen)
    desired["conditions"] = _conditions_wire(conditions)
    plan.status_patch = status_diff(task.status.to_wire(), desired)
    return plan


def _finish_sandbox(
    task: SandboxTask,
    result: SandboxResult,
    attempts: int,
    now: datetime,
    desired: dict[str, Any],
    plan: SandboxPlan,
) -> None:
    succeeded = (
        not result.sandbox_failed
        and result.exit_code == 0
        and (result.reason == SandboxExitReason.COMPLETED)
    )
    desired.update(
        phase="Succeeded" if succeeded else "Failed",
        exitCode=result.exit_code,
        reward=result.reward if result.reward is not None else 0.0,
        durationMs=result.duration_ms,
        reason=result.reason,
        completionTime=_iso(now),
        logsUri=result.logs_uri,
        snapshotUri=result.snapshot_uri,
    )
    for key in [k for k, v in desired.items() if v is None]:
        del desired[key]  # e.g. no duration known: leave the field unset, not null
    if succeeded:
        plan.events.append(
            EventSpec("Normal", Reason.COMPLETED, f"exit 0, reward {desired['reward']}")
        )
    elif result.sandbox_failed:
        plan.events.append(
            EventSpec(
                "Warning",
                Reason.SANDBOX_FAILED,
                f"the sandbox failed on all {attempts} attempt(s) (spec.retries="
                f"{task.spec.retries}); check node capacity, the image and the RuntimeClass",
            )
        )
    else:
        plan.events.append(
            EventSpec(
                "Warning",
                Reason.PROGRAM_FAILED,
                f"the program ended with {result.reason} (exit {result.exit_code})",
            )
        )


def _sandbox_final_conditions(
    conditions: list[Condition], desired: dict[str, Any], gen: int | None
) -> list[Condition]:
    ok = desired["phase"] == "Succeeded"
    reason = desired.get("reason", "")
    if ok:
        conditions = set_condition(
            conditions,
            ConditionType.SUCCEEDED,
            "True",
            Reason.COMPLETED,
            "the program exited 0",
            gen,
        )
    else:
        why = (
            Reason.SANDBOX_FAILED
            if reason == SandboxExitReason.SANDBOX_FAILED
            else Reason.PROGRAM_FAILED
        )
        conditions = set_condition(
            conditions,
            ConditionType.FAILED,
            "True",
            why,
            f"ended with {reason} (exit {desired.get('exitCode')})",
            gen,
        )
    return set_condition(
        conditions,
        ConditionType.READY,
        "False",
        Reason.COMPLETED if ok else Reason.PROGRAM_FAILED,
        "finished",
        gen,
    )


# ---------------------------------------------------------------- TrainingRun


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
        desired.update(phase="Failed", message=message, completionTime=_iso(now))
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
        desired["conditions"] = _conditions_wire(conditions)
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
            desired["conditions"] = _conditions_wire(waiting)
            plan.status_patch = status_diff(status.to_wire(), desired)
            return plan
        conditions = _mark_admitted(run, kueue, plan, conditions)
        incarnation = plan.incarnation

    start = status.start_time or now
    if status.start_time is None:
        desired["startTime"] = _iso(now)
    deadline = spec.active_deadline_seconds
    if deadline is not None and now >= start + timedelta(seconds=deadline):
        fail(
            Reason.DEADLINE_EXCEEDED,
            f"ran longer than activeDeadlineSeconds={deadline}; raise it or resume from "
            f"{status.last_checkpoint or 'scratch'} in a new run",
        )
        desired["conditions"] = _conditions_wire(conditions)
        plan.status_patch = status_diff(status.to_wire(), desired)
        return plan

    if kuberay:
        conditions, failure = _plan_ray_cluster_gang(
            run, live, live_clusters, plan, desired, conditions, now
        )
        if failure is not None:
            fail(*failure)
        desired["conditions"] = _conditions_wire(conditions)
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
    desired["conditions"] = _conditions_wire(conditions)
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
    >>> from posttrain.operator.builders import _example_run
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
    desired.update(phase="Succeeded", message=message, completionTime=_iso(now))
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


# ---------------------------------------------------------------- RolloutPool


@dataclass
class PoolPlan:
    """What to do for one RolloutPool."""

    create_deployment: bool = False
    patch_deployment: dict[str, Any] | None = None
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)


def plan_rollout_pool(
    pool: RolloutPool,
    desired_deployment: dict[str, Any],
    deployment: dict[str, Any] | None,
    pods: list[PodView],
    selector: str,
    endpoint: str,
    served: dict[str, int] | None = None,
) -> PoolPlan:
    """Converge the Deployment on the desired one and mirror its counts into the status.

    Drift is detected through the template's spec-hash annotation (not a field-by-field
    diff, which the apiserver's defaulting would always make noisy); replicas are compared
    directly because ``kubectl scale`` changes only them.
    """
    from posttrain.api.labels import ANNOTATION_SPEC_HASH

    plan = PoolPlan()
    gen = pool.metadata.generation
    status = pool.status
    conditions = list(status.conditions)
    want_replicas = pool.spec.replicas
    if deployment is None:
        plan.create_deployment = True
        plan.events.append(
            EventSpec(
                "Normal",
                Reason.DEPLOYMENT_CREATED,
                f"created Deployment with {want_replicas} replica(s)",
            )
        )
        replicas = ready = updated = 0
    else:
        have_hash = ((deployment.get("metadata") or {}).get("annotations") or {}).get(
            ANNOTATION_SPEC_HASH
        )
        want_hash = desired_deployment["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        patch: dict[str, Any] = {}
        if have_hash != want_hash:
            patch = {
                "metadata": {"annotations": {ANNOTATION_SPEC_HASH: want_hash}},
                "spec": {
                    "template": desired_deployment["spec"]["template"],
                    "replicas": want_replicas,
                },
            }
            plan.events.append(
                EventSpec(
                    "Normal", Reason.DEPLOYMENT_UPDATED, "server template changed: rolling update"
                )
            )
        elif (deployment.get("spec") or {}).get("replicas") != want_replicas:
            patch = {"spec": {"replicas": want_replicas}}
            plan.events.append(
                EventSpec(
                    "Normal",
                    Reason.DEPLOYMENT_UPDATED,
                    f"scaled from {(deployment.get('spec') or {}).get('replicas')} to "
                    f"{want_replicas} replica(s)",
                )
            )
        plan.patch_deployment = patch or None
        dstatus = deployment.get("status") or {}
        replicas = int(dstatus.get("replicas") or 0)
        ready = int(dstatus.get("readyReplicas") or 0)
        updated = int(dstatus.get("updatedReplicas") or 0)
    cond: ConditionStatus
    if want_replicas == 0:
        phase, cond, reason = "Ready", "True", Reason.SCALED_TO_ZERO
    elif ready >= want_replicas and updated >= want_replicas and replicas == want_replicas:
        phase, cond, reason = "Ready", "True", Reason.REPLICAS_READY
    elif deployment is not None and updated < replicas:
        phase, cond, reason = "Updating", "True" if ready > 0 else "False", Reason.ROLLING_UPDATE
    elif ready > 0:
        phase, cond, reason = "Degraded", "True", Reason.REPLICAS_UNAVAILABLE
    else:
        phase, cond, reason = "Pending", "False", Reason.REPLICAS_UNAVAILABLE
    message = f"{ready}/{want_replicas} replica(s) ready"
    trouble = replica_trouble(pods, pool.spec.model) if ready < want_replicas else None
    if trouble is not None:
        reason, detail = trouble
        message = f"{message}; {detail}"
    if phase != status.phase and status.phase is not None:
        plan.events.append(
            EventSpec(
                "Normal" if cond == "True" else "Warning",
                reason,
                f"{status.phase} -> {phase}: {message}",
            )
        )
    conditions = set_condition(conditions, ConditionType.READY, cond, reason, message, gen)
    desired: dict[str, Any] = {
        "observedGeneration": gen,
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector,
        "endpoint": endpoint,
        "conditions": _conditions_wire(conditions),
    }
    desired["replicaEndpoints"] = replica_endpoints(pods, pool.spec.port)
    ready_pods = sorted((p for p in pods if p.ready and p.ip and not p.deleting),
                        key=lambda p: p.name)  # fmt: skip
    desired["replicaWeights"] = [
        {"pod": p.name, "endpoint": f"http://{p.ip}:{pool.spec.port}",
         "weightVersion": (served or {}).get(p.name)}
        for p in ready_pods
    ]  # fmt: skip
    # Unknown (a ready replica did not answer) clears it: a merge patch with null deletes
    # the field, so status.weightVersion is never a stale number from before a replica
    # was replaced.
    desired["weightVersion"] = pool_weight_version(pods, served)
    plan.status_patch = status_diff(status.to_wire(), desired)
    return plan


# Restarts after which a replica that is not ready counts as crash-looping.
CRASH_LOOP_RESTARTS = 2


def replica_trouble(pods: list[PodView], model: str) -> tuple[str, str] | None:
    """Why replicas are not becoming ready, when a pod says so: ``(reason, message)``.

    An init step that cannot fetch the model names the model URI; a server that keeps
    exiting names the pod, its restart count and its last words.

    >>> p = PodView("r-1", {}, init_failure="fetch-model: cannot fetch model s3://b/x: 404")
    >>> replica_trouble([p], "s3://b/x")[0]
    'ModelUnavailable'
    """
    live = [p for p in pods if not p.deleting and not p.ready]
    for pod in live:
        if pod.init_failure:
            return Reason.MODEL_UNAVAILABLE, (
                f"model {model} is unavailable on replica {pod.name}: {pod.init_failure[-400:]}"
            )
    for pod in live:
        if pod.waiting_reason == "CrashLoopBackOff" or pod.restarts >= CRASH_LOOP_RESTARTS:
            last = f": {pod.last_message[-400:]}" if pod.last_message else ""
            return Reason.REPLICA_CRASH_LOOP, (
                f"replica {pod.name} is crash-looping ({pod.restarts} restart(s)){last}"
            )
    return None


def replica_endpoints(pods: list[PodView], port: int) -> list[str]:
    """``http://<pod IP>:<port>`` of each ready replica, sorted.

    >>> replica_endpoints([PodView("a", {}, ready=True, ip="10.0.0.2"),
    ...                    PodView("b", {}, ready=False, ip="10.0.0.3")], 8000)
    ['http://10.0.0.2:8000']
    """
    return sorted(f"http://{p.ip}:{port}" for p in pods if p.ready and p.ip and not p.deleting)


def pool_weight_version(pods: list[PodView], served: dict[str, int] | None = None) -> int | None:
    """The weights version every ready replica serves: the minimum over ready replicas.

    A replica's version is what its front door answered (``served``, pod name -> version),
    else a ``posttrain.io/weight-version`` annotation on its pod; until every ready replica's
    version is known, the pool's is unknown (None).

    >>> a = PodView("a", {}, {"posttrain.io/weight-version": "3"}, ready=True)
    >>> b = PodView("b", {}, {"posttrain.io/weight-version": "4"}, ready=True)
    >>> pool_weight_version([a, b])
    3
    """
    ready = [p for p in pods if p.ready and not p.deleting]
    served = served or {}
    versions = [str(served[p.name]) if p.name in served
                else p.annotations.get(ANNOTATION_WEIGHT_VERSION) for p in ready]  # fmt: skip
    if not ready or any(v is None or not v.isdigit() for v in versions):
        return None
    return min(int(v) for v in versions if v is not None)


def attempt_of(pod: PodView) -> int:
    """The attempt number a sandbox pod belongs to (0 when unlabelled)."""
    value = pod.labels.get(LABEL_ATTEMPT, "0")
    return int(value) if value.isdigit() else 0
