"""The operator container exactly as the chart's Deployment starts it (its command, its
ConfigMap environment, the pod name as POD_NAME, a ServiceAccount token), run as two processes
against the real apiserver: the liveness endpoint the probes hit answers, and two replicas
elect a leader on the chart's Lease so that exactly one reconciles and the standby takes over
when the active one stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.process import free_port, wait_for

from .conftest import CHART_DIR, REPO_ROOT, Helm
from .test_rbac_cluster import write_token_kubeconfig

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    return wait_for(predicate, timeout_s, what, interval_s=0.2)


def healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class OperatorPod:
    """One replica: the Deployment's command in a subprocess with the pod's environment."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.health_port = free_port()
        env = {**env, "POD_NAME": name, "POSTTRAIN_OPERATOR_LIVENESS_PORT": str(self.health_port)}
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        """SIGTERM, as the kubelet sends; a leader releases its Lease on the way out."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


@pytest.fixture
def operator_pods(
    helm: Helm, kubectl: Any, kubeconfig: Path, namespace: str, release: str, tmp_path: Path
) -> Iterator[Callable[[str], OperatorPod]]:
    helm(
        "install",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--set",
        f"operator.watchNamespaces={{{namespace}}}",
        "--set",
        "operator.replicas=2",
    )
    full = f"{release}-posttrain"
    deployment = json.loads(
        kubectl("get", "deployment", f"{full}-operator", "-n", namespace, "-o", "json").stdout
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    config = json.loads(
        kubectl("get", "configmap", f"{full}-operator", "-n", namespace, "-o", "json").stdout
    )["data"]
    credentials = tmp_path / "s3"
    credentials.mkdir()
    (credentials / "accesskey").write_text("posttrain")
    (credentials / "secretkey").write_text("not-used-here")
    env = {
        # The image's PATH: posttrain and python from this venv.
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        # The tree under test (a worktree's PYTHONPATH), not only the venv's install.
        **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
        **config,
        "POSTTRAIN_OPERATOR_KUBECONFIG": str(
            write_token_kubeconfig(kubectl, kubeconfig, namespace, full, tmp_path / "token")
        ),
        "POSTTRAIN_OPERATOR_METRICS_PORT": "0",
        "POSTTRAIN_S3_CREDENTIALS_DIR": str(credentials),
        # No MinIO runs here to mint per-run users in (tests/operator/
        # test_storage_credentials_cluster.py covers that path).
        "POSTTRAIN_OPERATOR_S3_SCOPED_CREDENTIALS": "false",
    }
    command = [*container["command"], *container.get("args", [])]
    pods: list[OperatorPod] = []

    def start(name: str) -> OperatorPod:
        pod = OperatorPod(name, command, env, tmp_path / f"{name}.log")
        pods.append(pod)
        return pod

    yield start
    for pod in pods:
        pod.stop()


def test_two_replicas_one_active_then_failover(
    operator_pods: Callable[[str], OperatorPod], kubectl: Any, namespace: str, release: str
) -> None:
    first, second = operator_pods(f"{release}-op-a"), operator_pods(f"{release}-op-b")
    for pod in (first, second):
        wait_until(lambda pod=pod: healthz(pod.health_port), f"{pod.name} /healthz")

    def holder() -> str:
        result = kubectl(
            "get",
            "lease",
            f"{release}-posttrain",
            "-n",
            namespace,
            "-o",
            "jsonpath={.spec.holderIdentity}",
            check=False,
        )
        return result.stdout.strip() if result.returncode == 0 else ""

    # The pod name is the identity in the Lease (`kubectl get lease` shows who works).
    leader = wait_until(holder, "a leader in the Lease")
    assert leader in {first.name, second.name}, leader
    active, standby = (first, second) if leader == first.name else (second, first)

    kubectl("apply", "-n", namespace, "-f", str(REPO_ROOT / "examples" / "sandbox-task.yaml"))

    def task_pods() -> list[str]:
        return kubectl(
            "get", "pods", "-n", namespace, "-l", "posttrain.io/task=add-two-numbers", "-o", "name"
        ).stdout.split()

    wait_until(task_pods, "the SandboxTask's pod")
    assert task_pods() == ["pod/add-two-numbers-1"]
    # The standby never led.
    assert holder() == active.name
    assert "acquired by" not in standby.output(), standby.output()[-3000:]

    active.stop()
    # A clean stop released the Lease: the standby takes it within a retry period or two,
    # without waiting out the lease duration.
    wait_until(lambda: holder() == standby.name, "the standby to take over", timeout_s=10)
    kubectl("apply", "-n", namespace, "-f", str(REPO_ROOT / "examples" / "rollout-pool.yaml"))
    wait_until(
        lambda: (
            kubectl("get", "deployment", "smollm2-pool", "-n", namespace, check=False).returncode
            == 0
        ),
        "the new active replica to reconcile a new RolloutPool",
    )
