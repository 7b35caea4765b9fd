"""The sandbox isolation story on the real node (docs/sandboxes.md, "Isolation in a cluster"):

- a SandboxTask pod, as the operator builds it, is admitted in a namespace that enforces Pod
  Security ``restricted``, and the pod is the boundary: the program in it runs as nobody with
  no capability, a seccomp filter, no privilege escalation, no token and a read-only root
  (gVisor, which would add a kernel boundary, cannot run pods here: docs/real-node.md);
- a RolloutPool replica of the cpu engine, as the operator builds it, is admitted there too
  and serves on its read-only root as the trainer image's user (uid 10001);
- the one exception, the pods that nest bubblewrap (the run's sandbox runner; trainers with
  ``sandbox.mode: local``), is refused by Pod Security ``baseline`` for the one setting it
  objects to, which is what the docs tell a platform team to allow.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

from .conftest import Kubectl, wait_for

pytestmark = [pytest.mark.real_cluster, pytest.mark.timeout(900)]

# What the untrusted program reports about the kernel it runs on.
PROBE = """
import os, platform
print("release", platform.release())
print("uid", os.getuid())
print("gid", os.getgid())
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("CapEff", "CapPrm", "CapBnd", "NoNewPrivs", "Seccomp"):
        print(key, value.strip())
token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
print("token", "present" if os.path.exists(token) else "absent")
try:
    open("/etc/probe", "w")
    print("root_write", "allowed")
except OSError:
    print("root_write", "refused")
"""


def _sandbox_pod(name: str, namespace: str) -> dict[str, Any]:
    """The operator's pod for one attempt of a SandboxTask running PROBE."""
    from posttrain.api import SandboxTask
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.sandboxtask import builders as b

    task = SandboxTask.model_validate({
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"command": ["python3", "main.py"], "files": {"main.py": PROBE},
                 "timeoutSeconds": 120,
                 "resources": {"cpu": "250m", "memory": "256Mi"}},
    })  # fmt: skip
    pod = b.build_sandbox_pod(task, OperatorConfig(image_pull_policy="Never"), 1)
    pod["metadata"].pop("ownerReferences", None)  # no SandboxTask object behind it here
    return pod


def _finished_logs(node_kubectl: Kubectl, ns: str, name: str) -> dict[str, str]:
    def phase() -> str | None:
        out = node_kubectl("get", "pod", name, "-n", ns, "-o", "jsonpath={.status.phase}").stdout
        return out if out in {"Succeeded", "Failed"} else None

    finished = wait_for(f"sandbox pod {name} to finish", phase)
    logs = node_kubectl("logs", "-n", ns, name, "-c", "sandbox").stdout
    assert finished == "Succeeded", (
        logs + node_kubectl("describe", "pod", name, "-n", ns).stdout[-3000:]
    )
    return dict(line.split(" ", 1) for line in logs.splitlines() if " " in line)


def test_the_sandbox_task_pod_is_the_boundary_in_a_restricted_namespace(
    node_kubectl: Kubectl, restricted_namespace: str
) -> None:
    """The operator's SandboxTask pod is admitted where Pod Security "restricted" is enforced,
    and the untrusted program in it holds nothing: not root, no capability, a seccomp filter,
    no way to gain privileges, no ServiceAccount token, a read-only root and no network but
    what its policy allows (this node does not enforce NetworkPolicy: docs/real-node.md)."""
    ns = restricted_namespace
    pod = _sandbox_pod("probe", ns)
    # Admitted by Pod Security "restricted" (enforced: a violation would fail the apply).
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(pod))
    seen = _finished_logs(node_kubectl, ns, pod["metadata"]["name"])
    assert seen["uid"] == "65534" and seen["gid"] == "65534", seen
    assert seen["CapEff"] == seen["CapPrm"] == seen["CapBnd"] == "0000000000000000", seen
    assert seen["NoNewPrivs"] == "1" and seen["Seccomp"] == "2", seen  # 2: a filter applies
    assert seen["token"] == "absent" and seen["root_write"] == "refused", seen
    assert seen["release"] == os.uname().release, seen  # runc: the host's kernel, shared


def test_bubblewrap_pods_are_the_one_exception_baseline_refuses(
    node_kubectl: Kubectl, node_namespace: str
) -> None:
    """The run's sandbox runner asks for exactly what bubblewrap needs (Unconfined seccomp,
    an unmasked /proc, its own user namespace); Pod Security "baseline" refuses it for the
    seccomp profile alone (an unmasked /proc is allowed in a pod with its own user namespace),
    and admits the same pod with RuntimeDefault seccomp."""
    from posttrain.api import TrainingRun
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.trainingrun.sandbox_runner import build_runner_deployment

    run = TrainingRun.model_validate({
        "metadata": {"name": "demo", "namespace": node_namespace, "uid": "u-1"},
        "spec": {"model": "smollm2-135m-instruct", "sandbox": {"mode": "runner"},
                 "domains": [{"name": "c", "dataset": "builtin:code",
                              "verifier": {"kind": "unit_tests"}}]},
    })  # fmt: skip
    spec = build_runner_deployment(run, OperatorConfig(image_pull_policy="Never"))["spec"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runner"},
           "spec": spec["template"]["spec"]}  # fmt: skip
    refused = node_kubectl("apply", "--dry-run=server", "-n", node_namespace, "-f", "-",
                           input=yaml.safe_dump(pod), check=False)  # fmt: skip
    assert refused.returncode != 0 and "violates PodSecurity" in refused.stderr, refused.stderr
    assert 'seccompProfile.type to "Unconfined"' in refused.stderr, refused.stderr
    assert "procMount" not in refused.stderr, refused.stderr
    context = pod["spec"]["containers"][0]["securityContext"]
    assert (context["procMount"], pod["spec"]["hostUsers"]) == ("Unmasked", False)
    context["seccompProfile"] = {"type": "RuntimeDefault"}
    admitted = node_kubectl("apply", "--dry-run=server", "-n", node_namespace, "-f", "-",
                            input=yaml.safe_dump(pod), check=False)  # fmt: skip
    assert admitted.returncode == 0, admitted.stderr


# What the pool's server process holds, read from inside its container (pid 1 is the server).
SERVER_PROBE = """
import os
print("uid", os.getuid())
for line in open("/proc/1/status"):
    key, _, value = line.partition(":")
    if key in ("CapEff", "NoNewPrivs", "Seccomp"):
        print(key, value.strip())
for path in ("/etc/probe", "/opt/posttrain/probe", "/tmp/probe"):
    try:
        open(path, "w").close()
        print(path, "allowed")
    except OSError:
        print(path, "refused")
"""


def test_a_cpu_pool_replica_serves_on_a_read_only_root_in_a_restricted_namespace(
    node_kubectl: Kubectl, restricted_namespace: str
) -> None:
    """The operator's cpu-engine RolloutPool pod (`posttrain serve` on the trainer image) is
    admitted where Pod Security "restricted" is enforced and works there: as uid 10001 with no
    capability and a read-only root it converts the packaged model onto its volume, passes
    its readiness probe and samples; only its emptyDirs are writable."""
    import httpx

    from posttrain.api import RolloutPool
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.rolloutpool import builders as pool_builders

    ns = restricted_namespace
    pool = RolloutPool.model_validate({
        "metadata": {"name": "cp", "namespace": ns, "uid": "u-cp"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu",
                 "resources": {"cpu": "1", "memory": "2Gi"}},
    })  # fmt: skip
    config = OperatorConfig(image_pull_policy="Never")
    template = pool_builders.build_rollout_deployment(pool, config)["spec"]["template"]
    secret = pool_builders.build_pool_token_secret(pool)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "replica", **template["metadata"]}, "spec": template["spec"]}  # fmt: skip
    for manifest in (secret, pod):
        manifest["metadata"].pop("ownerReferences", None)  # no RolloutPool object behind them
    # Admitted by Pod Security "restricted" (enforced: a violation would fail the apply).
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all([secret, pod]))

    def describe() -> str:
        return (node_kubectl("describe", "pod", "replica", "-n", ns).stdout[-4000:]
                + node_kubectl("logs", "-n", ns, "replica", "-c", "server", "--tail", "40",
                               check=False).stdout[-4000:])  # fmt: skip

    def ready() -> dict[str, Any] | None:
        body = yaml.safe_load(node_kubectl("get", "pod", "replica", "-n", ns, "-o", "yaml").stdout)
        status = body.get("status", {})
        if status.get("phase") == "Failed" or any(
            c.get("restartCount", 0) for c in status.get("containerStatuses", [])
        ):
            raise AssertionError(f"the replica failed:\n{describe()}")
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return status if conditions.get("Ready") == "True" else None

    status = wait_for("the cpu replica to become Ready", ready, 900, on_timeout=describe)
    response = httpx.post(f"http://{status['podIP']}:{pool.spec.port}/v1/completions",
                          timeout=300, json={"model": "cp", "prompt": "2 + 3 =",
                                             "max_tokens": 4, "temperature": 0.0})  # fmt: skip
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["token_ids"] and choice["finish_reason"] in ("length", "stop"), choice
    probe = node_kubectl("exec", "-n", ns, "replica", "-c", "server", "--",
                         "python3", "-c", SERVER_PROBE).stdout  # fmt: skip
    seen = dict(line.rsplit(" ", 1) for line in probe.splitlines())
    assert seen["uid"] == "10001" and seen["CapEff"] == "0000000000000000", seen
    assert seen["NoNewPrivs"] == "1" and seen["Seccomp"] == "2", seen
    assert seen["/etc/probe"] == seen["/opt/posttrain/probe"] == "refused", seen
    assert seen["/tmp/probe"] == "allowed", seen
