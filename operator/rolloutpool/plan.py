"""The RolloutPool decision: ``(pool, observed Deployment and pods) -> PoolPlan`` (replica
counts, endpoints, the weight version served, Ready and its reason). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.api import RolloutPool
from posttrain.api.base import ConditionStatus, set_condition
from posttrain.api.labels import ANNOTATION_SPEC_HASH, ANNOTATION_WEIGHT_VERSION
from posttrain.api.reasons import ConditionType, Reason

from ..shared.views import EventSpec, PodView, conditions_wire, status_diff


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

    gen = pool.metadata.generation
    status = pool.status
    want_replicas = pool.spec.replicas
    plan = _converge_deployment(desired_deployment, deployment, want_replicas)
    dstatus = (deployment or {}).get("status") or {}
    replicas = int(dstatus.get("replicas") or 0)
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    rolling = deployment is not None and updated < replicas
    phase, cond, reason = _readiness(want_replicas, replicas, ready, updated, rolling)
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
    conditions = set_condition(
        list(status.conditions), ConditionType.READY, cond, reason, message, gen
    )
    desired: dict[str, Any] = {
        "observedGeneration": gen,
        "phase": phase,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector,
        "endpoint": endpoint,
        "conditions": conditions_wire(conditions),
        **_replica_fields(pods, pool.spec.port, served),
    }
    plan.status_patch = status_diff(status.to_wire(), desired)
    return plan


def _converge_deployment(
    desired_deployment: dict[str, Any], deployment: dict[str, Any] | None, want_replicas: int
) -> PoolPlan:
    """Create the Deployment, or patch it when its template's spec hash or its replicas
    differ from the desired ones."""
    plan = PoolPlan()
    if deployment is None:
        plan.create_deployment = True
        plan.events.append(
            EventSpec(
                "Normal",
                Reason.DEPLOYMENT_CREATED,
                f"created Deployment with {want_replicas} replica(s)",
            )
        )
        return plan
    have_hash = ((deployment.get("metadata") or {}).get("annotations") or {}).get(
        ANNOTATION_SPEC_HASH
    )
    want_hash = desired_deployment["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    have_replicas = (deployment.get("spec") or {}).get("replicas")
    if have_hash != want_hash:
        plan.patch_deployment = {
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
    elif have_replicas != want_replicas:
        plan.patch_deployment = {"spec": {"replicas": want_replicas}}
        plan.events.append(
            EventSpec(
                "Normal",
                Reason.DEPLOYMENT_UPDATED,
                f"scaled from {have_replicas} to {want_replicas} replica(s)",
            )
        )
    return plan


def _readiness(
    want: int, replicas: int, ready: int, updated: int, rolling: bool
) -> tuple[str, ConditionStatus, str]:
    """(phase, Ready status, reason) from the Deployment's replica counts.

    >>> _readiness(2, 2, 1, 1, rolling=True)
    ('Updating', 'True', 'RollingUpdate')
    """
    if want == 0:
        return "Ready", "True", Reason.SCALED_TO_ZERO
    if ready >= want and updated >= want and replicas == want:
        return "Ready", "True", Reason.REPLICAS_READY
    if rolling:
        return "Updating", "True" if ready > 0 else "False", Reason.ROLLING_UPDATE
    if ready > 0:
        return "Degraded", "True", Reason.REPLICAS_UNAVAILABLE
    return "Pending", "False", Reason.REPLICAS_UNAVAILABLE


def _replica_fields(
    pods: list[PodView], port: int, served: dict[str, int] | None
) -> dict[str, Any]:
    """replicaEndpoints, replicaWeights and weightVersion from the ready replicas."""
    ready_pods = sorted((p for p in pods if p.ready and p.ip and not p.deleting),
                        key=lambda p: p.name)  # fmt: skip
    weights = [
        {"pod": p.name, "endpoint": f"http://{p.ip}:{port}",
         "weightVersion": (served or {}).get(p.name)}
        for p in ready_pods
    ]  # fmt: skip
    return {
        "replicaEndpoints": replica_endpoints(pods, port),
        "replicaWeights": weights,
        # Unknown (a ready replica did not answer) clears it: a merge patch with null deletes
        # the field, so status.weightVersion is never a stale number from before a replica
        # was replaced.
        "weightVersion": pool_weight_version(pods, served),
    }


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
