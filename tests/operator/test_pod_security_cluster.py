"""RolloutPool replicas and TrainingRun pods in a namespace that enforces Pod Security
"restricted", on the real kube-apiserver: the operator's Deployment for each engine, and every
pod a TrainingRun creates, yield pods the apiserver admits (the documented bubblewrap
exception aside).

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


def _trainingrun_templates(namespace: str) -> dict[str, dict[str, Any]]:
    """Every pod template a TrainingRun's reconciler creates, from the builders it uses: the
    plain gang's pods (two nodes), the RayCluster's head and worker templates, the evaluator
    Job's, and for the two bubblewrap pods (the run's own sandbox runner, a mode-local trainer
    whose domains execute code) their own."""
    from .test_builders import (
        CODE_DOMAIN,
        COLOCATED_POOLS,
        make_pool,
        make_run,
        trainingrun_pod_specs,
    )

    def templates(pool: Any = None, **spec: Any) -> dict[str, dict[str, Any]]:
        run = make_run(**spec)
        run.metadata.namespace = namespace
        return {
            name: {"metadata": {"labels": {"kind": name.replace(" ", "-")}}, "spec": pod}
            for name, pod in trainingrun_pod_specs(run, pool).items()
        }

    # rollout.colocated: the trainer pod with two replicas of each engine as native sidecars.
    colocated = {
        f"colocated {engine} {name}": template
        for engine, pool_spec in COLOCATED_POOLS.items()
        for name, template in templates(
            make_pool(**pool_spec), rollout={"pool": "pool", "colocated": {"replicas": 2}}
        ).items()
    }
    return {
        **colocated,
        **templates(resources={"nodes": 2, "gpusPerNode": 1}, evaluation={"inline": False}),
        **{
            f"hf model {name}": template
            for name, template in templates(model="hf://org/tiny").items()
        },
        **{
            f"bwrap {name}": template
            for name, template in templates(
                domains=[CODE_DOMAIN], sandbox={"mode": "runner"}
            ).items()
            if name == "demo-sandbox-runner"
        },
        **{
            f"bwrap local {name}": template
            for name, template in templates(
                domains=[CODE_DOMAIN], sandbox={"mode": "local"}
            ).items()
        },
    }


def _pod_name(name: str) -> str:
    return "".join(c for c in name.replace(" ", "-").lower() if c.isalnum() or c in "-.")


def test_trainingrun_pods_are_admitted_where_restricted_is_enforced(
    kube: KubeClient, namespace: str
) -> None:
    """Each pod of a TrainingRun (gang ranks, RayCluster head and worker, evaluator) is
    admitted under "restricted"; the two bubblewrap pods are refused for their Unconfined
    seccomp and unmasked /proc alone (admitted without them); each pod stripped of its
    securityContexts is refused (the verdict is the plugin's, not an open door)."""
    kube.patch(f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": RESTRICTED}})
    templates = _trainingrun_templates(namespace)
    assert {"gang rank 0", "gang rank 1", "ray head", "ray worker", "demo-evaluator",
            "bwrap demo-sandbox-runner", "bwrap local gang rank 0",
            "colocated cpu engine gang rank 0",
            "colocated vllm bf16 gang rank 0"} <= set(templates)  # fmt: skip
    refused: dict[str, str] = {}
    for name, template in templates.items():
        status, body = _dry_run_pod(kube, namespace, _pod_name(name), template)
        if status != 201:
            refused[name] = body.get("message", str(body))
    bwrap = {name for name in templates if name.startswith("bwrap")}
    assert set(refused) == bwrap, refused
    for name in bwrap:  # only what bubblewrap needs stands in the way
        message = refused[name]
        assert 'violates PodSecurity "restricted:latest"' in message, message
        assert 'seccompProfile.type to "Unconfined"' in message, message
        assert 'procMount to "Unmasked"' in message, message
        for field in ("allowPrivilegeEscalation", "unrestricted capabilities", "runAsNonRoot"):
            assert field not in message, message
        context = templates[name]["spec"]["containers"][0]["securityContext"]
        context["seccompProfile"] = {"type": "RuntimeDefault"}
        del context["procMount"]
        status, body = _dry_run_pod(kube, namespace, _pod_name(f"{name} rd"), templates[name])
        assert status == 201, body.get("message", body)

    # The control: the same pods without their securityContexts are refused.
    for name, template in _trainingrun_templates(namespace).items():
        template["spec"].pop("securityContext", None)
        for container in template["spec"]["containers"]:
            container.pop("securityContext", None)
        status, body = _dry_run_pod(kube, namespace, _pod_name(f"bare {name}"), template)
        message = body.get("message", "")
        assert status == 403 and 'violates PodSecurity "restricted:latest"' in message, body
        assert "allowPrivilegeEscalation != false" in message, (name, message)
        # (A pod in its own user namespace, as the bubblewrap ones, may run as root there.)
        user_ns = template["spec"].get("hostUsers") is False
        assert ("runAsNonRoot" in message) != user_ns, (name, message)
