"""SandboxWarmPool: pure builders (no apiserver calls; :mod:`.reconciler` executes).

A pool keeps ``spec.replicas`` *idle* sandbox pods: restricted exactly like a cold sandbox
pod, running the waiting entrypoint (:mod:`.entrypoint`) with no activeDeadlineSeconds. A
SandboxTask with ``spec.warmPoolRef`` claims one with a single merge patch carrying the
pod's resourceVersion as a precondition (the apiserver answers 409 to the loser of a race,
so no pod is ever claimed twice). The patch

- labels the pod with the task (``posttrain.io/task``, attempt 1): the pod leaves the pool's
  idle set and becomes the task's child in every cache and selector;
- replaces the pool's ownerReference with the task's, so GC follows the task, not the pool;
- writes the task (command, files, stdin) into the ``posttrain.io/claim`` annotation, which
  the entrypoint reads through a downward-API file and then ``exec``s;
- sets activeDeadlineSeconds to the pod's age + the task's timeout (the kubelet enforces it
  exactly as for a cold pod; Kubernetes allows adding it to a running pod).

The pool then sees one idle pod fewer and creates a replacement.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any

from posttrain.api import SandboxTask, SandboxWarmPool
from posttrain.api.env import WarmPoolEnv
from posttrain.api.labels import (
    ANNOTATION_CLAIM,
    ANNOTATION_SPEC_HASH,
    COMPONENT_SANDBOX,
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_SANDBOX_NETWORK,
    LABEL_TASK,
    LABEL_WARM_POOL,
)

from ..config import OperatorConfig
from ..shared.builders import (
    Manifest,
    child_metadata,
    owner_reference,
    resources,
    restricted_container_context,
    restricted_pod_context,
    spec_hash,
)
from ..shared.sandbox import SANDBOX_WORKDIR, check_file_name
from ..shared.views import PodView

CLAIM_DIR = "/sandbox/claim"
CLAIM_FILE = "task.json"
ENTRYPOINT_SOURCE = (Path(__file__).parent / "entrypoint.py").read_text()


def idle_selector(pool_name: str) -> str:
    """Label selector of a pool's idle pods (status.selector, for scale and HPA).

    >>> idle_selector("py")
    'posttrain.io/warm-pool=py,!posttrain.io/task'
    """
    return f"{LABEL_WARM_POOL}={pool_name},!{LABEL_TASK}"


def pod_template(
    image: str,
    cpu: str,
    memory: str,
    ephemeral_storage: str,
    network: str,
    runtime_class: str | None,
) -> dict[str, Any]:
    """The fields that decide whether a pooled pod can serve a task (compared on claim)."""
    return {
        "image": image,
        "cpu": cpu,
        "memory": memory,
        "ephemeralStorage": ephemeral_storage,
        "network": network,
        "runtimeClassName": runtime_class,
    }


def pool_template(owner: SandboxWarmPool | SandboxTask, config: OperatorConfig) -> dict[str, Any]:
    """The pod template a warm pool's pods have, or a SandboxTask wants: both specs carry
    the same isolation and size fields, so one function reads them and
    :func:`claim_mismatch` compares like with like."""
    spec = owner.spec
    return pod_template(
        spec.image or config.sandbox_image,
        spec.resources.cpu,
        spec.resources.memory,
        spec.resources.ephemeral_storage,
        spec.network,
        spec.runtime_class_name or config.sandbox_runtime_class_name,
    )


def template_hash(template: dict[str, Any]) -> str:
    """Short stable hash of a template (stored on each pooled pod; stale pods are replaced).

    >>> len(template_hash(pod_template("img", "1", "512Mi", "1Gi", "none", None)))
    16
    """
    return spec_hash(template)


def claim_mismatch(task: SandboxTask, pool: SandboxWarmPool, config: OperatorConfig) -> str:
    """Why ``task`` cannot run in one of ``pool``'s pods ("" when it can).

    A pooled pod is never weaker than what the task asked for: every isolation and size
    field must be equal, and features only the cold entrypoint has need a cold pod.
    """
    if task.spec.snapshot or task.spec.restore_from:
        return "spec.snapshot and spec.restoreFrom need a cold pod"
    if config.sandbox_artifacts_uri:
        # Log upload runs in the cold pod's entrypoint; a pooled pod would lose status.logsUri.
        return "the operator stores sandbox logs (sandbox_artifacts_uri), which needs a cold pod"
    want, have = pool_template(task, config), pool_template(pool, config)
    diffs = [f"{k} {want[k]!r} != {have[k]!r}" for k in want if want[k] != have[k]]
    return "; ".join(diffs)


def build_warm_pod(pool: SandboxWarmPool, config: OperatorConfig) -> Manifest:
    """One idle pod of ``pool`` (generateName: pooled pods are fungible)."""
    spec = pool.spec
    template = pool_template(pool, config)
    workdir_mount = {"name": "workdir", "mountPath": SANDBOX_WORKDIR}
    container = {
        "name": "sandbox",
        "image": template["image"],
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python3", "-c", ENTRYPOINT_SOURCE],
        "workingDir": SANDBOX_WORKDIR,
        "env": [
            {"name": "HOME", "value": SANDBOX_WORKDIR},
            {"name": "TMPDIR", "value": SANDBOX_WORKDIR},
            *WarmPoolEnv(workdir=SANDBOX_WORKDIR, claim_file=f"{CLAIM_DIR}/{CLAIM_FILE}").to_env(),
        ],
        "resources": resources(
            spec.resources.cpu,
            spec.resources.memory,
            ephemeral_storage=spec.resources.ephemeral_storage,
        ),
        # The cold sandbox pod's contexts: a pooled pod runs the same untrusted code.
        "securityContext": restricted_container_context(),
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            workdir_mount,
            {"name": "claim", "mountPath": CLAIM_DIR, "readOnly": True},
        ],
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 1,
        "securityContext": restricted_pod_context(),
        "containers": [container],
        "volumes": [
            {"name": "workdir", "emptyDir": {"sizeLimit": config.sandbox_workdir_size}},
            {
                "name": "claim",
                "downwardAPI": {
                    "items": [
                        {
                            "path": CLAIM_FILE,
                            "fieldRef": {
                                "fieldPath": f"metadata.annotations['{ANNOTATION_CLAIM}']"
                            },
                        }
                    ]
                },
            },
        ],
    }
    if template["runtimeClassName"]:
        pod_spec["runtimeClassName"] = template["runtimeClassName"]
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in config.image_pull_secrets]
    labels = {
        LABEL_COMPONENT: COMPONENT_SANDBOX,
        LABEL_WARM_POOL: pool.metadata.name,
        LABEL_SANDBOX_NETWORK: spec.network,
    }
    metadata = child_metadata(pool, "", labels, {ANNOTATION_SPEC_HASH: template_hash(template)})
    del metadata["name"]
    metadata["generateName"] = f"{pool.metadata.name}-"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def claim_payload(task: SandboxTask) -> str:
    """The task as the entrypoint reads it (files checked like a cold pod's).

    >>> t = SandboxTask.model_validate({"metadata": {"name": "t"},
    ...                                 "spec": {"command": ["python", "-c", "1"]}})
    >>> claim_payload(t)
    '{"task": "t", "command": ["python", "-c", "1"], "files": {}}'
    """
    for name in task.spec.files:
        check_file_name(name)
    payload: dict[str, Any] = {
        "task": task.metadata.name,
        "command": list(task.spec.command),
        "files": dict(task.spec.files),
    }
    if task.spec.stdin is not None:
        payload["stdin"] = task.spec.stdin
    return json.dumps(payload)


def pod_age_seconds(pod: Manifest, now: datetime) -> int:
    """Whole seconds since the pod started (activeDeadlineSeconds counts from startTime)."""
    started = (pod.get("status") or {}).get("startTime")
    if not started:
        return 0
    start = datetime.fromisoformat(str(started).replace("Z", "+00:00"))
    return max(0, math.ceil((now - start).total_seconds()))


def build_claim_patch(task: SandboxTask, pod: Manifest, now: datetime) -> Manifest:
    """The merge patch that hands ``pod`` to ``task`` (atomic through resourceVersion)."""
    meta = pod["metadata"]
    return {
        "metadata": {
            "resourceVersion": meta["resourceVersion"],
            "labels": {LABEL_TASK: task.metadata.name, LABEL_ATTEMPT: "1"},
            "annotations": {ANNOTATION_CLAIM: claim_payload(task)},
            "ownerReferences": [owner_reference(task)],
        },
        "spec": {"activeDeadlineSeconds": pod_age_seconds(pod, now) + task.spec.timeout_seconds},
    }


def is_idle(pod: PodView) -> bool:
    """Unclaimed, alive, not being deleted."""
    return LABEL_TASK not in pod.labels and not pod.deleting and not pod.finished


def is_claimable(pod: PodView, want_hash: str) -> bool:
    """Idle, running, ready and built from the pool's current template."""
    return (
        is_idle(pod)
        and pod.phase == "Running"
        and pod.ready
        and pod.annotations.get(ANNOTATION_SPEC_HASH) == want_hash
    )
