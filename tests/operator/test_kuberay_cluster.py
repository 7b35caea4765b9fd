"""Multi-node TrainingRuns as KubeRay RayClusters, against the real apiserver with KubeRay's
real CRD installed (vendored in tests/operator/crds). No KubeRay controller runs here, so the
tests play it: they patch the RayCluster's status and create the head pod it would create."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.api import labels
from posttrain.api import labels as api_labels
from posttrain.devenv.controlplane import ControlPlane
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.trainingrun import raycluster

from .conftest import (
    cr_path,
    create_cr,
    get_cr,
    list_pods,
    run_body,
    run_status,
    set_pod_running,
    set_pod_terminated,
    wait_for,
)
from .test_rbac_cluster import operator_with_exactly_its_rbac

pytestmark = pytest.mark.cluster

RAY_CRD = Path(__file__).parent / "crds" / "ray.io_rayclusters.yaml"


@pytest.fixture(scope="module")
def rayclusters_crd(crds_installed: None, kubectl: Any, kube: KubeClient) -> Iterator[None]:
    """KubeRay's RayCluster CRD, installed for this module only: other modules test the plain
    pod path, which is what the operator does when the CRD is absent."""
    # Server-side apply: the CRD is too large for client-side apply's last-applied annotation.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(RAY_CRD))
    wait_for(lambda: kube.serves("ray.io/v1", "rayclusters"), what="rayclusters served")
    yield
    kubectl("delete", "crd", "rayclusters.ray.io", "--wait=true")
    wait_for(lambda: not kube.serves("ray.io/v1", "rayclusters"), what="rayclusters gone")


def ray_cluster(kube: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get("ray.io/v1", "RayCluster", namespace, name)


def set_ray_cluster_status(
    kube: KubeClient, namespace: str, name: str, status: dict[str, Any]
) -> None:
    """Play the KubeRay controller: write the RayCluster's status subresource."""
    kube.patch(
        resource_path("ray.io/v1", "rayclusters", namespace, name), {"status": status}, "status"
    )


def trainer_pods(kube: KubeClient, namespace: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in list_pods(
            kube, namespace, f"{api_labels.LABEL_COMPONENT}={api_labels.COMPONENT_TRAINER}"
        )
        if not p["metadata"].get("deletionTimestamp")
    )


def test_multi_node_run_becomes_one_ray_cluster_mapped_into_status(
    rayclusters_crd: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    run = create_cr(
        kube,
        "trainingruns",
        namespace,
        run_body("mr", resources={"nodes": 3, "gpusPerNode": 1, "cpu": "4", "memory": "16Gi"}),
    )
    rc = wait_for(lambda: ray_cluster(kube, namespace, "mr-g0"), what="RayCluster mr-g0")
    owner = rc["metadata"]["ownerReferences"][0]
    # Deleting the run garbage-collects the RayCluster (and KubeRay's pods with it).
    assert (owner["kind"], owner["uid"], owner["controller"], owner["blockOwnerDeletion"]) == (
        "TrainingRun",
        run["metadata"]["uid"],
        True,
        True,
    )
    spec = rc["spec"]
    (workers,) = spec["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (2, 2, 2)
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "posttrain run /etc/posttrain/run.yaml" in head["command"][2]
    env = {e["name"]: e for e in head["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "posttrain-s3"
    assert env["MASTER_ADDR"]["value"] == f"mr-g0-head-svc.{namespace}.svc"
    # No bare trainer pods and no head Service of ours: KubeRay makes both.
    assert trainer_pods(kube, namespace) == []
    assert kube.get("v1", "Service", namespace, "mr-head") is None
    assert kube.get("v1", "ConfigMap", namespace, "mr-config") is not None
    pending = wait_for(
        lambda: (s := run_status(kube, namespace, "mr")).get("rayCluster") and s,
        what="status.rayCluster",
    )
    assert pending["phase"] == "Pending" and pending["rayCluster"] == "mr-g0"

    set_ray_cluster_status(
        kube,
        namespace,
        "mr-g0",
        {"state": "ready", "availableWorkerReplicas": 2, "desiredWorkerReplicas": 2},
    )
    running = wait_for(
        lambda: (s := run_status(kube, namespace, "mr")).get("phase") == "Running" and s,
        what="run Running",
    )
    assert (running["rayClusterState"], running["availableWorkers"]) == ("ready", 2)
    ready = next(c for c in running["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and "2/2 worker(s)" in ready["message"]

    # KubeRay's head pod (our template labels + its node-type label) finishes the trainer.
    template = spec["headGroupSpec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "mr-g0-head-abcde",
            "namespace": namespace,
            "labels": {**template["metadata"]["labels"], raycluster.RAY_NODE_TYPE_LABEL: "head"},
            # As KubeRay makes it: controlled by the RayCluster, not by the run (the real
            # KubeRay showed an operator that deleted such pods as another run's).
            "ownerReferences": [
                {
                    "apiVersion": "ray.io/v1",
                    "kind": "RayCluster",
                    "name": "mr-g0",
                    "uid": rc["metadata"]["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": template["spec"],
    }
    # The template's metadata as KubeRay copies it onto the pod: labels and finalizers.
    pod["metadata"]["finalizers"] = template["metadata"].get("finalizers", [])
    kube.create_or_adopt(pod)
    # As on the real node: the kubelet reports the trainer container terminated (exit 0) while
    # the pod is still Running; KubeRay deletes a head whose Ray container terminated (restart
    # policy Never) at once; the kubelet then moves the deleted pod to Succeeded. Without the
    # head's finalizer the pod is gone before that, and the run never learnt it succeeded.
    set_pod_terminated(kube, namespace, "mr-g0-head-abcde", 0, phase="Running")
    kube.delete("v1", "Pod", namespace, "mr-g0-head-abcde")
    set_pod_terminated(kube, namespace, "mr-g0-head-abcde", 0)
    done = wait_for(
        lambda: (s := run_status(kube, namespace, "mr")).get("phase") == "Succeeded" and s,
        what="run Succeeded",
    )
    assert done["restarts"] == 0
    wait_for(lambda: ray_cluster(kube, namespace, "mr-g0") is None, what="RayCluster deleted")
    # The operator lets the head go once its outcome is recorded.
    wait_for(
        lambda: kube.get("v1", "Pod", namespace, "mr-g0-head-abcde") is None,
        what="the head pod released and gone",
    )


def test_failed_ray_cluster_is_recreated_then_fails_the_run_past_backoff_limit(
    rayclusters_crd: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube, "trainingruns", namespace, run_body("fr", resources={"nodes": 2}, backoffLimit=1)
    )
    wait_for(lambda: ray_cluster(kube, namespace, "fr-g0"), what="RayCluster fr-g0")
    set_ray_cluster_status(
        kube, namespace, "fr-g0", {"state": "failed", "reason": "HeadPodCrashLooping"}
    )
    wait_for(lambda: ray_cluster(kube, namespace, "fr-g1"), what="RayCluster fr-g1")
    wait_for(lambda: ray_cluster(kube, namespace, "fr-g0") is None, what="fr-g0 deleted")
    status = wait_for(
        lambda: (s := run_status(kube, namespace, "fr")).get("rayCluster") == "fr-g1" and s,
        what="status on fr-g1",
    )
    assert status["restarts"] == 1
    # The restart is explained on the run, with KubeRay's reason.
    wait_for(
        lambda: any(
            e.get("reason") == "GangRestart" and "HeadPodCrashLooping" in e.get("message", "")
            for e in kube.request("GET", resource_path("v1", "events", namespace))[1]["items"]
        ),
        what="GangRestart event naming KubeRay's reason",
    )
    run = get_cr(kube, "trainingruns", namespace, "fr")
    assert run is not None
    assert run["metadata"]["annotations"][labels.ANNOTATION_INCARNATION] == "1"

    set_ray_cluster_status(kube, namespace, "fr-g1", {"state": "failed", "reason": "Again"})
    failed = wait_for(
        lambda: (s := run_status(kube, namespace, "fr")).get("phase") == "Failed" and s,
        what="run Failed",
    )
    assert failed["restarts"] == 2
    reason = next(c for c in failed["conditions"] if c["type"] == "Failed")["reason"]
    assert reason == "BackoffLimitExceeded"
    wait_for(lambda: ray_cluster(kube, namespace, "fr-g1") is None, what="fr-g1 deleted")
    assert ray_cluster(kube, namespace, "fr-g2") is None


def test_suspend_deletes_the_ray_cluster_and_resume_recreates_it(
    rayclusters_crd: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "trainingruns", namespace, run_body("sr", resources={"nodes": 2}))
    wait_for(lambda: ray_cluster(kube, namespace, "sr-g0"), what="RayCluster sr-g0")
    kube.patch(cr_path("trainingruns", namespace, "sr"), {"spec": {"suspend": True}})
    wait_for(lambda: ray_cluster(kube, namespace, "sr-g0") is None, what="sr-g0 deleted")
    suspended = wait_for(
        lambda: (s := run_status(kube, namespace, "sr")).get("phase") == "Suspended" and s,
        what="run Suspended",
    )
    assert "rayCluster" not in suspended and suspended["restarts"] == 0
    kube.patch(cr_path("trainingruns", namespace, "sr"), {"spec": {"suspend": False}})
    wait_for(lambda: ray_cluster(kube, namespace, "sr-g1"), what="RayCluster sr-g1 on resume")
    assert trainer_pods(kube, namespace) == []


def test_single_node_run_stays_a_pod_with_kuberay_installed(
    rayclusters_crd: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "trainingruns", namespace, run_body("one"))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "one-g0-0"), what="trainer pod")
    path = resource_path("ray.io/v1", "rayclusters", namespace)
    assert kube.request("GET", path)[1]["items"] == []


def test_kuberay_path_works_with_exactly_the_operator_rbac(
    rayclusters_crd: None,
    control_plane: ControlPlane,
    kube: KubeClient,
    namespace: str,
    tmp_path: Path,
) -> None:
    """rbac.OPERATOR_RULES cover the KubeRay path: create, watch, list and delete
    RayClusters as the operator's ServiceAccount (a missing rule would time a wait out)."""
    with operator_with_exactly_its_rbac(kube, control_plane, namespace, tmp_path):
        create_cr(kube, "trainingruns", namespace, run_body("rb", resources={"nodes": 2}))
        wait_for(lambda: ray_cluster(kube, namespace, "rb-g0"), what="RayCluster rb-g0")
        set_ray_cluster_status(
            kube, namespace, "rb-g0", {"state": "ready", "availableWorkerReplicas": 1}
        )
        wait_for(
            lambda: run_status(kube, namespace, "rb").get("phase") == "Running",
            what="run Running from the watched RayCluster",
        )
        kube.patch(cr_path("trainingruns", namespace, "rb"), {"spec": {"suspend": True}})
        wait_for(
            lambda: ray_cluster(kube, namespace, "rb-g0") is None,
            what="RayCluster deleted by the operator's ServiceAccount",
        )


def test_kuberay_installed_after_the_operator_is_used_from_the_next_gang_on(
    rayclusters_crd: None,
    kubectl: Any,
    kube: KubeClient,
    namespace: str,
    operator_config: OperatorConfig,
) -> None:
    """Runs last in this module: removes the CRD, starts the operator without it, installs
    it again. The RayCluster informers start when discovery finds the CRD (here: the fresh
    discovery of the resumed gang's start) and stop when it is removed again.

    The periodic discovery answer is cached for an hour here, so the only way the resumed gang
    can become a RayCluster is the fresh discovery a gang start does. (With a short cache
    instead, this test once depended on timing: a "not installed" answer cached less than a
    second before the resume put gang 1 on plain pods, and RayCluster late-g1 never came.)"""
    kubectl("delete", "crd", "rayclusters.ray.io", "--wait=true")
    wait_for(lambda: not kube.serves("ray.io/v1", "rayclusters"), what="rayclusters gone")
    config = operator_config.model_copy(update={"kuberay_discovery_seconds": 3600.0})
    with OperatorThread(config) as op:
        assert op.memo is not None
        optional = op.memo.optional_informers
        assert not optional.running("RayCluster")  # discovery found no CRD: nothing watched
        create_cr(kube, "trainingruns", namespace, run_body("late", resources={"nodes": 2}))
        wait_for(
            lambda: trainer_pods(kube, namespace) == ["late-g0-0", "late-g0-1"],
            what="plain head + worker pods without KubeRay",
        )
        assert kube.get("v1", "Service", namespace, "late-head") is not None

        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(RAY_CRD))
        wait_for(lambda: kube.serves("ray.io/v1", "rayclusters"), what="rayclusters served")
        # A running plain gang is not switched over...
        set_pod_running(kube, namespace, "late-g0-0")
        set_pod_running(kube, namespace, "late-g0-1")
        wait_for(
            lambda: run_status(kube, namespace, "late").get("phase") == "Running",
            what="plain gang Running",
        )
        assert ray_cluster(kube, namespace, "late-g1") is None
        # ...the next gang, started from nothing, is a RayCluster.
        kube.patch(cr_path("trainingruns", namespace, "late"), {"spec": {"suspend": True}})
        wait_for(
            lambda: run_status(kube, namespace, "late").get("phase") == "Suspended",
            what="suspended",
        )
        kube.patch(cr_path("trainingruns", namespace, "late"), {"spec": {"suspend": False}})
        wait_for(lambda: ray_cluster(kube, namespace, "late-g1"), what="RayCluster late-g1")
        set_ray_cluster_status(
            kube, namespace, "late-g1", {"state": "ready", "availableWorkerReplicas": 1}
        )
        running = wait_for(
            lambda: (
                (s := run_status(kube, namespace, "late")).get("rayClusterState") == "ready" and s
            ),
            what="status from the watched RayCluster",
        )
        assert running["phase"] == "Running" and running["availableWorkers"] == 1
        assert optional.running("RayCluster")

        # The CRD removed: discovery says so, and the RayCluster informers stop.
        kubectl("delete", "crd", "rayclusters.ray.io", "--wait=true")
        wait_for(lambda: not kube.serves("ray.io/v1", "rayclusters"), what="rayclusters gone")
        assert not op.controller.training_runs.kuberay.installed(fresh=True)
        wait_for(lambda: not optional.running("RayCluster"), what="RayCluster informers stopped")
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(RAY_CRD))
