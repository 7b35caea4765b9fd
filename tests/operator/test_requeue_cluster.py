"""Per-object requeue against the real apiserver: a child create that the apiserver refuses
(a real ValidatingAdmissionPolicy denying it) makes the owner's reconcile fail; the operator
retries that object with growing delays, and once the refusal is lifted the child appears
within one backoff step, with the resync far away (600 s), for every kind."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from prometheus_client import REGISTRY

from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, list_pods, run_body, wait_for

pytestmark = pytest.mark.cluster

VAP = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAP_BINDING = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
RESYNC_SECONDS = 600.0


def _refused(kube: KubeClient, namespace: str) -> bool:
    """Whether the apiserver now refuses a pod create here (a dry run: nothing is stored)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    path = kube.path_of(pod) + "?dryRun=All"
    status, _ = kube.request("POST", path, pod, ok=(200, 201, 403, 422))
    return status in (403, 422)


@contextmanager
def refusing(
    kube: KubeClient, namespace: str, group: str, resource: str
) -> Iterator[Callable[[], None]]:
    """Make the apiserver refuse creates of ``resource`` in ``namespace``; yields ``lift``,
    which ends the refusal (also done on exit)."""
    name = f"refuse-{namespace}"
    kube.request(
        "POST",
        VAP,
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [g],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE"],
                            "resources": [r],
                        }
                        for g, r in {(group, resource), ("", "pods")}  # pods: the probe
                    ]
                },
                "validations": [{"expression": "false", "message": "refused by the test"}],
            },
        },
    )
    kube.request(
        "POST",
        VAP_BINDING,
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": namespace},
                    }
                },
            },
        },
    )
    wait_for(lambda: _refused(kube, namespace), what="the policy in force")

    def lift() -> None:
        kube.request("DELETE", f"{VAP_BINDING}/{name}", ok=(200, 404))
        kube.request("DELETE", f"{VAP}/{name}", ok=(200, 404))
        wait_for(lambda: not _refused(kube, namespace), what="the policy lifted")

    try:
        yield lift
    finally:
        lift()


def _requeues(kind: str) -> float:
    return REGISTRY.get_sample_value("posttrain_operator_requeues_total", {"kind": kind}) or 0.0


def _pool(name: str) -> dict[str, Any]:
    return {
        "kind": "RolloutPool",
        "metadata": {"name": name},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1, "port": 8000},
    }


# kind, plural, body, refused (group, resource), the child that shows the retry succeeded
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, str], Callable[[KubeClient, str], Any]]] = {
    "SandboxTask": (
        "sandboxtasks",
        {"kind": "SandboxTask", "metadata": {"name": "x"}, "spec": {"command": ["true"]}},
        ("", "pods"),
        lambda kube, ns: kube.get("v1", "Pod", ns, "x-1"),
    ),
    "TrainingRun": (
        "trainingruns",
        {**run_body("x")},
        ("", "pods"),
        lambda kube, ns: kube.get("v1", "Pod", ns, "x-g0-0"),
    ),
    "RolloutPool": (
        "rolloutpools",
        _pool("x"),
        ("apps", "deployments"),
        lambda kube, ns: kube.get("apps/v1", "Deployment", ns, "x"),
    ),
    "SandboxWarmPool": (
        "sandboxwarmpools",
        {"kind": "SandboxWarmPool", "metadata": {"name": "x"}, "spec": {"replicas": 1}},
        ("", "pods"),
        lambda kube, ns: list_pods(kube, ns, "posttrain.io/warm-pool=x"),
    ),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_a_refused_child_create_is_retried_with_backoff_long_before_the_resync(
    kind: str,
    crds_installed: None,
    kubeconfig: Any,
    kube: KubeClient,
    namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plural, body, (group, resource), child = CASES[kind]
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=RESYNC_SECONDS,
        s3_endpoint="127.0.0.1:9000",
        max_workers=8,
    )
    requeued_before = _requeues(kind)
    caplog.set_level(logging.WARNING, logger="posttrain.operator.shared.requeue")
    with refusing(kube, namespace, group, resource) as lift, OperatorThread(config) as op:
        requeue = op.controller.state.requeue
        create_cr(kube, plural, namespace, body)
        # Failures at ~0 s, ~1 s and ~3 s: the retries come 1 s, then 2 s apart.
        wait_for(
            lambda: requeue.failures(kind, namespace, "x") >= 3, timeout_s=20, what="3 failures"
        )
        assert not child(kube, namespace)
        assert requeue.pending(kind, namespace, "x")  # exactly one retry waits (the next: 4 s)
        assert _requeues(kind) - requeued_before >= 3
        lifted = time.monotonic()
        lift()
        wait_for(
            lambda: child(kube, namespace), timeout_s=20, what=f"{kind}'s child after the retry"
        )
        took = time.monotonic() - lifted
        wait_for(lambda: requeue.failures(kind, namespace, "x") == 0, what="backoff reset")
        assert not requeue.pending(kind, namespace, "x")
    # One backoff step (<= 8 s here, 4 s typically), far below the 600 s resync.
    assert took < 15, took
    retries = [r.getMessage() for r in caplog.records if f"{kind} {namespace}/x" in r.getMessage()]
    assert any("retry 1 in 1.0 s" in m for m in retries), retries
    assert any("retry 2 in 2.0 s" in m for m in retries), retries
