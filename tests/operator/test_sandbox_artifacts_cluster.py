"""SandboxTask logs and snapshots end to end: the real operator (real apiserver) signs URLs
on the real MinIO, the test plays the kubelet by running the pod's own command (the
entrypoint read back from the operator's ConfigMap), and the status carries the URIs."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.sandboxtask import builders as sandbox_builders
from posttrain.operator.shared import sandbox as b
from posttrain.sandboxes import task_entrypoint
from posttrain.storage.store import open_store

from .conftest import create_cr, get_cr, set_pod_running, set_pod_terminated, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.minio]

ARTIFACTS = "s3://sandbox-artifacts/tasks"
EGRESS = [
    {
        "to": [{"podSelector": {"matchLabels": {"app": "minio"}}}],
        "ports": [{"protocol": "TCP", "port": 9000}],
    }
]


@pytest.fixture
def storing_operator(
    crds_installed: None,
    minio_server: MinioServer,
    minio_env: dict[str, str],
    kubeconfig: Path,
    namespace: str,
) -> Iterator[OperatorThread]:
    """The operator with artifact storage on; its S3 credentials come from its environment
    (minio_env), never from the pods'."""
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint=minio_server.endpoint,
        sandbox_artifacts_uri=ARTIFACTS,
        sandbox_artifacts_egress=EGRESS,
    )
    op = OperatorThread(config).start()
    yield op
    op.stop()


def task_body(name: str, **spec: object) -> dict[str, object]:
    return {
        "kind": "SandboxTask",
        "metadata": {"name": name},
        "spec": {"timeoutSeconds": 30, **spec},
    }


def play_kubelet(kube: KubeClient, pod: dict[str, Any], root: Path) -> None:
    """Run the pod like a kubelet would, minus containers: the init container's copy of the
    downward-API files, then the main container's argv with its env, with the entrypoint
    file taken from the ConfigMap volume; then report the termination message."""
    namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    workdir = root / name
    workdir.mkdir(parents=True)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    annotations = pod["metadata"].get("annotations") or {}
    for item in (volumes.get("files") or {}).get("downwardAPI", {}).get("items", []):
        key = item["fieldRef"]["fieldPath"].split("'")[1]
        target = workdir / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(annotations[key])
    config_map = kube.get("v1", "ConfigMap", namespace, volumes["entrypoint"]["configMap"]["name"])
    assert config_map is not None
    entrypoint = root / f"{name}-entrypoint.py"
    entrypoint.write_text(config_map["data"][b.SANDBOX_ENTRYPOINT_KEY])
    (container,) = pod["spec"]["containers"]
    argv = [
        str(entrypoint)
        if a == f"{sandbox_builders.SANDBOX_ENTRYPOINT_DIR}/{b.SANDBOX_ENTRYPOINT_KEY}"
        else a
        for a in container["command"]
    ]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    result_path = root / f"{name}.termination-log"
    env.update(
        {
            "PATH": os.environ["PATH"],
            task_entrypoint.WORKDIR_ENV: str(workdir),
            task_entrypoint.RESULT_PATH_ENV: str(result_path),
        }
    )
    set_pod_running(kube, namespace, name)
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, timeout=60)
    set_pod_terminated(kube, namespace, name, proc.returncode, result_path.read_text())


def finished(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    return wait_for(
        lambda: (
            (s := ((get_cr(kube, "sandboxtasks", namespace, name) or {}).get("status") or {})).get(
                "phase"
            )
            in ("Succeeded", "Failed")
            and s
        ),
        what=f"{name} finished",
    )


def test_logs_and_snapshot_are_stored_and_a_new_task_restores_from_the_snapshot(
    storing_operator: OperatorThread, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    program = (
        "import pathlib, sys\n"
        "pathlib.Path('state.txt').write_text('step 1 done')\n"
        "print('hello from the sandbox')\n"
        "print('and a warning', file=sys.stderr)\n"
    )
    create_cr(
        kube,
        "sandboxtasks",
        namespace,
        task_body(
            "snap", command=["python3", "main.py"], files={"main.py": program}, snapshot=True
        ),
    )
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "snap-1"), what="pod snap-1")
    (container,) = pod["spec"]["containers"]
    assert container["command"][:3] == ["python3", "/sandbox/entrypoint/entrypoint.py", "--"]
    assert container["command"][3:] == ["python3", "main.py"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    # Presigned URLs, one object each; no credentials anywhere in the pod.
    assert "snap/1/logs.txt" in env["POSTTRAIN_SANDBOX_LOGS_URL"]
    assert "snap/1/snapshot.tar" in env["POSTTRAIN_SANDBOX_SNAPSHOT_URL"]
    assert not any(k.startswith("AWS_") for k in env)
    assert pod["spec"]["activeDeadlineSeconds"] == 30 + 30  # timeout + upload grace
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # The default-deny policy's one exception is the object store.
    policy = kube.get("networking.k8s.io/v1", "NetworkPolicy", namespace, b.SANDBOX_NETWORK_POLICY)
    assert policy is not None and policy["spec"]["egress"] == EGRESS

    play_kubelet(kube, pod, tmp_path)
    status = finished(kube, namespace, "snap")
    assert status["phase"] == "Succeeded"
    logs_uri = f"{ARTIFACTS}/{namespace}/snap/1/logs.txt"
    snapshot_uri = f"{ARTIFACTS}/{namespace}/snap/1/snapshot.tar"
    assert (status["logsUri"], status["snapshotUri"]) == (logs_uri, snapshot_uri)
    store = open_store("s3://sandbox-artifacts")
    log = store.get_bytes(logs_uri.removeprefix("s3://sandbox-artifacts/")).decode()
    assert "hello from the sandbox" in log and "and a warning" in log
    tar_bytes = store.get_bytes(snapshot_uri.removeprefix("s3://sandbox-artifacts/"))
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        assert sorted(tar.getnames()) == ["main.py", "state.txt"]

    # Replay from the snapshot: the new program sees the old workdir's state.
    create_cr(
        kube,
        "sandboxtasks",
        namespace,
        task_body(
            "replay",
            command=["python3", "-c", "print(open('state.txt').read())"],
            restoreFrom=snapshot_uri,
        ),
    )
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "replay-1"), what="pod replay-1")
    env = {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}
    assert "snap/1/snapshot.tar" in env["POSTTRAIN_SANDBOX_RESTORE_URL"]
    assert "POSTTRAIN_SANDBOX_SNAPSHOT_URL" not in env  # snapshot was not asked for
    play_kubelet(kube, pod, tmp_path)
    status = finished(kube, namespace, "replay")
    assert status["phase"] == "Succeeded" and "snapshotUri" not in status
    replay_log = store.get_bytes(f"tasks/{namespace}/replay/1/logs.txt").decode()
    assert replay_log.strip().endswith("step 1 done")


def test_restore_from_outside_the_namespace_is_refused(
    storing_operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube,
        "sandboxtasks",
        namespace,
        task_body("steal", command=["true"], restoreFrom=f"{ARTIFACTS}/other-ns/t/1/snapshot.tar"),
    )
    status = finished(kube, namespace, "steal")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert (
        failed["reason"] == "InvalidSpec"
        and "not a sandbox snapshot of this namespace" in (failed["message"])
    )
    assert kube.get("v1", "Pod", namespace, "steal-1") is None


def test_snapshot_without_artifact_storage_is_an_invalid_spec(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube, "sandboxtasks", namespace, task_body("nostore", command=["true"], snapshot=True)
    )
    status = finished(kube, namespace, "nostore")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "InvalidSpec"
    assert "SANDBOX_ARTIFACTS_URI" in failed["message"]
