"""The product on a real node: `helm install` of the chart with the local images, the operator
in its pod, and a TrainingRun with a CPU RolloutPool that trains to Succeeded through Service
DNS, the real MinIO and the trainer's ServiceAccount; a SandboxTask in its own pod; deleting
runs and pools garbage-collects their children; `helm uninstall` removes the operator."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.realnode.cluster import RealCluster

from .conftest import Kubectl

pytestmark = [pytest.mark.real_cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
RELEASE, SYSTEM = "pt", "posttrain-system"
SECRET = "posttrain-s3"


def wait_for(what: str, predicate: Any, timeout_s: float, on_timeout: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    next_report = time.monotonic() + 60
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if time.monotonic() > next_report:
            print(f"still waiting for {what}...", flush=True)
            next_report += 60
        time.sleep(1)
    detail = on_timeout() if on_timeout else ""
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{detail}")


@pytest.fixture(scope="module")
def installed(real_cluster: RealCluster, node_kubectl: Kubectl) -> Iterator[str]:
    """The chart, installed as docs/chart.md says for an existing object store; yields the
    run namespace (Pod Security "baseline" enforced)."""
    minio = real_cluster.minio
    assert minio is not None
    run_ns = "team-a"
    node_kubectl("create", "namespace", SYSTEM)
    node_kubectl("create", "namespace", run_ns)
    node_kubectl("label", "namespace", run_ns, "pod-security.kubernetes.io/enforce=baseline")
    for ns in (SYSTEM, run_ns):
        node_kubectl("create", "secret", "generic", SECRET, "-n", ns,
                     f"--from-literal=AWS_ACCESS_KEY_ID={minio.access_key}",
                     f"--from-literal=AWS_SECRET_ACCESS_KEY={minio.secret_key}")  # fmt: skip
    helm = client_binary("helm")
    subprocess.run(
        [str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "install", RELEASE,
         str(REPO_ROOT / "charts" / "posttrain"), "--namespace", SYSTEM, "--wait",
         "--timeout", "5m", "--set", "minio.enabled=false",
         "--set", f"storage.endpoint={minio.endpoint}", "--set", f"storage.existingSecret={SECRET}",
         "--set", f"runNamespaces={{{run_ns}}}",
         # No KubeRay or Kueue on this node (their CRDs are absent): the operator skips them.
         "--set", "trainer.kuberay=false", "--set", "trainer.kueue=false"],
        check=True, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    yield run_ns
    subprocess.run([str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "uninstall",
                    RELEASE, "--namespace", SYSTEM, "--wait"], check=True, timeout=300)  # fmt: skip
    # The operator pod terminates within its grace period (Kopf finishes in-flight handlers).
    wait_for(
        "the operator pod to go",
        lambda: "operator" not in node_kubectl("get", "pods", "-n", SYSTEM, "-o", "name").stdout,
        timeout_s=120,
    )


def _get(node_kubectl: Kubectl, ns: str, *what: str) -> dict[str, Any]:
    result = node_kubectl("get", *what, "-n", ns, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def test_operator_pod_runs_the_image_with_the_charts_probes(
    installed: str, node_kubectl: Kubectl
) -> None:
    pods = _get(node_kubectl, SYSTEM, "pods", "-l", "app.kubernetes.io/component=operator")
    (pod,) = pods["items"]
    (container,) = pod["status"]["containerStatuses"]
    assert container["ready"] and container["image"] == "ghcr.io/posttrain/operator:0.1.0"
    logs = node_kubectl("logs", "-n", SYSTEM, pod["metadata"]["name"]).stdout
    assert "Traceback" not in logs, logs[-3000:]


def test_sandbox_task_runs_in_its_own_pod(installed: str, node_kubectl: Kubectl) -> None:
    ns = installed
    node_kubectl("apply", "-n", ns, "-f", str(REPO_ROOT / "examples" / "sandbox-task.yaml"))
    task = wait_for(
        "the SandboxTask to finish",
        lambda: (t := _get(node_kubectl, ns, "sandboxtask", "add-two-numbers"))
        .get("status", {}).get("phase") in {"Succeeded", "Failed"} and t,
        timeout_s=300,
        on_timeout=lambda: node_kubectl("describe", "sandboxtask,pods", "-n", ns).stdout[-4000:],
    )  # fmt: skip
    assert task["status"]["phase"] == "Succeeded", task["status"]
    assert task["status"].get("reward") == 1.0, task["status"]


def test_training_run_with_a_cpu_pool_trains_to_succeeded_and_collects_its_children(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    ns = installed
    manifests = list(yaml.safe_load_all((REPO_ROOT / "examples" / "dev-run.yaml").read_text()))
    for doc in manifests:
        if doc["kind"] == "TrainingRun":
            # One checkpoint, at the end: each is ~2 GB for this model (optimizer state
            # included), and the disk also holds the images and the node's containerd.
            doc["spec"]["checkpoint"] = {"everySteps": 3, "keepLast": 1}
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("get", "events", "-n", ns).stdout[-6000:])  # fmt: skip

    run = wait_for(
        "dev-run to finish",
        lambda: (r := _get(node_kubectl, ns, "trainingrun", "dev-run"))
        .get("status", {}).get("phase") in {"Succeeded", "Failed"} and r,
        timeout_s=2400,
        on_timeout=describe,
    )  # fmt: skip
    assert run["status"]["phase"] == "Succeeded", (run["status"], describe())
    wide = node_kubectl("get", "tr", "dev-run", "-n", ns, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    columns = dict(zip(header.split(), row.split(), strict=False))
    assert columns["PHASE"] == "Succeeded" and columns["STEP"] == columns["MAX"] == "3", wide
    trainer_pods = _get(node_kubectl, ns, "pods", "-l", "posttrain.io/component=trainer")
    assert trainer_pods["items"], describe()
    logs = node_kubectl("logs", "-n", ns, trainer_pods["items"][0]["metadata"]["name"]).stdout
    assert "step 3" in logs or "step=3" in logs, logs[-3000:]
    # Checkpoints and the report went to MinIO under the run's prefix.
    assert real_cluster.minio is not None
    client = real_cluster.minio.client()
    keys = [o.object_name for o in client.list_objects("posttrain", f"runs/{ns}/dev-run/",
                                                       recursive=True)]  # fmt: skip
    assert any("checkpoints/" in k for k in keys), keys[:30]
    for key in keys:
        client.remove_object("posttrain", key)
    # Deleting the run and the pool: the garbage collector removes what the operator made.
    node_kubectl("delete", "trainingrun", "dev-run", "-n", ns, "--wait=true", timeout=300)
    node_kubectl("delete", "rolloutpool", "dev-pool", "-n", ns, "--wait=true", timeout=300)
    wait_for(
        "the run's and pool's children to be collected",
        lambda: not _get(node_kubectl, ns, "deployments,pods,configmaps,services",
                         "-l", "posttrain.io/run=dev-run").get("items")
        and not _get(node_kubectl, ns, "deployments").get("items"),
        timeout_s=300,
        on_timeout=describe,
    )  # fmt: skip
