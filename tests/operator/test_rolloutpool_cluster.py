"""RolloutPool against the real apiserver: Deployment + Service, and the scale subresource."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, get_cr, wait_for

pytestmark = pytest.mark.cluster


def set_deployment_status(kube: KubeClient, namespace: str, name: str, ready: int,
                          updated: int | None = None) -> None:
    """Play the Deployment controller (none runs here): report replica counts."""
    dep = kube.get("apps/v1", "Deployment", namespace, name)
    assert dep is not None
    want = dep["spec"]["replicas"]
    status = {"observedGeneration": dep["metadata"]["generation"], "replicas": want,
              "readyReplicas": ready, "availableReplicas": ready,
              "updatedReplicas": want if updated is None else updated}
    kube.patch(dep, {"status": status}, subresource="status")


def pool_status(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    return (get_cr(kube, "rolloutpools", namespace, name) or {}).get("status") or {}


def test_pool_deployment_service_and_kubectl_scale(
    operator: OperatorThread, kube: KubeClient, kubectl: Any, namespace: str
) -> None:
    pool = create_cr(kube, "rolloutpools", namespace, {
        "kind": "RolloutPool", "metadata": {"name": "p"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1, "port": 8000,
                 "resources": {"cpu": "2", "memory": "4Gi"}},
    })
    dep = wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "p"), what="Deployment")
    assert dep["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    server = dep["spec"]["template"]["spec"]["containers"][0]
    assert server["command"][:4] == ["posttrain", "serve", "--model", "smollm2-135m-instruct"]
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "nvidia.com/gpu" not in server["resources"]["limits"]
    svc = wait_for(lambda: kube.get("v1", "Service", namespace, "p"), what="Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    status = wait_for(lambda: (s := pool_status(kube, namespace, "p")).get("selector") and s,
                      what="status.selector")
    assert status["selector"] == "posttrain.io/component=rollout,posttrain.io/pool=p"
    assert status["endpoint"] == f"http://p.{namespace}.svc:8000"
    assert status["phase"] == "Pending"

    set_deployment_status(kube, namespace, "p", ready=1)
    wait_for(lambda: pool_status(kube, namespace, "p").get("phase") == "Ready", what="Ready")

    # The scale subresource, through the real kubectl.
    kubectl("scale", "-n", namespace, "rolloutpool/p", "--replicas=3")
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["replicas"] == 3,
             what="Deployment scaled to 3")
    set_deployment_status(kube, namespace, "p", ready=2)
    wait_for(lambda: pool_status(kube, namespace, "p").get("phase") == "Degraded",
             what="Degraded while scaling")
    set_deployment_status(kube, namespace, "p", ready=3)
    status = wait_for(lambda: (s := pool_status(kube, namespace, "p")).get("readyReplicas") == 3
                      and s, what="3 ready")
    assert status["phase"] == "Ready" and status["replicas"] == 3
    out = kubectl("get", "-n", namespace, "--subresource=scale", "rolloutpool/p",
                  "-o", "jsonpath={.spec.replicas} {.status.replicas} {.status.selector}").stdout
    assert out == "3 3 posttrain.io/component=rollout,posttrain.io/pool=p"

    # A template change rolls out (new spec hash) without touching replicas.
    kube.patch(get_cr(kube, "rolloutpools", namespace, "p"), {"spec": {"port": 9000}})
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["template"][
        "spec"]["containers"][0]["ports"][0]["containerPort"] == 9000, what="rolling update")
    assert kube.get("apps/v1", "Deployment", namespace, "p")["spec"]["replicas"] == 3
