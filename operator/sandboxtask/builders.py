"""Pure builders of a SandboxTask's children: one restricted pod per attempt
(``<task>-<attempt>``) and the object keys of its stored artifacts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.api import SandboxTask, SandboxTaskSpec
from posttrain.api.env import SandboxTaskEnv
from posttrain.api.labels import (
    ANNOTATION_FILE_PREFIX,
    ANNOTATION_LOGS_URI,
    ANNOTATION_SNAPSHOT_URI,
    COMPONENT_SANDBOX,
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_SANDBOX_NETWORK,
    LABEL_TASK,
)

from ..config import OperatorConfig
from ..shared.builders import (
    Manifest,
    apply_sandbox_runtime,
    child_metadata,
    resources,
    restricted_container_context,
    restricted_pod_context,
)
from ..shared.sandbox import (
    SANDBOX_ENTRYPOINT_KEY,
    SANDBOX_WORKDIR,
    check_file_name,
    sandbox_entrypoint_config_map_name,
)

SANDBOX_FILES_DIR = "/sandbox/files"
SANDBOX_STDIN_FILE = ".stdin"
SANDBOX_ENTRYPOINT_DIR = "/sandbox/entrypoint"


def sandbox_pod_name(task_name: str, attempt: int) -> str:
    """``<task>-<attempt>``, attempts counted from 1.

    >>> sandbox_pod_name("t", 2)
    't-2'
    """
    return f"{task_name}-{attempt}"


@dataclass(frozen=True)
class SandboxArtifacts:
    """Where one sandbox attempt stores its artifacts: s3:// URIs for the status and the
    presigned URLs (one object each, short-lived) the pod's entrypoint uses instead of
    credentials."""

    logs_uri: str
    logs_url: str
    snapshot_uri: str | None = None
    snapshot_url: str | None = None
    restore_url: str | None = None


def sandbox_artifact_key(prefix: str, task: SandboxTask, attempt: int, name: str) -> str:
    """Object key of one attempt's artifact: ``<prefix>/<ns>/<task>/<attempt>/<name>``.

    The namespace comes first, so restoreFrom can be limited to the task's own namespace.

    >>> t = SandboxTask.model_validate({"metadata": {"name": "t", "namespace": "ns"},
    ...                                 "spec": {"command": ["true"]}})
    >>> sandbox_artifact_key("sandboxes", t, 2, "logs.txt")
    'sandboxes/ns/t/2/logs.txt'
    """
    parts = [prefix.strip("/"), task.metadata.namespace, task.metadata.name, str(attempt), name]
    return "/".join(p for p in parts if p)


def _store_artifacts(
    contract: SandboxTaskEnv,
    task: SandboxTask,
    annotations: dict[str, str],
    artifacts: SandboxArtifacts,
) -> SandboxTaskEnv:
    """Hand the entrypoint the presigned URLs (the contract) and record their URIs."""
    annotations[ANNOTATION_LOGS_URI] = artifacts.logs_uri
    snapshot_url = None
    if artifacts.snapshot_url and artifacts.snapshot_uri:
        annotations[ANNOTATION_SNAPSHOT_URI] = artifacts.snapshot_uri
        snapshot_url = artifacts.snapshot_url
    return contract.model_copy(
        update={
            "workdir": SANDBOX_WORKDIR,
            "timeout_seconds": task.spec.timeout_seconds,
            "logs_url": artifacts.logs_url,
            "snapshot_url": snapshot_url,
            "restore_url": artifacts.restore_url or None,
        }
    )


def build_sandbox_pod(
    task: SandboxTask,
    config: OperatorConfig,
    attempt: int,
    artifacts: SandboxArtifacts | None = None,
) -> Manifest:
    """An isolated, Guaranteed-QoS pod for one attempt of ``task``.

    Files travel in pod annotations and reach the program through a downward-API volume
    copied into the writable workdir by an init container: no ConfigMap per task, so a
    burst of tasks costs one create per task. The program ends by writing a JSON result
    {"exit_code", "reward", "duration_ms", "reason"} to /dev/termination-log; without one
    the operator scores by exit code.

    With ``artifacts`` the program runs under the stdlib-only entrypoint
    (sandboxes/task_entrypoint.py, mounted from a shared ConfigMap) that restores, keeps the
    log, snapshots and uploads through presigned URLs: the pod holds no S3 credentials.
    """
    spec = task.spec
    name = task.metadata.name
    files, annotations, items = _files_in_annotations(spec)
    command = _sandbox_command(spec)
    contract = SandboxTaskEnv(task=name, attempt=attempt)
    if artifacts is not None:
        # The program runs under the entrypoint, which reads the URLs from the contract.
        contract = _store_artifacts(contract, task, annotations, artifacts)
        command = ["python3", f"{SANDBOX_ENTRYPOINT_DIR}/{SANDBOX_ENTRYPOINT_KEY}", "--", *command]
    restricted = restricted_container_context()
    res = spec.resources
    container: dict[str, Any] = {
        "name": "sandbox",
        "image": spec.image or config.sandbox_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": command,
        "workingDir": SANDBOX_WORKDIR,
        "env": [
            {"name": "HOME", "value": SANDBOX_WORKDIR},
            {"name": "TMPDIR", "value": SANDBOX_WORKDIR},
            *contract.to_env(),
        ],
        "resources": resources(res.cpu, res.memory, ephemeral_storage=res.ephemeral_storage),
        "securityContext": restricted,
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [_workdir_mount()],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "workdir", "emptyDir": {"sizeLimit": config.sandbox_workdir_size}}
    ]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "activeDeadlineSeconds": spec.timeout_seconds,
        "terminationGracePeriodSeconds": 1,
        "securityContext": restricted_pod_context(),
        "containers": [container],
        "volumes": volumes,
    }
    if items:
        pod_spec["initContainers"] = [_files_init_container(config, files, restricted)]
        volumes.append({"name": "files", "downwardAPI": {"items": items}})
    if artifacts is not None:
        _mount_entrypoint(pod_spec, spec.timeout_seconds + config.sandbox_upload_grace_seconds)
    apply_sandbox_runtime(pod_spec, spec.runtime_class_name, config)
    labels = {
        LABEL_COMPONENT: COMPONENT_SANDBOX,
        LABEL_TASK: name,
        LABEL_ATTEMPT: str(attempt),
        LABEL_SANDBOX_NETWORK: "egress" if spec.network == "egress" else "none",
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(task, sandbox_pod_name(name, attempt), labels, annotations),
        "spec": pod_spec,
    }


def _mount_entrypoint(pod_spec: dict[str, Any], deadline: int) -> None:
    """Mount the shared entrypoint ConfigMap. The program keeps its full timeoutSeconds (the
    entrypoint enforces it); the pod's ``deadline`` leaves the entrypoint time to upload
    after a timeout."""
    pod_spec["containers"][0]["volumeMounts"].append(
        {"name": "entrypoint", "mountPath": SANDBOX_ENTRYPOINT_DIR, "readOnly": True}
    )
    pod_spec["volumes"].append(
        {
            "name": "entrypoint",
            "configMap": {"name": sandbox_entrypoint_config_map_name(), "defaultMode": 0o444},
        }
    )
    pod_spec["activeDeadlineSeconds"] = deadline


def _workdir_mount() -> dict[str, Any]:
    return {"name": "workdir", "mountPath": SANDBOX_WORKDIR}


def _files_in_annotations(
    spec: SandboxTaskSpec,
) -> tuple[dict[str, str], dict[str, str], list[dict[str, Any]]]:
    """spec.files (and stdin, as ``.stdin``) as pod annotations, with the downward-API items
    that project them: (files, annotations, items)."""
    annotations: dict[str, str] = {}
    items: list[dict[str, Any]] = []
    files = dict(spec.files)
    if spec.stdin is not None:
        files[SANDBOX_STDIN_FILE] = spec.stdin
    for index, (file_name, content) in enumerate(sorted(files.items())):
        if file_name != SANDBOX_STDIN_FILE:
            check_file_name(file_name)
        key = f"{ANNOTATION_FILE_PREFIX}{index}"
        annotations[key] = content
        items.append(
            {"path": file_name, "fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}
        )
    return files, annotations, items


def _sandbox_command(spec: SandboxTaskSpec) -> list[str]:
    """The task's command (``python main.py`` by default), fed its stdin file if it has one."""
    command = list(spec.command) or ["python", "main.py"]
    if spec.stdin is None:
        return command
    # Pods have no stdin pipe; the shell redirects the stdin file into the program.
    return ["sh", "-c", f'exec "$@" < {SANDBOX_WORKDIR}/{SANDBOX_STDIN_FILE}', "sandbox", *command]


def _files_init_container(
    config: OperatorConfig, files: dict[str, str], restricted: dict[str, Any]
) -> dict[str, Any]:
    """Copies the projected files into the writable workdir before the program starts."""
    top_level = sorted({f.split("/", 1)[0] for f in files})
    return {
        "name": "files",
        "image": config.sandbox_init_image,
        "imagePullPolicy": config.image_pull_policy,
        # -L: downward-API files are symlinks into a timestamped dir; copy contents.
        "command": [
            "cp",
            "-rL",
            *(f"{SANDBOX_FILES_DIR}/{t}" for t in top_level),
            SANDBOX_WORKDIR + "/",
        ],
        "resources": resources("100m", "32Mi", ephemeral_storage="16Mi"),
        "securityContext": restricted,
        "volumeMounts": [
            _workdir_mount(),
            {"name": "files", "mountPath": SANDBOX_FILES_DIR, "readOnly": True},
        ],
    }
