"""Helpers every builder of child objects shares: ownership and metadata, resources,
placement, the sandbox runtime, and the error a builder raises on a spec it cannot build.

Below :mod:`.builders` and the per-run builders beside it (:mod:`.evaluator`,
:mod:`.sandbox_runner`, :mod:`.warmpool`), so each imports these without importing the
others (as KubeRay's ``common/`` sits below its controllers).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from posttrain.api import RolloutPool, SandboxTask, SandboxWarmPool, TrainingRun
from posttrain.api.labels import MANAGED_BY

from .config import OperatorConfig

Manifest = dict[str, Any]


class BuildError(ValueError):
    """The spec cannot be turned into a valid child object; the message says what to fix."""


def owner_reference(
    owner: TrainingRun | RolloutPool | SandboxTask | SandboxWarmPool,
) -> dict[str, Any]:
    """The controller ownerReference pointing at ``owner`` (GC deletes children with it).

    blockOwnerDeletion lets foreground deletion wait for the children; it needs the
    ``<plural>/finalizers`` update permission that rbac.OPERATOR_RULES grants.
    """
    if not owner.metadata.uid:
        raise BuildError(
            f"{owner.kind} {owner.metadata.name} has no uid; build children from "
            "the object read back from the apiserver"
        )
    return {
        "apiVersion": owner.api_version,
        "kind": owner.kind,
        "name": owner.metadata.name,
        "uid": owner.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    owner: TrainingRun | RolloutPool | SandboxTask | SandboxWarmPool,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.metadata.namespace,
        "labels": {**MANAGED_BY, **labels},
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def spec_hash(obj: Any) -> str:
    """A short stable digest of a JSON-able object (detects template drift without diffing).

    >>> spec_hash({"a": 1}) == spec_hash({"a": 1}) != spec_hash({"a": 2})
    True
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def resources(
    cpu: str, memory: str, gpus: int = 0, ephemeral_storage: str | None = None
) -> dict[str, Any]:
    """requests = limits (Guaranteed QoS); GPUs and ephemeral-storage only when asked for.

    >>> resources("1", "1Gi", gpus=2)["limits"]["nvidia.com/gpu"]
    '2'
    """
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if ephemeral_storage:
        limits["ephemeral-storage"] = ephemeral_storage
    if gpus > 0:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def schedule(
    pod_spec: dict[str, Any],
    config: OperatorConfig,
    default_selector: dict[str, str],
    selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    affinity: dict[str, Any],
) -> None:
    """Placement from the operator's defaults, the resource's nodeSelector winning per key."""
    merged = {**default_selector, **selector}
    if merged:
        pod_spec["nodeSelector"] = merged
    if tolerations:
        pod_spec["tolerations"] = [dict(t) for t in tolerations]
    if affinity:
        pod_spec["affinity"] = dict(affinity)
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in config.image_pull_secrets]


def apply_sandbox_runtime(
    pod_spec: Manifest, runtime_class_name: str | None, config: OperatorConfig
) -> None:
    """The runtime every pod running untrusted code gets (SandboxTask pods, sandbox runners):
    the resource's runtimeClassName, else the operator's default, and the image pull secrets."""
    runtime_class = runtime_class_name or config.sandbox_runtime_class_name
    if runtime_class:
        pod_spec["runtimeClassName"] = runtime_class
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in config.image_pull_secrets]
