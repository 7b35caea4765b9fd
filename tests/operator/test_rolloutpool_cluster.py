"""RolloutPool against the real apiserver: Deployment + Service, and the scale subresource."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, get_cr, wait_for

pytestmark = pytest.mark.cluster


def set_deployment_status(
    kube: KubeClient, namespace: str, name: str, ready: int, updated: int | None = None
) -> None:
    """Play the Deployment controller (none runs here): report replica counts."""
    dep = kube.get("apps/v1", "Deployment", namespace, name)
    assert dep is not None
    want = dep["spec"]["replicas"]
    status = {
        "observedGeneration": dep["metadata"]["generation"],
        "replicas": want,
        "readyReplicas": ready,
        "availableReplicas": ready,
        "updatedReplicas": want if updated is None else updated,
    }
    kube.patch(dep, {"status": status}, subresource="status")


def pool_status(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    return (get_cr(kube, "rolloutpools", namespace, name) or {}).get("status") or {}


def test_pool_deployment_service_and_kubectl_scale(
    operator: OperatorThread, kube: KubeClient, kubectl: Any, namespace: str
) -> None:
    pool = create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "p"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "engine": "cpu",
                "replicas": 1,
                "port": 8000,
                "resources": {"cpu": "2", "memory": "4Gi"},
            },
        },
    )
    dep = wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "p"), what="Deployment")
    assert dep["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    server = dep["spec"]["template"]["spec"]["containers"][0]
    assert server["command"][:4] == ["posttrain", "serve", "--model", "smollm2-135m-instruct"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "nvidia.com/gpu" not in server["resources"]["limits"]
    svc = wait_for(lambda: kube.get("v1", "Service", namespace, "p"), what="Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    # Who may reach the replicas: pods of runs that name the pool, and the operator.
    policy = kube.get("networking.k8s.io/v1", "NetworkPolicy", namespace, "p")
    assert policy is not None
    assert policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    sources = policy["spec"]["ingress"][0]["from"]
    assert sources[0] == {"podSelector": {"matchLabels": {"client.posttrain.io/p": "true"}}}
    # The pool's weight token: its own Secret, owned by the pool, given to its replicas only.
    token = kube.get("v1", "Secret", namespace, "p-weights-token")
    assert (
        token is not None
        and token["metadata"]["ownerReferences"][0]["uid"] == (pool["metadata"]["uid"])
    )
    token_env = next(e for e in server["env"] if e["name"] == "POSTTRAIN_WEIGHTS_TOKEN")
    assert token_env["valueFrom"]["secretKeyRef"] == {
        "name": "p-weights-token",
        "key": "token",
        "optional": False,
    }
    status = wait_for(
        lambda: (s := pool_status(kube, namespace, "p")).get("selector") and s,
        what="status.selector",
    )
    assert status["selector"] == "posttrain.io/component=rollout,posttrain.io/pool=p"
    assert status["endpoint"] == f"http://p.{namespace}.svc:8000"
    assert status["phase"] == "Pending"

    set_deployment_status(kube, namespace, "p", ready=1)
    wait_for(lambda: pool_status(kube, namespace, "p").get("phase") == "Ready", what="Ready")

    # The scale subresource, through the real kubectl.
    kubectl("scale", "-n", namespace, "rolloutpool/p", "--replicas=3")
    wait_for(
        lambda: kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["replicas"] == 3,
        what="Deployment scaled to 3",
    )
    set_deployment_status(kube, namespace, "p", ready=2)
    wait_for(
        lambda: pool_status(kube, namespace, "p").get("phase") == "Degraded",
        what="Degraded while scaling",
    )
    set_deployment_status(kube, namespace, "p", ready=3)
    status = wait_for(
        lambda: (s := pool_status(kube, namespace, "p")).get("readyReplicas") == 3 and s,
        what="3 ready",
    )
    assert status["phase"] == "Ready" and status["replicas"] == 3
    out = kubectl(
        "get",
        "-n",
        namespace,
        "--subresource=scale",
        "rolloutpool/p",
        "-o",
        "jsonpath={.spec.replicas} {.status.replicas} {.status.selector}",
    ).stdout
    assert out == "3 3 posttrain.io/component=rollout,posttrain.io/pool=p"

    # A template change rolls out (new spec hash) without touching replicas.
    kube.patch(get_cr(kube, "rolloutpools", namespace, "p"), {"spec": {"port": 9000}})
    wait_for(
        lambda: (
            kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["template"]["spec"][
                "containers"
            ][0]["ports"][0]["containerPort"]
            == 9000
        ),
        what="rolling update",
    )
    assert kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["replicas"] == 3


def _replica_pod(kube: KubeClient, namespace: str, pool: str, name: str) -> None:
    """A pod of the pool as its Deployment would create it (no controller runs here)."""
    from posttrain.api import labels as api_labels
    from posttrain.operator.kube import resource_path
    from posttrain.operator.rolloutpool import builders as b

    kube.request("POST", resource_path("v1", "pods", namespace), {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {**api_labels.MANAGED_BY, **b.pool_selector(pool)}},
        "spec": {"containers": [{"name": "server", "image": "x"}]},
    })  # fmt: skip


def _patch_pod_status(kube: KubeClient, namespace: str, name: str, status: dict[str, Any]) -> None:
    from posttrain.operator.kube import resource_path

    kube.patch(resource_path("v1", "pods", namespace, name), {"status": status}, "status")


def test_vllm_pool_reports_unreachable_model_and_ready_replica_urls(
    operator: OperatorThread,
    kube: KubeClient,
    kubeconfig: Any,
    namespace: str,
    tmp_path: Path,
) -> None:
    """Ready=False naming the model URI when the fetch step fails; the ready replicas' own
    URLs in status.replicaEndpoints (read back by the trainer's PoolDiscovery) and the
    version each serves, asked of the replica itself (a real server on loopback here)."""
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    from posttrain.models import make_tiny_model
    from posttrain.rollout.client import RolloutClient
    from posttrain.rollout.discovery import PoolDiscovery
    from posttrain.rollout.server import ServerConfig, ServerThread

    model = make_tiny_model(tmp_path / "model", seed=0)
    server = ServerThread(ServerConfig(model=str(model), num_threads=1)).start()
    try:
        uri = "s3://checkpoints/no-such-run/step-00000007"
        create_cr(kube, "rolloutpools", namespace, {
            "kind": "RolloutPool", "metadata": {"name": "v"},
            "spec": {"model": uri, "engine": "vllm", "replicas": 1, "port": server.port},
        })  # fmt: skip
        dep = wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "v"),
                       what="Deployment")  # fmt: skip
        template = dep["spec"]["template"]["spec"]
        assert template["containers"][0]["command"][:3] == ["posttrain", "rollout", "vllm-entry"]
        assert template["initContainers"][0]["command"][4] == uri
        _replica_pod(kube, namespace, "v", "v-a")
        _patch_pod_status(
            kube,
            namespace,
            "v-a",
            {
                "phase": "Pending",
                "initContainerStatuses": [
                    {
                        "name": "fetch-model",
                        "ready": False,
                        "restartCount": 3,
                        "image": "x",
                        "imageID": "",
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                        "lastState": {
                            "terminated": {
                                "exitCode": 1,
                                "reason": "Error",
                                "message": f"cannot fetch model {uri}: not found",
                            }
                        },
                    }
                ],
            },
        )

        def ready_condition() -> dict[str, Any] | None:
            conditions = pool_status(kube, namespace, "v").get("conditions") or []
            found = next((c for c in conditions if c["type"] == "Ready"), None)
            return found if found and found.get("reason") == "ModelUnavailable" else None

        condition = wait_for(ready_condition, what="Ready condition naming the model")
        assert condition["status"] == "False" and uri in condition["message"]

        # A healthy replica (the real server above, as if it ran in pod v-b on loopback).
        url = f"http://127.0.0.1:{server.port}"
        _replica_pod(kube, namespace, "v", "v-b")
        _patch_pod_status(
            kube,
            namespace,
            "v-b",
            {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        )
        status = wait_for(lambda: (s := pool_status(kube, namespace, "v")).get(
            "weightVersion") == 0 and s, what="status.weightVersion 0")  # fmt: skip
        assert status["replicaEndpoints"] == [url]
        assert status["replicaWeights"] == [{"pod": "v-b", "endpoint": url, "weightVersion": 0}]
        api = k8s.CustomObjectsApi(k8s_config.new_client_from_config(str(kubeconfig)))
        discovery = PoolDiscovery("v", namespace, api=api)
        assert discovery.wait_ready(timeout_s=5) == [url]
        # The replica loads v3: the pool's status follows what it serves (resync asks it).
        (tmp_path / "weights" / "v00000003").mkdir(parents=True)
        (tmp_path / "weights" / "v00000003" / "model.safetensors").symlink_to(
            model / "model.safetensors"
        )
        with RolloutClient([url], discover=discovery.ready_endpoints) as client:
            client.load_weights(str(tmp_path / "weights"), 3)
        wait_for(lambda: pool_status(kube, namespace, "v").get("weightVersion") == 3,
                 what="status.weightVersion 3")  # fmt: skip
    finally:
        server.stop()
