"""The KubeRay path of multi-node TrainingRuns without a cluster: the RayCluster manifest and
the gang decisions driven by hand-written RayCluster and pod observations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from posttrain.api import TrainingRun
from posttrain.api import labels as api_labels
from posttrain.operator.config import OperatorConfig
from posttrain.operator.shared import builders as shared_builders
from posttrain.operator.shared.views import PodView, Terminated
from posttrain.operator.trainingrun import raycluster as b
from posttrain.operator.trainingrun.builders import build_trainer_children, ray_num_cpus
from posttrain.operator.trainingrun.gang import RayClusterView, ray_cluster_view
from posttrain.operator.trainingrun.plan import plan_training_run

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CONFIG = OperatorConfig(s3_endpoint="minio:9000", shm_size="4Gi", trainer_image="img:1")


def run(status: dict[str, Any] | None = None, nodes: int = 3, **spec: Any) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 2},
            "spec": {
                "model": "m",
                "domains": [{"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}],
                "resources": {"nodes": nodes, "gpusPerNode": 2, "cpu": "8", "memory": "32Gi"},
                **spec,
            },
            "status": status or {},
        }
    )


def cluster(incarnation: int, state: str = "", available: int = 0) -> RayClusterView:
    return RayClusterView(
        b.ray_cluster_name("r", incarnation),
        {api_labels.LABEL_GANG: str(incarnation)},
        state=state,
        available_workers=available,
        desired_workers=2,
    )


def ray_pod(
    incarnation: int, node_type: str, phase: str = "Running", exit_code: int | None = None
) -> PodView:
    labels = {api_labels.LABEL_GANG: str(incarnation), b.RAY_NODE_TYPE_LABEL: node_type}
    if node_type == "head":
        labels[api_labels.LABEL_RANK] = "0"
    terminated = Terminated(exit_code) if exit_code is not None else None
    return PodView(f"r-g{incarnation}-{node_type}-x", labels, phase=phase, terminated=terminated)


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def test_ray_cluster_mirrors_the_trainer_pods_with_kuberay_owning_the_pods() -> None:
    rc = b.build_ray_cluster(run(), CONFIG, incarnation=4, rollout_endpoints=["http://p:8000"])
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    meta = rc["metadata"]
    assert meta["name"] == "r-g4"
    assert meta["ownerReferences"][0]["uid"] == "u" and meta["ownerReferences"][0]["controller"]
    assert (
        meta["labels"][api_labels.LABEL_RUN] == "r" and meta["labels"][api_labels.LABEL_GANG] == "4"
    )
    assert meta["annotations"][b.RAY_OVERWRITE_CMD_ANNOTATION] == "true"
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is False
    (group,) = spec["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)

    head = spec["headGroupSpec"]["template"]
    worker = group["template"]
    for template in (head, worker):
        pod_spec = template["spec"]
        (container,) = pod_spec["containers"]
        assert container["image"] == "img:1"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert container["resources"]["requests"]["memory"] == "32Gi"
        shm = next(v for v in pod_spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
        env = env_of(container)
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
        assert env["POSTTRAIN_ROLLOUT_ENDPOINTS"]["value"] == "http://p:8000"
        assert env["MASTER_ADDR"]["value"] == "r-g4-head-svc.ns.svc"
        assert env["RAY_ADDRESS"]["value"] == f"r-g4-head-svc.ns.svc:{CONFIG.ray_port}"
        assert pod_spec["restartPolicy"] == "Never"
        assert pod_spec["serviceAccountName"] == "r-trainer"
        assert "hostname" not in pod_spec and "subdomain" not in pod_spec
        assert template["metadata"]["labels"][api_labels.LABEL_GANG] == "4"
    head_cmd = head["spec"]["containers"][0]["command"]
    assert "ray start --head" in head_cmd[2] and "posttrain run" in head_cmd[2]
    # Ray would truncate a fractional cgroup quota; the CPUs are declared, as KubeRay does.
    assert f"--num-cpus={ray_num_cpus(run())} " in head_cmd[2]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports == {
        "gcs-server": CONFIG.ray_port,
        "dist": CONFIG.trainer_master_port,
        "metrics": CONFIG.pod_metrics_port,
    }  # the trainer's /metrics
    assert head["metadata"]["labels"][api_labels.LABEL_RANK] == "0"
    worker_cmd = worker["spec"]["containers"][0]["command"]
    assert worker_cmd == [
        "ray",
        "start",
        f"--address=r-g4-head-svc.ns.svc:{CONFIG.ray_port}",
        f"--num-cpus={ray_num_cpus(run())}",
        "--block",
        f"--node-manager-port={b.RAY_WORKER_RAYLET_PORT}",
    ]
    # Our own probes (KubeRay would otherwise inject dashboard-agent probes): GCS on the
    # head, the pinned raylet port on workers.
    head_probe = head["spec"]["containers"][0]["readinessProbe"]["tcpSocket"]["port"]
    worker_probe = worker["spec"]["containers"][0]["livenessProbe"]["tcpSocket"]["port"]
    assert (head_probe, worker_probe) == (CONFIG.ray_port, b.RAY_WORKER_RAYLET_PORT)
    # One template for all workers: a per-pod RANK would be wrong, so there is none.
    assert "RANK" not in env_of(worker["spec"]["containers"][0])
    assert api_labels.LABEL_RANK not in worker["metadata"]["labels"]


def test_ray_cluster_is_only_for_multi_node_and_drops_our_head_service() -> None:
    with pytest.raises(shared_builders.BuildError, match="nodes > 1"):
        b.build_ray_cluster(run(nodes=1), CONFIG, 0)
    kinds = [m["kind"] for m in build_trainer_children(run(), CONFIG, 0, ray_cluster=True)]
    assert "Service" not in kinds and "ConfigMap" in kinds
    assert "Service" in [m["kind"] for m in build_trainer_children(run(), CONFIG, 0)]


def test_ray_cluster_view_reads_kuberay_status() -> None:
    view = ray_cluster_view(
        {
            "metadata": {"name": "r-g0", "labels": {api_labels.LABEL_GANG: "0"}},
            "spec": {"workerGroupSpecs": [{"replicas": 2}]},
            "status": {"state": "failed", "reason": "HeadPodFailed", "availableWorkerReplicas": 1},
        }
    )
    assert view.failed and view.reason == "HeadPodFailed"
    assert (view.available_workers, view.desired_workers) == (1, 2)


def test_new_multi_node_run_creates_one_ray_cluster_and_no_pods() -> None:
    plan = plan_training_run(run(), [], 0, NOW, ray_clusters=[])
    assert plan.create_ray_cluster and plan.ensure_children and plan.create_ranks == []
    assert plan.status_patch["phase"] == "Pending"
    assert plan.status_patch["rayCluster"] == "r-g0"
    ready = next(c for c in plan.status_patch["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RayClusterPending")
    assert [e.reason for e in plan.events] == ["RayClusterCreated"]


def test_ray_cluster_state_maps_to_phase_and_available_workers() -> None:
    pending = plan_training_run(
        run({"phase": "Pending"}), [], 0, NOW, ray_clusters=[cluster(0, state="", available=0)]
    )
    assert not pending.create_ray_cluster
    assert pending.status_patch["availableWorkers"] == 0
    assert "state not reported yet" in pending.status_patch["message"]
    ready = plan_training_run(
        run({"phase": "Pending"}), [], 0, NOW, ray_clusters=[cluster(0, state="ready", available=2)]
    )
    patch = ready.status_patch
    assert (patch["phase"], patch["rayClusterState"], patch["availableWorkers"]) == (
        "Running",
        "ready",
        2,
    )
    assert patch["message"] == "RayCluster r-g0 ready: 2/2 worker(s) available"
    cond = next(c for c in patch["conditions"] if c["type"] == "Ready")
    assert (cond["status"], cond["reason"]) == ("True", "Running")


def test_failed_ray_cluster_is_recreated_against_backoff_limit() -> None:
    plan = plan_training_run(
        run({"phase": "Running"}, backoffLimit=1),
        [ray_pod(0, "head")],
        0,
        NOW,
        ray_clusters=[cluster(0, state="failed")],
    )
    assert plan.incarnation == 1 and plan.create_ray_cluster
    assert plan.delete_ray_clusters == ["r-g0"] and plan.delete_pods == ["r-g0-head-x"]
    assert plan.status_patch["restarts"] == 1 and plan.status_patch["rayCluster"] == "r-g1"
    # The second failure (a worker pod this time) exceeds backoffLimit=1.
    second = plan_training_run(
        run({"phase": "Running", "restarts": 1}, backoffLimit=1),
        [ray_pod(1, "head"), ray_pod(1, "worker", phase="Failed", exit_code=137)],
        1,
        NOW,
        ray_clusters=[cluster(1, state="ready")],
    )
    assert second.status_patch["phase"] == "Failed" and not second.create_ray_cluster
    assert second.delete_ray_clusters == ["r-g1"]
    failed = next(c for c in second.status_patch["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "exit 137" in failed["message"]


def test_head_success_finishes_the_run_and_removes_the_cluster() -> None:
    plan = plan_training_run(
        run({"phase": "Running", "step": 9}),
        [ray_pod(0, "head", "Succeeded", 0), ray_pod(0, "worker")],
        0,
        NOW,
        ray_clusters=[cluster(0, state="ready", available=2)],
    )
    assert plan.status_patch["phase"] == "Succeeded"
    assert plan.delete_ray_clusters == ["r-g0"] and plan.delete_pods == ["r-g0-worker-x"]
    # Finished runs keep no cluster, whatever is observed later.
    after = plan_training_run(
        run({"phase": "Succeeded"}), [], 0, NOW, ray_clusters=[cluster(0, state="ready")]
    )
    assert after.delete_ray_clusters == ["r-g0"] and not after.create_ray_cluster


def test_suspend_deletes_the_cluster_and_resume_starts_the_next_incarnation() -> None:
    suspended = plan_training_run(
        run({"phase": "Running", "rayCluster": "r-g0", "availableWorkers": 2}, suspend=True),
        [],
        0,
        NOW,
        ray_clusters=[cluster(0, state="ready")],
    )
    assert suspended.delete_ray_clusters == ["r-g0"]
    assert suspended.status_patch["phase"] == "Suspended"
    assert suspended.status_patch["rayCluster"] is None  # merge patch: remove the field
    resumed = plan_training_run(run({"phase": "Suspended"}), [], 0, NOW, ray_clusters=[])
    assert resumed.incarnation == 1 and resumed.create_ray_cluster
    assert resumed.status_patch["rayCluster"] == "r-g1"


def test_stale_incarnation_clusters_are_deleted() -> None:
    plan = plan_training_run(
        run({"phase": "Pending"}), [], 2, NOW, ray_clusters=[cluster(1, state="ready"), cluster(2)]
    )
    assert plan.delete_ray_clusters == ["r-g1"] and not plan.create_ray_cluster
