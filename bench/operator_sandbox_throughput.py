"""Operator throughput: 500 SandboxTasks -> 500 pods, against a raw loop creating 500 pods.

Both run against the same real etcd + kube-apiserver (posttrain.devenv), one after the
other in separate namespaces. "Raw" is the floor: one client creating the equivalent pod
manifests (built by the same builder) in a loop. "Operator" is the same loop creating
SandboxTasks, with the operator (``posttrain operator``, its own process) turning them into pods; the clock stops when
the 500th pod exists. Ratio = operator / raw (target <= 1.5). A third run creates the
SandboxTasks with no operator, to show how much of the operator path is the CR writes
themselves (the apiserver is shared, so task creates and pod creates compete).

    .venv/bin/python bench/operator_sandbox_throughput.py [--tasks 500]
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from posttrain.api import SandboxTask
from posttrain.devenv.controlplane import ControlPlane
from posttrain.devenv.process import free_port
from posttrain.operator.builders import build_sandbox_pod
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, load_credentials, resource_path

REPO = Path(__file__).resolve().parents[1]
GV = "posttrain.io/v1alpha1"


def install_crds(kube: KubeClient) -> None:
    for path in sorted((REPO / "crds").glob("posttrain.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kube.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd,
                     ok=(201, 409))
    for plural in ("trainingruns", "rolloutpools", "sandboxtasks"):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            crd = kube.request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.posttrain.io"
            )[1]
            if any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or []):
                break
            time.sleep(0.1)


def new_namespace(kube: KubeClient) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": name}})
    return name


def pod_count(kube: KubeClient, namespace: str) -> int:
    """Pods in the namespace from one tiny list call (limit=1 + remainingItemCount)."""
    data = kube.request("GET", resource_path("v1", "pods", namespace) + "?limit=1")[1]
    return len(data["items"]) + int(data["metadata"].get("remainingItemCount") or 0)


def wait_pods(kube: KubeClient, namespace: str, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while pod_count(kube, namespace) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {pod_count(kube, namespace)}/{n} pods after {timeout_s} s")
        time.sleep(0.05)


def task_body(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": GV, "kind": "SandboxTask",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"command": ["python", "-c", "print(42)"], "files": {"main.py": "print(1)"}}}


def bench_raw(kube: KubeClient, config: OperatorConfig, n: int) -> float:
    """The floor: a loop creating n equivalent pods directly."""
    ns = new_namespace(kube)
    manifests = []
    for i in range(n):
        body = task_body(f"t-{i}", ns)
        body["metadata"]["uid"] = str(uuid.uuid4())  # owner refs need one; nothing checks it
        manifests.append(build_sandbox_pod(SandboxTask.model_validate(body), config, 1))
    started = time.perf_counter()
    for manifest in manifests:
        kube.request("POST", resource_path("v1", "pods", ns), manifest)
    wait_pods(kube, ns, n)
    return time.perf_counter() - started


def bench_tasks_only(kube: KubeClient, n: int) -> float:
    """The same loop creating n SandboxTasks with no operator: the floor of the operator path."""
    ns = new_namespace(kube)
    started = time.perf_counter()
    for i in range(n):
        kube.request("POST", resource_path(GV, "sandboxtasks", ns), task_body(f"t-{i}", ns))
    return time.perf_counter() - started


def start_operator(kubeconfig: Path, namespace: str) -> subprocess.Popen[bytes]:
    """``posttrain operator`` as its own process (as deployed), ready when /healthz answers.

    A separate process matters: in-process, the operator's threads would share the GIL with
    the client loop being timed.
    """
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain", "operator", "--standalone", "-n", namespace,
         f"--kubeconfig={kubeconfig}", f"--liveness-port={port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"operator exited with {proc.returncode} before becoming ready")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("operator not ready after 60 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to show what the operator costs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_operator(kube: KubeClient, kubeconfig: Path, n: int) -> float:
    """The same loop creating SandboxTasks; the operator (own process) creates the pods."""
    ns = new_namespace(kube)
    proc = start_operator(kubeconfig, ns)
    try:
        cpu_before = cpu_seconds(proc.pid)
        started = time.perf_counter()
        for i in range(n):
            kube.request("POST", resource_path(GV, "sandboxtasks", ns), task_body(f"t-{i}", ns))
        created = time.perf_counter() - started
        wait_pods(kube, ns, n)
        elapsed = time.perf_counter() - started
        print(f"  (the loop itself took {created:.2f} s to create {n} SandboxTasks; the operator "
              f"process used {cpu_seconds(proc.pid) - cpu_before:.2f} CPU-s)")
        return elapsed
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cp = ControlPlane().start()
    try:
        kube = KubeClient(load_credentials(str(cp.kubeconfig)), pool_size=8)
        install_crds(kube)
        config = OperatorConfig()
        raw = bench_raw(kube, config, args.tasks)
        print(f"raw client loop: {args.tasks} pods in {raw:.2f} s "
              f"({args.tasks / raw:.0f} pods/s)")
        tasks_only = bench_tasks_only(kube, args.tasks)
        print(f"SandboxTask creates alone (no operator): {tasks_only:.2f} s")
        op = bench_operator(kube, cp.kubeconfig, args.tasks)
        print(f"operator:        {args.tasks} SandboxTasks -> pods in {op:.2f} s "
              f"({args.tasks / op:.0f} pods/s)")
        print(f"ratio operator/raw: {op / raw:.2f} (target <= 1.5); "
              f"operator / (task creates + raw pod creates): {op / (tasks_only + raw):.2f}  "
              f"[{datetime.now(UTC):%Y-%m-%d %H:%M} UTC]")
        kube.close()
    finally:
        cp.stop()


if __name__ == "__main__":
    main()
