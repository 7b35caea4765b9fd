"""Operator restarts (idempotency) and deletion (owner references, storage kept)."""

from __future__ import annotations

import pytest

from posttrain.api import SandboxTask
from posttrain.devenv.minio import MinioServer
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.sandboxtask import builders
from posttrain.storage.store import open_store

from .conftest import cr_path, create_cr, get_cr, list_pods, set_pod_terminated, wait_for

pytestmark = pytest.mark.cluster


def task_body(name: str) -> dict[str, object]:
    return {
        "kind": "SandboxTask",
        "metadata": {"name": name},
        "spec": {"command": ["true"], "ttlSecondsAfterFinished": 3600},
    }


def test_restarted_operator_adopts_instead_of_duplicating(
    crds_installed: None, operator_config: OperatorConfig, kube: KubeClient, namespace: str
) -> None:
    # A previous operator crashed right after creating a pod, before patching the status.
    crashed = create_cr(kube, "sandboxtasks", namespace, task_body("crashed"))
    _, orphan = kube.create_or_adopt(
        builders.build_sandbox_pod(SandboxTask.model_validate(crashed), operator_config, attempt=1)
    )

    op = OperatorThread(operator_config).start()
    try:
        for i in range(20):
            create_cr(kube, "sandboxtasks", namespace, task_body(f"burst-{i}"))
        # Stop the operator in the middle of the burst, then start a fresh one.
        wait_for(lambda: len(list_pods(kube, namespace)) >= 5, what="some pods")
    finally:
        op.stop()
    op = OperatorThread(operator_config).start()
    try:
        wait_for(lambda: len(list_pods(kube, namespace)) == 21, what="21 pods")
        for pod in list_pods(kube, namespace):
            set_pod_terminated(kube, namespace, pod["metadata"]["name"], 0)
        for name in ["crashed", *(f"burst-{i}" for i in range(20))]:
            status = wait_for(
                lambda name=name: (
                    (get_cr(kube, "sandboxtasks", namespace, name).get("status") or {}).get("phase")
                    == "Succeeded"
                    and get_cr(kube, "sandboxtasks", namespace, name)["status"]
                ),
                what=f"{name} Succeeded",
            )
            assert (status["attempts"], status["podName"]) == (1, f"{name}-1")
    finally:
        op.stop()
    names = sorted(p["metadata"]["name"] for p in list_pods(kube, namespace))
    assert names == sorted(["crashed-1", *(f"burst-{i}-1" for i in range(20))])
    # The crashed operator's pod was adopted (same object), not replaced.
    assert (
        kube.get("v1", "Pod", namespace, "crashed-1")["metadata"]["uid"]
        == (orphan["metadata"]["uid"])
    )


@pytest.mark.minio
def test_delete_keeps_storage_unless_asked(
    crds_installed: None,
    minio_server: MinioServer,
    minio_env: dict[str, str],
    kubeconfig: object,
    kube: KubeClient,
    namespace: str,
) -> None:
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint=minio_server.endpoint,
        s3_bucket="runs-test",
    )
    spec = {
        "model": "smollm2-135m-instruct",
        "domains": [{"name": "math", "dataset": "builtin:arith", "verifier": {"kind": "numeric"}}],
    }
    # An earlier object named drop (another uid): its checkpoints are not the new drop's.
    earlier = open_store(f"s3://runs-test/runs/{namespace}/drop/uid-of-an-earlier-drop")
    earlier.put_bytes("checkpoints/step-1/model.bin", b"weights")
    with OperatorThread(config):
        create_cr(
            kube,
            "trainingruns",
            namespace,
            {"kind": "TrainingRun", "metadata": {"name": "keep"}, "spec": spec},
        )
        create_cr(
            kube,
            "trainingruns",
            namespace,
            {
                "kind": "TrainingRun",
                "metadata": {"name": "drop"},
                "spec": {**spec, "checkpoint": {"deleteOnRunDeletion": True}},
            },
        )
        # Each object's storage is <root>/<its uid>.
        uids = {
            n: get_cr(kube, "trainingruns", namespace, n)["metadata"]["uid"]
            for n in ("keep", "drop")
        }
        keep = open_store(f"s3://runs-test/runs/{namespace}/keep/{uids['keep']}")
        drop = open_store(f"s3://runs-test/runs/{namespace}/drop/{uids['drop']}")
        keep.put_bytes("checkpoints/step-1/model.bin", b"weights")
        drop.put_bytes("checkpoints/step-1/model.bin", b"weights")
        drop.put_bytes("trajectories/part-0.jsonl", b"{}")
        pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "keep-g0-0"), what="pod")
        # No garbage collector in this control plane: assert the references it would follow.
        keep_uid = get_cr(kube, "trainingruns", namespace, "keep")["metadata"]["uid"]
        for child in (
            pod,
            kube.get("v1", "ConfigMap", namespace, "keep-config"),
            kube.get("v1", "ServiceAccount", namespace, "keep-trainer"),
        ):
            assert child is not None
            assert [o["uid"] for o in child["metadata"]["ownerReferences"]] == [keep_uid]
        # Only the run that needs cleanup carries a finalizer.
        assert not get_cr(kube, "trainingruns", namespace, "keep")["metadata"].get("finalizers")
        wait_for(
            lambda: (
                get_cr(kube, "trainingruns", namespace, "drop")["metadata"].get("finalizers")
                == ["posttrain.io/finalizer"]
            ),
            what="finalizer on drop",
        )

        # Turned off, the field takes the finalizer off again (the reconciler keeps it).
        kube.patch(
            cr_path("trainingruns", namespace, "drop"),
            {"spec": {"checkpoint": {"deleteOnRunDeletion": False}}},
        )
        wait_for(
            lambda: (
                not get_cr(kube, "trainingruns", namespace, "drop")["metadata"].get("finalizers")
            ),
            what="finalizer off drop",
        )
        kube.patch(
            cr_path("trainingruns", namespace, "drop"),
            {"spec": {"checkpoint": {"deleteOnRunDeletion": True}}},
        )
        wait_for(
            lambda: (
                get_cr(kube, "trainingruns", namespace, "drop")["metadata"].get("finalizers")
                == ["posttrain.io/finalizer"]
            ),
            what="finalizer back on drop",
        )

        kube.delete("posttrain.io/v1alpha1", "TrainingRun", namespace, "keep")
        assert get_cr(kube, "trainingruns", namespace, "keep") is None  # gone at once
        kube.delete("posttrain.io/v1alpha1", "TrainingRun", namespace, "drop")
        wait_for(
            lambda: get_cr(kube, "trainingruns", namespace, "drop") is None,
            what="drop deleted after cleanup",
        )
    assert keep.list("") == ["checkpoints/step-1/model.bin"]
    assert drop.list("") == []
    assert earlier.list("") == ["checkpoints/step-1/model.bin"]  # deleteOnRunDeletion: its own


def test_pod_result_after_task_deleted_is_harmless(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """A pod event for a task that no longer exists must not recreate anything."""
    create_cr(kube, "sandboxtasks", namespace, task_body("gone"))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "gone-1"), what="pod")
    kube.delete("posttrain.io/v1alpha1", "SandboxTask", namespace, "gone")
    set_pod_terminated(kube, namespace, "gone-1", 0)
    wait_for(
        lambda: "gone" not in [k[1] for k in operator.controller.state.tasks.snapshot_keys()],
        what="task forgotten",
    )
    assert [p["metadata"]["name"] for p in list_pods(kube, namespace)] == ["gone-1"]
