"""Helpers every builder of child objects shares: ownership and metadata, resources,
placement, the sandbox runtime, restricted security contexts, model and storage env, and the
error a builder raises on a spec it cannot build.

Below every kind's builders (as KubeRay's ``common/`` sits below its controllers), so each
imports these without importing another kind's. Nothing here talks to the apiserver: names
are deterministic so a restarted operator adopts what it already created.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from posttrain.api import RolloutPool, SandboxTask, SandboxWarmPool, TrainingRun
from posttrain.api.env import S3_CREDENTIAL_KEYS, S3_ENDPOINT, S3_SECURE
from posttrain.api.labels import MANAGED_BY
from posttrain.api.modelref import PVC_MODEL_VOLUME, HfTokenSecret, is_hf_ref, parse_pvc_ref

from ..config import OperatorConfig

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


NOBODY_UID = 65534
# The posttrain user of the operator, trainer and rollout images (``useradd --uid 10001`` in
# their Dockerfiles; its home is /home/posttrain): rollout replicas, trainer pods and the
# evaluator run as it.
POSTTRAIN_UID = 10001
POSTTRAIN_HOME = "/home/posttrain"


def mount_model_claim(model: str, pod_spec: Manifest, containers: Sequence[Manifest]) -> None:
    """``model`` = ``pvc://CLAIM/PATH``: the claim, read-only, at ``/mnt/pvc/CLAIM`` in each of
    ``containers`` (those that resolve the model; ``posttrain.models`` reads it there).
    Read-only because every replica and every run may share one claim of base models.

    >>> spec = {"containers": [{"name": "c"}]}
    >>> mount_model_claim("pvc://models/smollm2", spec, spec["containers"])
    >>> spec["volumes"], spec["containers"][0]["volumeMounts"]
    ([{'name': 'model-pvc', 'persistentVolumeClaim': {'claimName': 'models', 'readOnly': True}}], [{'name': 'model-pvc', 'mountPath': '/mnt/pvc/models', 'readOnly': True}])
    """
    try:
        ref = parse_pvc_ref(model)
    except ValueError as exc:
        raise BuildError(str(exc)) from exc
    if ref is None:
        return
    pod_spec.setdefault("volumes", []).append(
        {
            "name": PVC_MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": ref.claim, "readOnly": True},
        }
    )
    for container in containers:
        container.setdefault("volumeMounts", []).append(
            {"name": PVC_MODEL_VOLUME, "mountPath": ref.mount_path, "readOnly": True}
        )


# The Hugging Face cache of the trainer pods and the evaluator: on their writable /workspace
# emptyDir (the trainer image's own HF_HOME, made explicit for any image).
WORKSPACE_HF_HOME = "/workspace/.cache/huggingface"


def hf_model_env(model: str, hf_home: str, token: HfTokenSecret | None) -> list[Manifest]:
    """``model`` = ``hf://ORG/NAME[@REVISION]``: what a container that downloads it needs.
    The Hub on (``HF_HUB_OFFLINE=0``; posttrain keeps it off otherwise, and the pod's cache
    starts empty, so naming an hf:// model is the opt-in), the Hugging Face cache
    (``HF_HOME``) on a writable volume, and the spec's token Secret as ``HF_TOKEN`` (a
    secretKeyRef, never a literal). Nothing for any other model.

    >>> [e["name"] for e in hf_model_env("s3://b/m", "/x", None)]
    []
    >>> hf_model_env("hf://org/m", "/models/huggingface", HfTokenSecret(name="hf"))
    [{'name': 'HF_HOME', 'value': '/models/huggingface'}, {'name': 'HF_HUB_OFFLINE', 'value': '0'}, {'name': 'HF_TOKEN', 'valueFrom': {'secretKeyRef': {'name': 'hf', 'key': 'HF_TOKEN'}}}]
    """
    if not is_hf_ref(model):
        return []
    env: list[Manifest] = [
        {"name": "HF_HOME", "value": hf_home},
        {"name": "HF_HUB_OFFLINE", "value": "0"},
    ]
    if token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    return env


def s3_env(config: OperatorConfig) -> list[dict[str, Any]]:
    """S3 endpoint as plain env, credentials only through secretKeyRef (never literal)."""
    env: list[dict[str, Any]] = [
        {"name": S3_ENDPOINT, "value": config.s3_endpoint},
        {"name": S3_SECURE, "value": "true" if config.s3_secure else "false"},
    ]
    for key in S3_CREDENTIAL_KEYS:
        env.append(
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": config.s3_credentials_secret, "key": key}},
            }
        )
    return env


METRICS_PORT_NAME = "metrics"  # the trainer's /metrics port (a PodMonitor selects it by name)


def scrape_annotations(port: int) -> dict[str, str]:
    """The prometheus.io/* annotations annotation-based scrapers (and many Helm-installed
    Prometheus setups) use; the chart's PodMonitors select the named port instead.

    >>> scrape_annotations(9090)["prometheus.io/port"]
    '9090'
    """
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def otlp_env(
    config: OperatorConfig, service: str, owner: TrainingRun | RolloutPool
) -> list[dict[str, str]]:
    """OTEL_* variables that send a child's spans where the operator's go (none when the
    operator has no OTLP endpoint configured).

    >>> otlp_env(OperatorConfig(), "posttrain-trainer", None)  # type: ignore[arg-type]
    []
    """
    if not config.otlp_endpoint:
        return []
    attributes = (
        f"k8s.namespace.name={owner.metadata.namespace},"
        f"posttrain.{owner.kind.lower()}={owner.metadata.name}"
    )
    return [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": config.otlp_endpoint},
        {"name": "OTEL_SERVICE_NAME", "value": service},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]


def selector_string(labels: dict[str, str]) -> str:
    """The label selector in string form (the scale subresource's labelSelectorPath wants it).

    >>> selector_string({"b": "2", "a": "1"})
    'a=1,b=2'
    """
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def restricted_container_context(uid: int = NOBODY_UID, read_only_root: bool = True) -> Manifest:
    """The container securityContext of every pod that runs untrusted code (cold sandbox
    pods, their init container, warm-pool pods; as nobody), of rollout replicas and of trainer
    and evaluator pods (as :data:`POSTTRAIN_UID`): Pod Security "restricted", and for all but
    the trainer's pods then some (a read-only root; torchrun, Ray and Hugging Face write in
    too many places of the trainer image for one yet: docs/security.md).

    >>> restricted_container_context(POSTTRAIN_UID)["runAsUser"]
    10001
    >>> "readOnlyRootFilesystem" in restricted_container_context(POSTTRAIN_UID, False)
    False
    """
    context: Manifest = {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if not read_only_root:
        del context["readOnlyRootFilesystem"]
    return context


def restricted_pod_context(uid: int = NOBODY_UID) -> Manifest:
    """The pod securityContext that goes with :func:`restricted_container_context`."""
    return {
        "runAsNonRoot": True,
        "runAsUser": uid,
        "runAsGroup": uid,
        "fsGroup": uid,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


# A trainer or evaluator pod's own /tmp and $HOME (emptyDirs, see run_as_posttrain_user).
TMP_VOLUME = "tmp"
HOME_VOLUME = "home"


def run_as_posttrain_user(pod_spec: Manifest) -> None:
    """Pod Security "restricted" for a trainer or evaluator pod: every container runs as
    :data:`POSTTRAIN_UID` (the trainer image's own ``USER``, so nothing the image holds
    changes owner), with no capability, no privilege escalation and RuntimeDefault seccomp.
    The root file system stays writable (not required by "restricted"; a known gap).

    What they write goes to volumes the uid owns (emptyDirs are given to ``fsGroup``): the
    workspace (the run's ``--out``, ``HF_HOME``), ``/dev/shm`` (Gloo/NCCL, Ray's object
    store), and two added here: ``/tmp`` (Python's tempfile: checkpoint staging before upload;
    Ray's ``/tmp/ray`` session, torchelastic's run directories) and ``HOME=/home/posttrain`` (the converted packaged model
    under ``~/.cache/posttrain``, torch inductor's and Triton's caches). Both are the pod's
    own, whatever image ``spec.resources.image`` names and on any node, so a ``/tmp/ray``
    another user left on a shared host, or a HOME the uid cannot write, cannot stop a run.
    """
    pod_spec["securityContext"] = restricted_pod_context(POSTTRAIN_UID)
    pod_spec.setdefault("volumes", []).extend(
        [{"name": TMP_VOLUME, "emptyDir": {}}, {"name": HOME_VOLUME, "emptyDir": {}}]
    )
    for container in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        container["securityContext"] = restricted_container_context(
            POSTTRAIN_UID, read_only_root=False
        )
        container["env"] = [*container.get("env", []), {"name": "HOME", "value": POSTTRAIN_HOME}]
        container.setdefault("volumeMounts", []).extend([
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
            {"name": HOME_VOLUME, "mountPath": POSTTRAIN_HOME},
        ])  # fmt: skip
