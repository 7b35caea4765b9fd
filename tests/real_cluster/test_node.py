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
