"""SandboxTask against the real apiserver with the operator in-process."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY

from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.shared.sandbox import SANDBOX_NETWORK_POLICY
from posttrain.telemetry import memory_exporter

from .conftest import (
    create_cr,
    get_cr,
    list_pods,
    set_pod_evicted,
    set_pod_running,
    set_pod_terminated,
    wait_for,
)

pytestmark = pytest.mark.cluster


def task_status(kube: KubeClient, namespace: str, name: str) -> dict[str, object]:
    return (get_cr(kube, "sandboxtasks", namespace, name) or {}).get("status") or {}


def task_body(name: str, **spec: object) -> dict[str, object]:
    return {
        "kind": "SandboxTask",
        "metadata": {"name": name},
        "spec": {"command": ["python", "-c", "print(1)"], "ttlSecondsAfterFinished": 3600, **spec},
    }


def test_task_creates_isolated_pod_and_reads_result(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    task = create_cr(
        kube, "sandboxtasks", namespace, task_body("t1", files={"main.py": "print(2)"})
    )
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "t1-1"), what="pod t1-1")
    # The real object: owner, isolation, result protocol.
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "SandboxTask",
        "t1",
        task["metadata"]["uid"],
    )
    assert owner["controller"] is True
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 60
    main = spec["containers"][0]
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert main["resources"]["requests"] == main["resources"]["limits"]
    policy = kube.get("networking.k8s.io/v1", "NetworkPolicy", namespace, SANDBOX_NETWORK_POLICY)
    assert policy is not None and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert get_cr(kube, "sandboxtasks", namespace, "t1")["metadata"].get("finalizers") is None

    set_pod_running(kube, namespace, "t1-1")
    wait_for(
        lambda: task_status(kube, namespace, "t1").get("phase") == "Running", what="phase Running"
    )
    result = {"exit_code": 0, "reward": 0.75, "duration_ms": 123.0, "reason": "Completed"}
    set_pod_terminated(kube, namespace, "t1-1", 0, json.dumps(result))
    status = wait_for(
        lambda: (s := task_status(kube, namespace, "t1")).get("phase") == "Succeeded" and s,
        what="phase Succeeded",
    )
    assert status["reward"] == 0.75
    assert status["durationMs"] == 123.0
    assert status["exitCode"] == 0
    assert status["podName"] == "t1-1"
    assert status["attempts"] == 1
    events = wait_for(
        lambda: kube.request(
            "GET",
            resource_path("v1", "events", namespace) + "?fieldSelector=involvedObject.name=t1",
        )[1]["items"],
        what="events",
    )
    wait_for(
        lambda: (
            "Completed"
            in {
                e["reason"]
                for e in kube.request(
                    "GET",
                    resource_path("v1", "events", namespace)
                    + "?fieldSelector=involvedObject.name=t1",
                )[1]["items"]
            }
        ),
        what="Completed event",
    )
    assert all(e["source"]["component"] == "posttrain-operator" for e in events)
    # One span per reconcile, and the Prometheus counters moved.
    spans = [
        sp
        for sp in memory_exporter().get_finished_spans()
        if sp.name == "reconcile SandboxTask" and sp.attributes.get("posttrain.object") == "t1"
    ]
    assert spans and spans[0].attributes["k8s.namespace.name"] == namespace
    assert (
        REGISTRY.get_sample_value("posttrain_operator_reconciles_total", {"kind": "SandboxTask"})
        >= 3
    )
    assert (
        REGISTRY.get_sample_value(
            "posttrain_operator_children_created_total", {"parent": "SandboxTask", "child": "Pod"}
        )
        >= 1
    )


def test_sandbox_failure_retries_then_fails(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "sandboxtasks", namespace, task_body("t2", retries=1))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "t2-1"), what="pod t2-1")
    set_pod_evicted(kube, namespace, "t2-1")
    wait_for(lambda: kube.get("v1", "Pod", namespace, "t2-2"), what="retry pod t2-2")
    # The pod is created before the status patch that counts it.
    wait_for(lambda: task_status(kube, namespace, "t2").get("attempts") == 2, what="attempts == 2")
    set_pod_evicted(kube, namespace, "t2-2")
    status = wait_for(
        lambda: (s := task_status(kube, namespace, "t2")).get("phase") == "Failed" and s,
        what="phase Failed",
    )
    assert status["reason"] == "SandboxFailed"
    assert status["attempts"] == 2
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "SandboxFailed"
    assert [p["metadata"]["name"] for p in list_pods(kube, namespace)] == ["t2-1", "t2-2"]


def test_program_failure_is_not_retried_and_scores_zero(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "sandboxtasks", namespace, task_body("t3", retries=3))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "t3-1"), what="pod t3-1")
    # FallbackToLogsOnError: a crash leaves log text, not JSON; the exit code decides.
    set_pod_terminated(kube, namespace, "t3-1", 1, "Traceback: ZeroDivisionError")
    status = wait_for(
        lambda: (s := task_status(kube, namespace, "t3")).get("phase") == "Failed" and s,
        what="phase Failed",
    )
    assert (status["exitCode"], status["reward"], status["reason"]) == (1, 0.0, "Error")
    assert status["attempts"] == 1
    assert kube.get("v1", "Pod", namespace, "t3-2") is None


def test_finished_task_deleted_after_ttl(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "sandboxtasks", namespace, task_body("t4", ttlSecondsAfterFinished=1))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "t4-1"), what="pod t4-1")
    set_pod_terminated(kube, namespace, "t4-1", 0)
    wait_for(
        lambda: get_cr(kube, "sandboxtasks", namespace, "t4") is None,
        timeout_s=20,
        what="task deleted by TTL",
    )
    # No garbage collector here, so the operator deletes the pod itself.
    assert kube.get("v1", "Pod", namespace, "t4-1") is None
