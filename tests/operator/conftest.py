"""Fixtures for operator tests: the real operator in-process against the real apiserver,
and a "test kubelet" that moves pods through their lifecycle by patching pod status."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.process import wait_for as wait_for  # re-exported for the tests here
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, load_credentials, resource_path
from posttrain.operator.runtime import OperatorThread

GV = "posttrain.io/v1alpha1"


@pytest.fixture
def operator_config(kubeconfig: Path, namespace: str) -> OperatorConfig:
    return OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint="127.0.0.1:9000",
        max_workers=16,
    )


@pytest.fixture
def operator(crds_installed: None, operator_config: OperatorConfig) -> Iterator[OperatorThread]:
    op = OperatorThread(operator_config).start()
    yield op
    op.stop()


@pytest.fixture(scope="session")
def kube(kubeconfig: Path) -> Iterator[KubeClient]:
    """A raw REST client as the cluster admin (the test's own hands)."""
    client = KubeClient(load_credentials(str(kubeconfig)), pool_size=32)
    yield client
    client.close()


def cr_path(plural: str, namespace: str, name: str = "") -> str:
    return resource_path(GV, plural, namespace, name)


def create_cr(
    kube: KubeClient, plural: str, namespace: str, body: dict[str, Any]
) -> dict[str, Any]:
    body = {"apiVersion": GV, **body}
    body["metadata"] = {**body["metadata"], "namespace": namespace}
    return kube.request("POST", cr_path(plural, namespace), body)[1]


def get_cr(kube: KubeClient, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
    status, data = kube.request("GET", cr_path(plural, namespace, name), ok=(200, 404))
    return data if status == 200 else None


def run_body(name: str, **spec: object) -> dict[str, object]:
    """A minimal valid TrainingRun; ``spec`` adds or overrides spec fields."""
    return {
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": "smollm2-135m-instruct",
            "domains": [
                {"name": "math", "dataset": "builtin:arith", "verifier": {"kind": "numeric"}}
            ],
            **spec,
        },
    }


def run_status(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    body = get_cr(kube, "trainingruns", namespace, name)
    assert body is not None
    return body.get("status") or {}


def list_pods(kube: KubeClient, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    path = resource_path("v1", "pods", namespace)
    if selector:
        path += f"?labelSelector={selector}"
    return kube.request("GET", path)[1]["items"]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_pod_running(kube: KubeClient, namespace: str, name: str, ready: bool = True) -> None:
    """Play the kubelet: the pod started."""
    status = {
        "phase": "Running",
        "startTime": _now(),
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {
                "name": "main",
                "ready": ready,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {"running": {"startedAt": _now()}},
            }
        ],
    }
    kube.patch(resource_path("v1", "pods", namespace, name), {"status": status}, "status")


def set_pod_terminated(
    kube: KubeClient,
    namespace: str,
    name: str,
    exit_code: int,
    message: str = "",
    reason: str | None = None,
    phase: str | None = None,
) -> None:
    """Play the kubelet: the main container ended with ``exit_code`` and a termination message;
    the pod's phase follows from it unless ``phase`` says otherwise (the kubelet may report the
    terminated container while the pod is still Running)."""
    terminated = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "message": message,
        "startedAt": "2026-01-01T00:00:00Z",
        "finishedAt": "2026-01-01T00:00:02Z",
    }
    status = {
        "phase": phase or ("Succeeded" if exit_code == 0 else "Failed"),
        "containerStatuses": [
            {
                "name": "main",
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {"terminated": terminated},
            }
        ],
    }
    kube.patch(resource_path("v1", "pods", namespace, name), {"status": status}, "status")


def set_pod_evicted(kube: KubeClient, namespace: str, name: str) -> None:
    """Play the kubelet: the sandbox itself failed (evicted before the program ran)."""
    status = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": "The node was low on resource: memory.",
    }
    kube.patch(resource_path("v1", "pods", namespace, name), {"status": status}, "status")
