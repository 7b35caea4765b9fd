"""One gang planner for both shapes of a TrainingRun's gang.

A gang is either plain trainer pods ``<run>-g<incarnation>-<rank>`` or one KubeRay
RayCluster ``<run>-g<incarnation>`` (whose pods carry our labels). Both reduce to a
:class:`GangState` (:func:`pod_gang`, :func:`ray_cluster_gang`), and :func:`plan_gang`
decides on it once: any failure restarts the whole gang as the next incarnation, counting
one restart, until more than ``spec.backoffLimit`` fail the run; the head (rank 0)
succeeding is the trainer finishing; otherwise the gang is created or waited for.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from posttrain.api import TrainingRun, TrainingRunStatus
from posttrain.api.labels import LABEL_GANG, LABEL_RANK
from posttrain.api.reasons import ConditionType, Reason

from ..shared.views import EventSpec, PodView, iso_time
from .decision import ConditionChange, Decision, pods_to_delete_at_the_end, run_failed
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


@dataclass(frozen=True)
class GangState:
    """What the gang planner needs to know about the gang of ``incarnation``, whatever it
    runs as. Names are what to delete; the texts are what status and events say."""

    incarnation: int
    failures: tuple[str, ...]
    """``<pod> (<reason>)`` per failed member (and the RayCluster's own failure first)."""
    head_succeeded: bool
    members: tuple[str, ...]
    """Pods of this incarnation (all deleted on a restart)."""
    unfinished: tuple[str, ...]
    """Members still running (deleted when the trainer finished)."""
    stale_pods: tuple[str, ...]
    """Live pods of other incarnations (always deleted)."""
    missing_ranks: tuple[int, ...] = ()
    create_cluster: bool = False
    cluster: str | None = None
    """The RayCluster of this incarnation (KubeRay path), deleted when the gang ends."""
    stale_clusters: tuple[str, ...] = ()
    mirror: tuple[tuple[str, Any], ...] = ()
    """Status fields mirroring the RayCluster (rayCluster, rayClusterState, availableWorkers)."""
    restart_mirror: tuple[tuple[str, Any], ...] = ()
    recreate: str = ""
    """How a restart is told: ``<failures><recreate> (restart n of limit)``."""
    running: str | None = None
    """The Running message once the gang runs; None while it does not."""
    running_event: str = ""
    """What the event says when the gang starts running (the Running message if empty)."""
    waiting: tuple[str, str] = ("", "")
    """(reason, message) of Ready=False while it does not run."""
    starting: EventSpec | None = None
    """Posted when a gang starts from nothing (new run, resume) and is not running yet."""


def _exit_text(pod: PodView) -> str:
    return f"exit {pod.terminated.exit_code}" if pod.terminated else "failed"


def _failure(pod: PodView) -> str:
    return f"{pod.name} ({pod.reason or _exit_text(pod)})"


def pod_gang(run: TrainingRun, live: tuple[PodView, ...], incarnation: int) -> GangState:
    """A gang of plain pods, one per rank (``posttrain.io/gang`` and ``/rank`` labels).

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> pod_gang(run, (PodView("r-g0-0", {LABEL_GANG: "0", LABEL_RANK: "0"}),), 0).missing_ranks
    ()
    """
    nodes = run.spec.resources.nodes
    gang = {
        p.labels.get(LABEL_RANK): p for p in live if p.labels.get(LABEL_GANG) == str(incarnation)
    }
    members = list(gang.values())
    head = gang.get("0")
    running = not (missing := [r for r in range(nodes) if str(r) not in gang]) and all(
        p.phase == "Running" for p in members
    )
    pending = nodes - sum(p.phase == "Running" for p in members)
    return GangState(
        incarnation=incarnation,
        failures=tuple(_failure(p) for p in members if p.phase == "Failed"),
        head_succeeded=head is not None and head.phase == "Succeeded",
        members=tuple(p.name for p in members),
        unfinished=tuple(pods_to_delete_at_the_end(members)),
        stale_pods=tuple(p.name for p in live if p.labels.get(LABEL_GANG) != str(incarnation)),
        missing_ranks=tuple(missing),
        recreate=f" failed: recreating all {nodes} pod(s) as gang {incarnation + 1}",
        running=f"{nodes} trainer pod(s) running" if running else None,
        running_event=f"all {nodes} trainer pod(s) running",
        waiting=(Reason.PODS_PENDING, f"waiting for {pending}/{nodes} pod(s)"),
        starting=EventSpec(
            "Normal", Reason.PODS_CREATED, f"creating gang {incarnation} of {nodes} pod(s)"
        ),
    )


def ray_cluster_gang(
    run: TrainingRun,
    live: tuple[PodView, ...],
    clusters: tuple[RayClusterView, ...],
    incarnation: int,
) -> GangState:
    """A gang that is one RayCluster: its pods are KubeRay's (they carry our labels from the
    templates), so a failed one fails the gang at once, before KubeRay replaces it; the
    cluster's ``failed`` state fails it too. ``status.rayCluster``, ``rayClusterState`` and
    ``availableWorkers`` mirror the cluster so ``kubectl get tr`` shows what KubeRay does."""
    workers = run.spec.resources.nodes - 1
    name = ray_cluster_name(run.metadata.name, incarnation)
    current = next((c for c in clusters if c.name == name), None)
    gang = [p for p in live if p.labels.get(LABEL_GANG) == str(incarnation)]
    head = next((p for p in gang if p.labels.get(LABEL_RANK) == "0"), None)
    failures = [_failure(p) for p in gang if p.phase == "Failed"]
    if current is not None and current.failed:
        failures.insert(0, f"RayCluster {name} failed ({current.reason or 'no reason given'})")
    mirror: dict[str, Any] = {"rayCluster": name}
    if current is not None:
        mirror["rayClusterState"] = current.state
    mirror["availableWorkers"] = current.available_workers if current else 0
    new_name = ray_cluster_name(run.metadata.name, incarnation + 1)
    if current is None:
        waiting = f"waiting for RayCluster {name}"
    else:
        waiting = (
            f"waiting for RayCluster {name} (state {current.state or 'not reported yet'}, "
            f"{current.available_workers}/{workers} worker(s) available)"
        )
    ready = current is not None and current.state == "ready"
    return GangState(
        incarnation=incarnation,
        failures=tuple(failures),
        head_succeeded=head is not None and head.phase == "Succeeded",
        members=tuple(p.name for p in gang),
        unfinished=tuple(pods_to_delete_at_the_end(gang)),
        stale_pods=tuple(p.name for p in live if p.labels.get(LABEL_GANG) != str(incarnation)),
        create_cluster=current is None,
        cluster=name,
        stale_clusters=tuple(c.name for c in clusters if c.name != name),
        mirror=tuple(mirror.items()),
        restart_mirror=(("rayCluster", new_name), ("availableWorkers", 0)),
        recreate=f": recreating the RayCluster as {new_name}",
        running=(
            f"RayCluster {name} ready: {current.available_workers}/{workers} worker(s) available"
            if ready and current is not None
            else None
        ),
        waiting=(Reason.RAY_CLUSTER_PENDING, waiting),
        starting=(
            EventSpec(
                "Normal",
                Reason.RAY_CLUSTER_CREATED,
                f"creating RayCluster {name}: a head and {workers} worker(s)",
            )
            if current is None
            else None
        ),
    )


def backoff_exceeded(restarts: int, limit: int, why: str) -> str:
    """
    >>> backoff_exceeded(3, 2, "r-g2-0 (Error)")
    'gang failed 3 times, more than backoffLimit=2; last failure: r-g2-0 (Error)'
    """
    return f"gang failed {restarts} times, more than backoffLimit={limit}; last failure: {why}"


def plan_gang(
    run: TrainingRun,
    gang: GangState,
    live: tuple[PodView, ...],
    clusters: tuple[str, ...],
    now: datetime,
) -> Decision:
    """Decide on the gang: restart it, fail the run, finish the run, or create and wait.
    ``live`` and ``clusters`` are every live pod and RayCluster of the run (what failing it
    deletes)."""
    ends = (*gang.stale_clusters, gang.cluster) if gang.cluster is not None else ()
    if gang.failures:
        return _restart(run, gang, live, clusters, now, ends)
    if gang.head_succeeded:
        return _trainer_succeeded(
            run.status, now, gang.mirror, (*gang.stale_pods, *gang.unfinished), ends
        )
    return _progress(run.status, gang)


def _restart(
    run: TrainingRun,
    gang: GangState,
    live: tuple[PodView, ...],
    clusters: tuple[str, ...],
    now: datetime,
    ends: tuple[str, ...],
) -> Decision:
    """A member failed: the next incarnation replaces the whole gang, or the run fails once
    more than backoffLimit restarts were needed."""
    spec = run.spec
    restarts = run.status.restarts + 1
    why = ", ".join(gang.failures)
    if restarts > spec.backoff_limit:
        return run_failed(
            Reason.BACKOFF_LIMIT_EXCEEDED,
            backoff_exceeded(restarts, spec.backoff_limit, why),
            now,
            live,
            clusters,
            fields=(*gang.mirror, ("restarts", restarts)),
        )
    message = f"restart {restarts}/{spec.backoff_limit} after {why}"
    return Decision(
        conditions=(ConditionChange(ConditionType.READY, "False", Reason.GANG_RESTART, message),),
        events=(
            EventSpec(
                "Warning",
                Reason.GANG_RESTART,
                f"{why}{gang.recreate} (restart {restarts} of {spec.backoff_limit})",
            ),
        ),
        fields=(
            *gang.restart_mirror,
            ("restarts", restarts),
            ("phase", "Pending"),
            ("message", message),
        ),
        incarnation=gang.incarnation + 1,
        delete_pods=(*gang.stale_pods, *gang.members),
        delete_ray_clusters=ends,
        create_ranks=() if gang.cluster is not None else tuple(range(spec.resources.nodes)),
        create_ray_cluster=gang.cluster is not None,
        ensure_children=True,
    )


def _trainer_succeeded(
    status: TrainingRunStatus,
    now: datetime,
    mirror: tuple[tuple[str, Any], ...],
    delete_pods: tuple[str, ...],
    delete_ray_clusters: tuple[str, ...],
) -> Decision:
    """The head pod (rank 0) succeeded: the run is Succeeded, for pod gangs and RayClusters."""
    message = (
        f"trainer finished at step {status.step}" if status.step is not None else "trainer finished"
    )
    return Decision(
        conditions=(
            ConditionChange(ConditionType.SUCCEEDED, "True", Reason.TRAINER_SUCCEEDED, message),
            ConditionChange(ConditionType.READY, "False", Reason.TRAINER_SUCCEEDED, message),
        ),
        events=(EventSpec("Normal", Reason.TRAINER_SUCCEEDED, message),),
        fields=(
            *mirror,
            ("phase", "Succeeded"),
            ("message", message),
            ("completionTime", iso_time(now)),
        ),
        delete_pods=delete_pods,
        delete_ray_clusters=delete_ray_clusters,
    )


def _progress(status: TrainingRunStatus, gang: GangState) -> Decision:
    """Nothing failed or finished: create what is missing, then Running once it all runs."""
    if gang.running is not None:
        said = gang.running_event or gang.running
        events = () if status.phase == "Running" else (EventSpec("Normal", Reason.RUNNING, said),)
        phase, ready = (
            "Running",
            ConditionChange(ConditionType.READY, "True", Reason.RUNNING, gang.running),
        )
    else:
        starting = status.phase in (None, "Suspended") and gang.starting is not None
        events = (gang.starting,) if starting and gang.starting is not None else ()
        reason, message = gang.waiting
        phase, ready = "Pending", ConditionChange(ConditionType.READY, "False", reason, message)
    creates = bool(gang.missing_ranks) or gang.create_cluster
    return Decision(
        conditions=(ready,),
        events=events,
        fields=(*gang.mirror, ("phase", phase), ("message", ready.message)),
        delete_pods=gang.stale_pods,
        delete_ray_clusters=gang.stale_clusters,
        create_ranks=gang.missing_ranks,
        create_ray_cluster=gang.create_cluster,
        ensure_children=creates,
    )
