"""The product on a real node: `helm install` of the chart with the local images, the operator
in its pod, and a TrainingRun with a CPU RolloutPool that trains to Succeeded through Service
DNS, the real MinIO and the trainer's ServiceAccount; a SandboxTask in its own pod; deleting
runs and pools garbage-collects their children; `helm uninstall` removes the operator."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.realnode.cluster import RealCluster

from .conftest import Kubectl, wait_for

pytestmark = [pytest.mark.real_cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
RELEASE, SYSTEM = "pt", "posttrain-system"
SECRET = "posttrain-s3"
ARTIFACTS = "s3://posttrain/sandbox-artifacts"
NCCL_IFNAME = "eth0"
# Each Ray pod of the KubeRay run: with the pool (500m) and the operator (100m) on this 2-CPU
# node. Ray declares it as 1 CPU (the operator passes --num-cpus, rounded up).
RAY_POD_CPU = "600m"


@pytest.fixture(scope="module")
def installed(
    real_cluster: RealCluster, node_kubectl: Kubectl, node_controllers: dict[str, float]
) -> Iterator[str]:
    """The chart, installed as docs/chart.md says for an existing object store, with KubeRay
    and Kueue running (the chart's defaults `trainer.kuberay` and `trainer.kueue` on); yields
    the run namespace (Pod Security "baseline" enforced)."""
    minio = real_cluster.minio
    assert minio is not None
    run_ns = "team-a"
    node_kubectl("create", "namespace", SYSTEM)
    node_kubectl("create", "namespace", run_ns)
    node_kubectl("label", "namespace", run_ns, "pod-security.kubernetes.io/enforce=baseline")
    # Only in the release namespace, and it stays there: runs get keys of their own.
    node_kubectl("create", "secret", "generic", SECRET, "-n", SYSTEM,
                 f"--from-literal=AWS_ACCESS_KEY_ID={minio.access_key}",
                 f"--from-literal=AWS_SECRET_ACCESS_KEY={minio.secret_key}")  # fmt: skip
    helm = client_binary("helm")
    subprocess.run(
        [str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "install", RELEASE,
         str(REPO_ROOT / "charts" / "posttrain"), "--namespace", SYSTEM, "--wait",
         "--timeout", "5m", "--set", "minio.enabled=false",
         "--set", f"storage.endpoint={minio.endpoint}", "--set", f"storage.existingSecret={SECRET}",
         "--set", f"runNamespaces={{{run_ns}}}",
         # Sandbox pods upload their logs to MinIO (presigned URLs): their default-deny
         # policy lets them reach it and DNS, nothing else.
         "--set", f"sandbox.artifactsUri={ARTIFACTS}",
         "--set", f"networkPolicy.s3CIDRs={{{real_cluster.node_ip}/32}}",
         "--set", f"trainer.nccl.NCCL_SOCKET_IFNAME={NCCL_IFNAME}"],
        check=True, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    # The store's admin keys are not copied where the runs go (storage.scopedCredentials).
    assert _get(node_kubectl, run_ns, "secret", SECRET) == {}
    notes = subprocess.run(
        [str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "get", "notes", RELEASE,
         "--namespace", SYSTEM], check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "of its own from the operator" in notes and f"kubectl apply -n {run_ns} -f" in notes, (
        notes
    )
    yield run_ns
    subprocess.run([str(helm), "--kubeconfig", str(real_cluster.kubeconfig), "uninstall",
                    RELEASE, "--namespace", SYSTEM, "--wait"], check=True, timeout=300)  # fmt: skip
    # The operator pod terminates within its grace period (SIGTERM: a bounded drain, runtime.py).
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


def test_sandbox_task_runs_in_its_own_pod_and_uploads_its_log(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
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
    # The sandbox pod (network: none) uploaded its full log to MinIO.
    logs_uri = task["status"].get("logsUri") or ""
    assert logs_uri.startswith(f"{ARTIFACTS}/"), task["status"]
    assert real_cluster.minio is not None
    bucket, key = logs_uri.removeprefix("s3://").split("/", 1)
    body = real_cluster.minio.client().get_object(bucket, key).read().decode()
    assert "all tests passed" in body, body[-2000:]
    # Its default-deny policy, from the chart and the operator alike, allows DNS and the store.
    policies = _get(node_kubectl, ns, "networkpolicies")["items"]
    sandbox_policies = [p for p in policies
                        if p["spec"]["podSelector"].get("matchLabels", {}).get(
                            "posttrain.io/component") == "sandbox"]  # fmt: skip
    assert len(sandbox_policies) == 2, policies
    for policy in sandbox_policies:
        egress = policy["spec"].get("egress", [])
        assert [p["port"] for p in egress[0]["ports"]] == [53, 53], policy
        assert egress[1]["to"] == [{"ipBlock": {"cidr": f"{real_cluster.node_ip}/32"}}], policy


def test_training_run_with_a_cpu_pool_survives_a_killed_trainer_is_evaluated_and_collected(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    """dev-run with a checkpoint every step and a separate evaluator Job. Its trainer container
    is killed (SIGKILL through containerd) once a checkpoint exists: the operator starts gang 1,
    which resumes from that checkpoint and finishes; the evaluator Job runs to Complete under
    the real Job controller; deleting the run collects everything."""
    ns = installed
    manifests = list(yaml.safe_load_all((REPO_ROOT / "examples" / "dev-run.yaml").read_text()))
    for doc in manifests:
        if doc["kind"] == "TrainingRun":
            # A checkpoint every step, only the newest kept: each is ~2 GB for this model
            # (optimizer state included), and the disk also holds the images and containerd.
            doc["spec"]["checkpoint"] = {"everySteps": 1, "keepLast": 1}
            # The evaluator runs until the final checkpoint: sized with the trainer's CPU
            # it would take the room the restarted trainer needs on this 2-core node (100m
            # operator + 500m pool + 1 trainer + 400m evaluator = 2 CPUs).
            doc["spec"]["evaluation"]["inline"] = False
            doc["spec"]["evaluation"]["resources"] = {"cpu": "400m"}
            doc["spec"]["resources"]["nccl"] = {"NCCL_DEBUG": "WARN"}
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,jobs,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("get", "events", "-n", ns).stdout[-6000:])  # fmt: skip

    def run_status() -> dict[str, Any]:
        status: dict[str, Any] = _get(node_kubectl, ns, "trainingrun", "dev-run").get("status", {})
        return status

    # Kill the trainer once a checkpoint exists and before the last step.
    checkpointed = wait_for(
        "dev-run's first checkpoint",
        lambda: (st := run_status()).get("lastCheckpoint") and st,
        timeout_s=1800,
        on_timeout=describe,
    )  # fmt: skip
    assert 0 < checkpointed.get("step", 0) < 3, checkpointed
    (pod,) = _get(node_kubectl, ns, "pods", "-l", "posttrain.io/component=trainer")["items"]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    # NCCL settings from the chart (trainer.nccl) and the run (resources.nccl).
    assert env["NCCL_SOCKET_IFNAME"] == NCCL_IFNAME and env["NCCL_DEBUG"] == "WARN", env
    # Its storage keys are its own (storage.scopedCredentials), not the store's admin keys.
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
            for e in pod["spec"]["containers"][0]["env"]
            if "secretKeyRef" in (e.get("valueFrom") or {})}  # fmt: skip
    assert (
        refs["AWS_SECRET_ACCESS_KEY"] == f"{pod['metadata']['labels']['posttrain.io/run']}-run-s3"
    )
    (container,) = pod["status"]["containerStatuses"]
    container_id = container["containerID"].removeprefix("containerd://")
    assert real_cluster.containerd is not None
    killed = real_cluster.containerd.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)
    assert killed.returncode == 0, killed.stderr

    run = wait_for(
        "dev-run to finish",
        lambda: (r := _get(node_kubectl, ns, "trainingrun", "dev-run"))
        .get("status", {}).get("phase") in {"Succeeded", "Failed"} and r,
        timeout_s=2400,
        on_timeout=describe,
    )  # fmt: skip
    assert run["status"]["phase"] == "Succeeded", (run["status"], describe())
    assert run["status"]["restarts"] == 1, run["status"]
    wide = node_kubectl("get", "tr", "dev-run", "-n", ns, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    columns = dict(zip(header.split(), row.split(), strict=False))
    assert columns["PHASE"] == "Succeeded" and columns["STEP"] == columns["MAX"] == "3", wide
    # Gang 1's trainer resumed from the checkpoint gang 0 left, not from step 0.
    (resumed,) = _get(node_kubectl, ns, "pods", "-l", "posttrain.io/gang=1")["items"]
    logs = node_kubectl("logs", "-n", ns, resumed["metadata"]["name"]).stdout
    match = re.search(r"resuming from checkpoint \S+ \(step (\d+)\)", logs)
    assert match and int(match.group(1)) >= checkpointed["step"], logs[-3000:]
    assert "step 3" in logs or "step=3" in logs, logs[-3000:]

    # The evaluator Job (evaluation.inline: false) runs to Complete under the Job controller.
    job = wait_for(
        "the evaluator Job to complete",
        lambda: (j := _get(node_kubectl, ns, "job", "dev-run-evaluator"))
        and any(c["type"] in {"Complete", "Failed"} and c["status"] == "True"
                for c in j.get("status", {}).get("conditions", [])) and j,
        timeout_s=1200,
        on_timeout=describe,
    )  # fmt: skip
    conditions = {c["type"]: c["status"] for c in job["status"]["conditions"]}
    assert conditions.get("Complete") == "True", (job["status"], describe())

    # Every pod that talks to the object store is one the bundled MinIO's NetworkPolicy admits.
    _check_minio_policy_admits(node_kubectl, real_cluster, ns)

    # Checkpoints and the evaluator's reports went to MinIO under the run's prefix.
    assert real_cluster.minio is not None
    client = real_cluster.minio.client()
    keys = [o.object_name for o in client.list_objects("posttrain", f"runs/{ns}/dev-run/",
                                                       recursive=True)]  # fmt: skip
    assert any("checkpoints/" in k for k in keys), keys[:30]
    assert any("reports/eval/" in k for k in keys), keys[:50]
    for key in keys:
        client.remove_object("posttrain", key)
    # Deleting the run and the pool: the garbage collector removes what the operator made.
    node_kubectl("delete", "trainingrun", "dev-run", "-n", ns, "--wait=true", timeout=300)
    node_kubectl("delete", "rolloutpool", "dev-pool", "-n", ns, "--wait=true", timeout=300)
    wait_for(
        "the run's and pool's children to be collected",
        lambda: not _get(node_kubectl, ns, "deployments,pods,configmaps,services,jobs",
                         "-l", "posttrain.io/run=dev-run").get("items")
        and not _get(node_kubectl, ns, "deployments").get("items"),
        timeout_s=300,
        on_timeout=describe,
    )  # fmt: skip


def _label_selector(selector: dict[str, Any]) -> str:
    """A NetworkPolicy podSelector as kubectl's -l syntax (matchLabels, In and Exists)."""
    terms = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] in {"In", "Exists"}, expr
        values = ",".join(expr.get("values", []))
        terms.append(f"{expr['key']} in ({values})" if expr["operator"] == "In" else expr["key"])
    return ",".join(terms)


def _check_minio_policy_admits(node_kubectl: Kubectl, real_cluster: RealCluster, ns: str) -> None:
    """The chart's MinIO NetworkPolicy (rendered for the bundled MinIO) selects, by the
    apiserver's own label matching, every pod here that reads or writes S3: the trainer, the
    rollout replica, the evaluator and the sandbox pods. Enforcement needs a policy engine
    this node lacks (docs/real-node.md); the selectors are what such an engine would apply."""
    helm = client_binary("helm")
    rendered = subprocess.run(
        [str(helm), "template", RELEASE, str(REPO_ROOT / "charts" / "posttrain"),
         "--namespace", SYSTEM, "--set", "minio.enabled=true"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    (policy,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "NetworkPolicy"
                 and d["spec"]["podSelector"]["matchLabels"].get(
                     "app.kubernetes.io/component") == "minio"]  # fmt: skip
    admitted: set[str] = set()
    for peer in policy["spec"]["ingress"][0]["from"]:
        if "namespaceSelector" not in peer:
            continue  # the operator, in the release namespace
        selected = _get(node_kubectl, ns, "pods", "-l", _label_selector(peer["podSelector"]))
        admitted |= {p["metadata"]["name"] for p in selected["items"]}
    users = _get(node_kubectl, ns, "pods", "-l",
                 "posttrain.io/component in (trainer,rollout,evaluator,sandbox)")["items"]  # fmt: skip
    components = {p["metadata"]["labels"]["posttrain.io/component"] for p in users}
    assert {"trainer", "rollout", "evaluator", "sandbox"} <= components, components
    everyone = {p["metadata"]["name"] for p in _get(node_kubectl, ns, "pods")["items"]}
    talking = {p["metadata"]["name"] for p in users}
    assert talking <= admitted, (talking - admitted, everyone)


def test_kueue_admits_a_run_within_quota_and_holds_one_beyond_it(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    """The real Kueue controller (built from sigs.k8s.io/kueue v0.17.0) decides: a run in a
    LocalQueue whose ClusterQueue has room is admitted and its trainer pod starts; a run in a
    LocalQueue whose ClusterQueue is too small waits with no pods and Kueue's own message."""
    ns = installed
    queues = list(yaml.safe_load_all(
        (REPO_ROOT / "examples" / "kubernetes" / "kueue-queues.yaml").read_text()))  # fmt: skip
    tiny = json.loads(json.dumps([q for q in queues if q["kind"] != "ResourceFlavor"]))
    for doc in tiny:
        doc["metadata"]["name"] = "tiny"
        if doc["kind"] == "ClusterQueue":
            doc["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] = "100m"
        else:
            doc["spec"]["clusterQueue"] = "tiny"
    kueue_log = real_cluster.workdir / "controllers" / "kueue.log"
    # Kueue's own webhooks admit its kinds (reached through the Service, via kube-proxy).
    wait_for(
        "Kueue's webhooks to accept the queues",
        lambda: node_kubectl("apply", "-n", ns, "-f", "-", check=False,
                             input=yaml.safe_dump_all([*queues, *tiny])).returncode == 0,
        timeout_s=120,
        on_timeout=lambda: (node_kubectl("apply", "-n", ns, "-f", "-", check=False,
                                         input=yaml.safe_dump_all([*queues, *tiny])).stderr
                            + kueue_log.read_text()[-3000:]),
    )  # fmt: skip

    def run(name: str, queue: str) -> dict[str, Any]:
        doc = yaml.safe_load((REPO_ROOT / "examples" / "kueue-run.yaml").read_text())
        doc["metadata"] = {"name": name, "labels": {"kueue.x-k8s.io/queue-name": queue}}
        doc["spec"]["rollout"] = {"endpoints": ["http://127.0.0.1:9"]}  # never sampled here
        doc["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 0, "cpu": "200m",
                                    "memory": "1Gi"}  # fmt: skip
        return doc

    node_kubectl("apply", "-n", ns, "-f", "-",
                 input=yaml.safe_dump_all([run("kq-fits", "team-a"), run("kq-waits", "tiny")]))  # fmt: skip

    def describe() -> str:
        return (node_kubectl("get", "tr,workloads,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("get", "clusterqueues", "-o", "yaml").stdout[-3000:]
                + kueue_log.read_text()[-3000:])  # fmt: skip

    def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
        conditions = obj.get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), {})

    admitted = wait_for(
        "Kueue to admit kq-fits",
        lambda: condition(w := _get(node_kubectl, ns, "workload", "trainingrun-kq-fits"),
                          "Admitted").get("status") == "True" and w,
        timeout_s=300, on_timeout=describe,
    )  # fmt: skip
    assert admitted["status"]["admission"]["clusterQueue"] == "posttrain", admitted["status"]
    wait_for(
        "kq-fits's trainer pod",
        lambda: _get(node_kubectl, ns, "pods", "-l", "posttrain.io/run=kq-fits").get("items"),
        timeout_s=300, on_timeout=describe,
    )  # fmt: skip
    suspended = condition(_get(node_kubectl, ns, "trainingrun", "kq-fits"), "Suspended")
    assert (suspended.get("status"), suspended.get("reason")) == ("False", "Admitted"), suspended
    waiting = wait_for(
        "Kueue's verdict on kq-waits",
        lambda: (condition(w := _get(node_kubectl, ns, "workload", "trainingrun-kq-waits"),
                           "QuotaReserved").get("message") and w),
        timeout_s=300, on_timeout=describe,
    )  # fmt: skip
    assert condition(waiting, "Admitted").get("status") != "True", waiting["status"]
    status = _get(node_kubectl, ns, "trainingrun", "kq-waits")["status"]
    assert status["phase"] == "Pending", status
    assert "insufficient" in status.get("message", "").lower(), status
    assert not _get(node_kubectl, ns, "pods", "-l", "posttrain.io/run=kq-waits").get("items")
    node_kubectl("delete", "trainingrun", "kq-fits", "kq-waits", "-n", ns, "--wait=true",
                 timeout=300)  # fmt: skip
    node_kubectl("delete", "-n", ns, "-f", "-", input=yaml.safe_dump_all([*queues, *tiny]),
                 check=False)  # fmt: skip


def test_multi_node_run_trains_on_a_ray_cluster_of_the_real_kuberay_operator(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    """A two-node CPU TrainingRun becomes a RayCluster that the real KubeRay operator (built from
    ray-project/kuberay/ray-operator v1.5.0) turns into a head pod and a worker pod; the
    trainer drives two Gloo ranks through Ray Train and the run reaches Succeeded."""
    ns = installed
    manifests = list(yaml.safe_load_all((REPO_ROOT / "examples" / "dev-run.yaml").read_text()))
    for doc in manifests:
        if doc["kind"] == "TrainingRun":
            doc["metadata"]["name"] = "ray-run"
            doc["spec"]["algorithm"]["maxSteps"] = 1
            doc["spec"]["resources"] = {"nodes": 2, "gpusPerNode": 0, "cpu": RAY_POD_CPU,
                                        "memory": "4Gi"}  # fmt: skip
            doc["spec"]["checkpoint"] = {"everySteps": 1, "keepLast": 1}
            doc["spec"]["evaluation"]["inline"] = True
        else:
            doc["metadata"]["name"] = "ray-pool"
    manifests[1]["spec"]["rollout"]["pool"] = "ray-pool"
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,rayclusters,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("get", "events", "-n", ns).stdout[-6000:])  # fmt: skip

    cluster = wait_for(
        "KubeRay to report ray-run-g0 ready",
        lambda: (c := _get(node_kubectl, ns, "raycluster", "ray-run-g0"))
        .get("status", {}).get("state") == "ready" and c,
        timeout_s=900, on_timeout=describe,
    )  # fmt: skip
    pods = _get(node_kubectl, ns, "pods", "-l", "ray.io/cluster=ray-run-g0")["items"]
    types = sorted(p["metadata"]["labels"]["ray.io/node-type"] for p in pods)
    assert types == ["head", "worker"], (types, cluster["status"])
    run = wait_for(
        "ray-run to finish",
        lambda: (r := _get(node_kubectl, ns, "trainingrun", "ray-run"))
        .get("status", {}).get("phase") in {"Succeeded", "Failed"} and r,
        timeout_s=2400, on_timeout=describe,
    )  # fmt: skip
    assert run["status"]["phase"] == "Succeeded", (run["status"], describe())
    node_kubectl("delete", "trainingrun", "ray-run", "-n", ns, "--wait=true", timeout=300)
    node_kubectl("delete", "rolloutpool", "ray-pool", "-n", ns, "--wait=true", timeout=300)
    wait_for(
        "the RayCluster and its pods to be collected",
        lambda: not _get(node_kubectl, ns, "rayclusters,pods", "-l", "posttrain.io/run=ray-run")
        .get("items"),
        timeout_s=300, on_timeout=describe,
    )  # fmt: skip
