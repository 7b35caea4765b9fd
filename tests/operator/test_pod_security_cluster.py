"""RolloutPool replicas in a namespace that enforces Pod Security "restricted", on the real
kube-apiserver: the operator's Deployment for each engine yields pods the apiserver admits.

Pod Security is enforced when a pod is created, and here no controller-manager turns the
Deployment into a ReplicaSet and pods (the test control plane runs etcd and kube-apiserver
only). So each Deployment's pod template is created as a pod with ``dryRun=All``: the request
goes through the same admission chain, the PodSecurity plugin included, and nothing is stored.
A pod stripped of its securityContexts is refused in the same namespace, so the verdict is the
plugin's and not an open door.
"""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, wait_for

pytestmark = pytest.mark.cluster

WAIT_S = 300  # a deadline, not a delay: the operator answers in well under a second idle
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
POOLS = {
    "cpu": {"engine": "cpu", "model": "smollm2-135m-instruct"},
    "cpu-hf": {"engine": "cpu", "model": "hf://org/tiny"},
    "vllm-gpu": {"engine": "vllm", "model": "s3://b/runs/x/ckpt", "resources": {"gpus": 1}},
    "vllm-cpu": {"engine": "vllm", "model": "pvc://models/smollm2",
                 "resources": {"gpus": 0, "cpu": "1", "memory": "3Gi"}},
}  # fmt: skip


def _dry_run_pod(kube: KubeClient, namespace: str, name: str, template: dict[str, Any]) -> Any:
    """Create the template's pod with dryRun=All: (HTTP status, body or Status)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, **template["metadata"]},
        "spec": template["spec"],
    }
    path = resource_path("v1", "pods", namespace) + "?dryRun=All"
    return kube.request("POST", path, pod, ok=(201, 400, 403, 422))


def test_pool_pods_of_both_engines_are_admitted_where_restricted_is_enforced(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    kube.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": RESTRICTED}})
    for name, spec in POOLS.items():
        create_cr(
            kube,
            "rolloutpools",
            namespace,
            {"kind": "RolloutPool", "metadata": {"name": name}, "spec": {"replicas": 1, **spec}},
        )
    refused: dict[str, str] = {}
    for name in POOLS:
        deployment = wait_for(
            lambda name=name: kube.get("apps/v1", "Deployment", namespace, name),
            timeout_s=WAIT_S,
            what=f"the operator's Deployment {name}",
        )
        template = deployment["spec"]["template"]
        status, body = _dry_run_pod(kube, namespace, f"{name}-replica", template)
        if status != 201:
            refused[name] = body.get("message", str(body))
    assert not refused, refused

    # The control: the same pod without its securityContexts is refused by Pod Security.
    template = kube.get("apps/v1", "Deployment", namespace, "vllm-cpu")["spec"]["template"]
    template["spec"].pop("securityContext")
    for container in [*template["spec"]["initContainers"], *template["spec"]["containers"]]:
        container.pop("securityContext")
    status, body = _dry_run_pod(kube, namespace, "bare-replica", template)
    message = body.get("message", "")
    assert status == 403 and 'violates PodSecurity "restricted:latest"' in message, body
    assert "allowPrivilegeEscalation != false" in message and "runAsNonRoot" in message, message
