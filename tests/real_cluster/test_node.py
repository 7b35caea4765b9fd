"""The real node itself: upstream components run real containers from the project's images,
with what a platform's cluster enforces (users, read-only roots, probes, DNS, Services, the
garbage collector), and pod traffic never leaves the machine."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest
import yaml

from posttrain.devenv.realnode.cluster import RealCluster
from posttrain.devenv.realnode.network import FORWARD_CHAIN

from ..images.podman import image_ref
from .conftest import Kubectl

pytestmark = [pytest.mark.real_cluster, pytest.mark.timeout(900)]

RESTRICTED = {
    "runAsNonRoot": True,
    "runAsUser": 65534,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def wait_for(what: str, predicate: Any, timeout_s: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_node_is_ready_with_the_pinned_kubelet_and_containerd(node_api: Any) -> None:
    from kubernetes import client

    (node,) = client.CoreV1Api(node_api).list_node().items
    info = node.status.node_info
    assert info.kubelet_version == "v1.36.3"
    assert info.container_runtime_version.startswith("containerd://1.")
    ready = {c.type: c.status for c in node.status.conditions}
    assert ready["Ready"] == "True", ready


def test_web_service_by_name_probes_logs_exec_and_garbage_collection(
    node_kubectl: Kubectl, node_namespace: str, node_api: Any
) -> None:
    """A Deployment (the real controller) of a read-only, non-root server with an HTTP
    readiness probe, reached through its Service by DNS name from another pod; `kubectl logs`
    and `exec` through the apiserver; deleting the Deployment collects its ReplicaSet and pods."""
    from kubernetes import client

    ns = node_namespace
    manifests = [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
         "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                  "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                      "containers": [{
                          "name": "web", "image": image_ref("sandbox"),
                          "imagePullPolicy": "Never",
                          "command": ["python3", "-m", "http.server", "8080"],
                          "securityContext": RESTRICTED,
                          "readinessProbe": {"httpGet": {"path": "/", "port": 8080},
                                             "periodSeconds": 1},
                      }]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}},
    ]  # fmt: skip
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))
    node_kubectl("rollout", "status", "-n", ns, "deploy/web", "--timeout=180s", timeout=200)
    probe = f"""
import socket, urllib.request
print("resolved", socket.gethostbyname("web.{ns}.svc.cluster.local"))
print("status", urllib.request.urlopen("http://web/", timeout=10).status)
for host in ("pypi.org",):
    try:
        socket.gethostbyname(host); print("external name resolved")
    except OSError:
        print("external name refused")
"""
    node_kubectl("run", "-n", ns, "probe", f"--image={image_ref('sandbox')}",
                 "--image-pull-policy=Never", "--restart=Never", "--command", "--",
                 "python3", "-c", probe)  # fmt: skip
    core = client.CoreV1Api(node_api)
    phase = wait_for("the probe pod to finish", lambda: (
        core.read_namespaced_pod("probe", ns).status.phase in {"Succeeded", "Failed"}
        and core.read_namespaced_pod("probe", ns).status.phase))  # fmt: skip
    logs = node_kubectl("logs", "-n", ns, "probe").stdout
    assert phase == "Succeeded", logs
    assert "status 200" in logs and "resolved 10.96.0." in logs, logs
    assert "external name refused" in logs, logs
    whoami = node_kubectl("exec", "-n", ns, "deploy/web", "--", "id", "-u").stdout.strip()
    assert whoami == "65534"
    written = node_kubectl("exec", "-n", ns, "deploy/web", "--", "touch", "/x", check=False)
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    node_kubectl("delete", "-n", ns, "deployment", "web", "--wait=false")
    apps = client.AppsV1Api(node_api)
    wait_for("the garbage collector to remove the ReplicaSet and its pod", lambda: (
        not apps.list_namespaced_replica_set(ns).items
        and not [p for p in core.list_namespaced_pod(ns).items
                 if p.metadata.labels.get("app") == "web"]))  # fmt: skip


def test_pod_traffic_is_fenced_to_the_machine(real_cluster: RealCluster) -> None:
    """Pods have no masquerade and the forward chain drops anything of theirs that would
    leave through another interface (checked on the rules: tests send nothing off the host)."""
    rules = subprocess.run(["iptables", "-S", FORWARD_CHAIN], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    net = real_cluster.network
    assert f"-A {FORWARD_CHAIN} -s {net.pod_cidr} ! -o {net.bridge} -j DROP" in rules, rules
    assert f"-A {FORWARD_CHAIN} -d {net.pod_cidr} ! -i {net.bridge} -j DROP" in rules, rules
    forward = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True,
                             check=True).stdout.splitlines()  # fmt: skip
    assert forward[1] == f"-A FORWARD -j {FORWARD_CHAIN}", forward  # first, before any ACCEPT


def test_baseline_namespace_refuses_a_privileged_pod(node_kubectl: Kubectl,
                                                     node_namespace: str) -> None:  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "priv"}, "spec": {
        "containers": [{"name": "c", "image": image_ref("sandbox"),
                        "securityContext": {"privileged": True}}]}}  # fmt: skip
    result = node_kubectl("apply", "-n", node_namespace, "-f", "-",
                          input=yaml.safe_dump(pod), check=False)  # fmt: skip
    assert result.returncode != 0 and "violates PodSecurity" in result.stderr, result.stderr


def test_the_cluster_reports_each_components_start_time(real_cluster: RealCluster) -> None:
    for name in ("control-plane", "containerd", "images", "kubelet", "node-ready", "coredns"):
        assert name in real_cluster.timings, real_cluster.timings


def test_the_gang_head_service_resolves_only_the_current_gangs_rank_0(
    node_kubectl: Kubectl, node_namespace: str, node_api: Any
) -> None:
    """MASTER_ADDR is the head Service's name, and that Service publishes not-ready addresses
    (workers resolve rank 0 before it is ready). During a gang restart the old rank 0 is still
    terminating while the new one starts: the operator's Service (gang label in its selector)
    resolves to the new rank 0 only; a selector without the gang label, as before, resolves
    to both, which is what a worker of the new gang could rendezvous with."""
    from kubernetes import client

    from posttrain.api import TrainingRun
    from posttrain.api import labels as api_labels
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.trainingrun import builders as b

    ns = node_namespace
    run = TrainingRun.model_validate({
        "metadata": {"name": "demo", "namespace": ns, "uid": "u-1"},
        "spec": {"model": "smollm2-135m-instruct", "resources": {"nodes": 2},
                 "domains": [{"name": "m", "dataset": "builtin:arith",
                              "verifier": {"kind": "numeric"}}]},
    })  # fmt: skip
    config = OperatorConfig()
    service = b.build_head_service(run, config, 1)
    service["metadata"].pop("ownerReferences", None)
    ungated = {
        **service,
        "metadata": {"name": "ungated-head"},
        "spec": {
            **service["spec"],
            "selector": {
                k: v for k, v in service["spec"]["selector"].items() if k != api_labels.LABEL_GANG
            },
        },
    }

    def rank0(gang: int) -> dict[str, Any]:
        built = b.build_trainer_pod(run, config, gang, 0)
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"rank0-g{gang}", "labels": built["metadata"]["labels"]},
                "spec": {"hostname": built["spec"]["hostname"],
                         "subdomain": built["spec"]["subdomain"],
                         # A rank 0 that takes its time to die, as a trainer saving state does.
                         "terminationGracePeriodSeconds": 120,
                         "containers": [{"name": "c", "image": image_ref("sandbox"),
                                         "imagePullPolicy": "Never",
                                         "command": ["sh", "-c", "trap '' TERM; sleep 600"]}]}}  # fmt: skip

    node_kubectl("apply", "-n", ns, "-f", "-",
                 input=yaml.safe_dump_all([service, ungated, rank0(0)]))  # fmt: skip
    core = client.CoreV1Api(node_api)

    def running_ip(name: str) -> str | None:
        pod = core.read_namespaced_pod(name, ns)
        return pod.status.pod_ip if pod.status.phase == "Running" else None

    old_ip = wait_for("gang 0's rank 0 to run", lambda: running_ip("rank0-g0"))
    node_kubectl("delete", "-n", ns, "pod", "rank0-g0", "--wait=false")  # terminating, 120 s
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(rank0(1)))
    new_ip = wait_for("gang 1's rank 0 to run", lambda: running_ip("rank0-g1"))
    assert core.read_namespaced_pod("rank0-g0", ns).metadata.deletion_timestamp is not None
    head = service["metadata"]["name"]
    resolve = (
        f"import socket; print(sorted(socket.gethostbyname_ex('{{}}.{ns}.svc.cluster.local')[2]))"
    )

    def answers(name: str) -> list[str]:
        out = node_kubectl("exec", "-n", ns, "rank0-g1", "--", "python3", "-c",
                           resolve.format(name), check=False).stdout  # fmt: skip
        return yaml.safe_load(out) if out.strip() else []

    # DNS follows the EndpointSlices within a second or two.
    assert wait_for("the gang's head name to resolve to the new rank 0 only",
                    lambda: answers(head) == [new_ip] and answers(head), 60) == [new_ip]  # fmt: skip
    assert wait_for("the ungated selector to show both rank 0s",
                    lambda: answers("ungated-head") == sorted([old_ip, new_ip]), 60)  # fmt: skip
    node_kubectl("delete", "-n", ns, "pod", "rank0-g0", "rank0-g1", "--grace-period=0", "--force",
                 check=False)  # fmt: skip


def test_vllm_weight_staging_is_bounded_by_its_declared_volume(
    node_kubectl: Kubectl, node_namespace: str, node_api: Any
) -> None:
    """A vLLM replica stages weight updates on the `weights-scratch` emptyDir the operator
    declares (POSTTRAIN_WEIGHTS_SCRATCH), not in the container's /tmp: the kubelet evicts a
    replica that writes more than its sizeLimit instead of letting it fill the node's disk.
    The pod is the operator's vLLM pod spec with the sandbox image standing in for vLLM (the
    rollout image is not on this node), writing 64 MiB into a 16 MiB scratch volume."""
    from kubernetes import client

    from posttrain.api import RolloutPool
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.rolloutpool import builders as pool_builders

    ns = node_namespace
    pool = RolloutPool.model_validate({
        "metadata": {"name": "vl", "namespace": ns, "uid": "u-1"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "vllm",
                 "resources": {"gpus": 0, "cpu": "100m", "memory": "256Mi",
                               "weightsScratch": "16Mi", "ephemeralStorage": "512Mi"}},
    })  # fmt: skip
    spec = pool_builders.build_rollout_deployment(pool, OperatorConfig())["spec"]["template"][
        "spec"
    ]
    spec.pop("initContainers")
    (server,) = spec["containers"]
    server.pop("startupProbe"), server.pop("readinessProbe")
    server.update(image=image_ref("sandbox"), imagePullPolicy="Never", command=[
        "sh", "-c", 'dd if=/dev/zero of="$POSTTRAIN_WEIGHTS_SCRATCH/update" bs=1M count=64 '
        "&& sleep 600"])  # fmt: skip
    server["env"] = [e for e in server["env"] if "valueFrom" not in e]  # no S3 Secret here
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stager"}, "spec": spec}
    node_kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(pod))
    core = client.CoreV1Api(node_api)
    # The kubelet measures volumes about once a minute, then evicts.
    status = wait_for("the kubelet to evict the over-full stager", lambda: (
        (p := core.read_namespaced_pod("stager", ns).status).phase == "Failed" and p), 300)  # fmt: skip
    assert status.reason == "Evicted", status
    assert "weights-scratch" in status.message and "16Mi" in status.message, status.message


def test_superseded_image_names_are_pruned_from_the_nodes_store(real_cluster: RealCluster) -> None:
    """`dev up` removes posttrain names of another tag and ID names no current image holds,
    so a rebuild does not leave its predecessor's layers in containerd; current images stay."""
    from posttrain.devenv.realnode.cluster import image_refs, minio_image

    containerd = real_cluster.containerd
    assert containerd is not None
    old = "ghcr.io/posttrain/sandbox:0.0.0-superseded"
    tagged = containerd.ctr("images", "tag", "--force", "localhost/posttrain/pause:1", old)
    assert tagged.returncode == 0, tagged.stderr
    before = containerd.images()
    removed = real_cluster.prune_images()
    after = containerd.images()
    assert old in removed and old not in after, (removed, sorted(after))
    assert all(ref in after for ref in before if ref != old and not ref.startswith("sha256:"))
    named = {digest for ref, digest in after.items() if not ref.startswith("sha256:")}
    assert all(digest in named for ref, digest in after.items() if ref.startswith("sha256:"))
    assert "localhost/posttrain/pause:1" in after and image_refs(["sandbox"])[0] in after
    assert minio_image() in after  # the chart's bundled MinIO (values-dev.yaml) stays
