"""Admission through Kueue: a TrainingRun's gang as a Kueue ``Workload`` (pure functions).

Kueue admits *workloads*: a pod count and a pod template per pod set, checked against a
ClusterQueue's quota. Kueue ships integrations for Jobs, JobSets, RayJobs and others; a
custom kind takes part the way Kueue's docs call the external-framework pattern: its own
controller creates the Workload (owned by the object, so deletion cleans it up), keeps the
object's pods from existing until Kueue writes ``status.admission`` with condition
``Admitted=True``, starts them then, stops them again if Kueue evicts the Workload
(preemption, ``spec.active: false``), and marks the Workload ``Finished`` when the object
finishes, which gives the quota back. This module holds the manifests and the reading of
Kueue's answer; :mod:`.plan` decides, :mod:`.admission` executes.

A run opts in with the label ``kueue.x-k8s.io/queue-name: <LocalQueue>`` (as every Kueue
integration does) when Kueue's CRDs are installed; without the label, or without Kueue,
nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from posttrain.api import TrainingRun

KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"  # Kueue's storage version since v0.15
WORKLOAD_PLURAL = "workloads"
FLAVOR_PLURAL = "resourceflavors"
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
POD_SET_NAME = "trainer"  # one pod set: the whole gang (head and workers have one shape)


def queue_name(run: TrainingRun) -> str | None:
    """The LocalQueue a run asks Kueue for, from its ``kueue.x-k8s.io/queue-name`` label."""
    return run.metadata.labels.get(QUEUE_NAME_LABEL) or None


def workload_name(run: TrainingRun) -> str:
    """Deterministic, so creating it again after an operator restart adopts the same one.

    >>> from posttrain.api.base import ObjectMeta
    >>> workload_name(TrainingRun.model_construct(metadata=ObjectMeta(name="a", namespace="n")))
    'trainingrun-a'
    """
    return f"trainingrun-{run.metadata.name}"


def build_workload(
    run: TrainingRun, pod_template: dict[str, Any], labels: dict[str, str], owner: dict[str, Any]
) -> dict[str, Any]:
    """The Workload of ``run``: one pod set of ``spec.resources.nodes`` pods, gang-sized.

    ``pod_template`` is a trainer pod as the builders make it (its requests are what Kueue
    counts against quota); the controller passes rank 0's. ``minCount`` is left unset: a
    gang needs every pod, so Kueue must not admit it partially.
    """
    queue = queue_name(run)
    if queue is None:
        raise ValueError(f"TrainingRun {run.metadata.name} has no {QUEUE_NAME_LABEL} label")
    spec = pod_template["spec"]
    template = {
        "metadata": {"labels": dict(pod_template["metadata"].get("labels") or {})},
        "spec": {k: v for k, v in spec.items() if k in _TEMPLATE_FIELDS},
    }
    return {
        "apiVersion": KUEUE_API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(run),
            "namespace": run.metadata.namespace,
            "labels": {**labels, QUEUE_NAME_LABEL: queue},
            "ownerReferences": [owner],
        },
        "spec": {
            "queueName": queue,
            "podSets": [
                {"name": POD_SET_NAME, "count": run.spec.resources.nodes, "template": template}
            ],
        },
    }


# Pod spec fields Kueue reads for quota and flavor fit; the rest (env, volumes' contents)
# would only make the Workload large.
_TEMPLATE_FIELDS = (
    "containers",
    "initContainers",
    "nodeSelector",
    "tolerations",
    "affinity",
    "priorityClassName",
    "runtimeClassName",
    "overhead",
    "restartPolicy",
)


@dataclass(frozen=True)
class WorkloadView:
    """What the TrainingRun decisions need from a Workload Kueue manages."""

    name: str
    admitted: bool
    """status.conditions Admitted=True (quota reserved and every admission check passed)."""
    cluster_queue: str = ""
    evicted_reason: str = ""
    """Why Kueue took the admission back (Preempted, InactiveWorkload, ...), while it is."""
    evicted_message: str = ""
    pending_message: str = ""
    """Kueue's QuotaReserved=False message: why the workload waits (e.g. insufficient quota)."""
    finished: bool = False
    active: bool = True
    deleting: bool = False
    flavors: tuple[str, ...] = ()
    """ResourceFlavors Kueue assigned (status.admission.podSetAssignments[].flavors)."""


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def workload_view(body: dict[str, Any]) -> WorkloadView:
    """Reduce a Workload (as the apiserver returns it) to a WorkloadView.

    >>> workload_view({"metadata": {"name": "w"}, "status": {"admission": {"clusterQueue": "cq"},
    ...     "conditions": [{"type": "Admitted", "status": "True"}]}}).admitted
    True
    """
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    admitted = _condition(status, "Admitted").get("status") == "True" and bool(
        status.get("admission")
    )
    evicted = _condition(status, "Evicted")
    reserved = _condition(status, "QuotaReserved")
    return WorkloadView(
        name=meta.get("name", ""),
        admitted=admitted,
        cluster_queue=str((status.get("admission") or {}).get("clusterQueue") or ""),
        evicted_reason=str(evicted.get("reason") or "") if evicted.get("status") == "True" else "",
        evicted_message=str(evicted.get("message") or ""),
        pending_message=str(reserved.get("message") or "")
        if reserved.get("status") == "False"
        else "",
        finished=_condition(status, "Finished").get("status") == "True",
        flavors=tuple(
            sorted(
                {
                    str(f)
                    for a in (status.get("admission") or {}).get("podSetAssignments") or []
                    for f in (a.get("flavors") or {}).values()
                }
            )
        ),
        active=(body.get("spec") or {}).get("active", True) is not False,
        deleting=bool(meta.get("deletionTimestamp")),
    )


def finished_condition(
    phase: str, message: str, now: datetime, generation: int | None
) -> dict[str, Any]:
    """The ``Finished`` condition the owner of a Workload writes when its job ends; Kueue
    then releases the quota. Reason Succeeded or Failed, as Kueue's own integrations use."""
    return {
        "type": "Finished",
        "status": "True",
        "reason": "Succeeded" if phase == "Succeeded" else "Failed",
        "message": message[:1000] or f"TrainingRun {phase}",
        "lastTransitionTime": now.isoformat().replace("+00:00", "Z"),
        "observedGeneration": generation or 1,
    }
