"""Operator throughput: 500 SandboxTasks -> 500 pods, against a raw loop creating 500 pods.

Both run against the same real etcd + kube-apiserver (posttrain.devenv), one after the
other in separate namespaces. "Raw" is the floor: one client creating the equivalent pod
manifests (built by the same builder) in a loop. "Operator" is the same loop creating
SandboxTasks, with the operator (``posttrain operator``, its own process) turning them into
pods; the clock stops when the 500th pod exists. Ratio = operator / raw (target <= 1.5).
A third run creates the SandboxTasks with no operator, to show how much of the operator
path is the CR writes themselves (the apiserver is shared, so task creates and pod creates
compete).

Before any timed row, both write paths are warmed up in a scratch namespace: the first
custom-resource writes after a CRD is installed are ~7x slower than the steady state (the
apiserver builds the CRD's handler and OpenAPI models lazily), a one-time cost that used to
land in whichever row ran first. ``--repeats`` interleaves raw / tasks-only / operator rows
and reports medians.

``--warm-pool`` adds a separately labelled row: a SandboxWarmPool of 500 pods is filled and
made ready first (the bench plays the kubelet; not timed), then the clock runs from the first
of 500 task creations (with spec.warmPoolRef) until 500 tasks are bound to a pooled pod (the
claim label is on the pod). That row is not the cold ratio the target is about.

    .venv/bin/python bench/operator_sandbox_throughput.py [--tasks 500] [--repeats 3]
        [--warm-pool]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
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
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import (
    MERGE_PATCH,
    Credentials,
    load_credentials,
    resource_path,
    ssl_context,
)
from posttrain.operator.sandboxtask.builders import build_sandbox_pod

REPO = Path(__file__).resolve().parents[1]
GV = "posttrain.io/v1alpha1"


PLURALS = ("trainingruns", "rolloutpools", "sandboxtasks", "sandboxwarmpools")


class RawClient:
    """The bench's own hands: a plain pooled synchronous httpx client, the same requests the
    raw pod loop has always been timed with (the operator's own client may change; this
    baseline must not)."""

    def __init__(self, creds: Credentials, pool_size: int = 8) -> None:
        headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        self.http = httpx.Client(
            base_url=creds.server,
            verify=ssl_context(creds),
            headers=headers,
            timeout=30.0,
            limits=httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size),
        )

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        ok: tuple[int, ...] = (200, 201, 202),
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": content_type} if body is not None else {}
        response = self.http.request(method, path, json=body, headers=headers)
        if response.status_code not in ok:
            raise RuntimeError(f"{method} {path} -> HTTP {response.status_code}: {response.text}")
        return response.status_code, response.json() if response.content else {}

    def patch(self, path: str, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        path = f"{path}/{subresource}" if subresource else path
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)[1]

    def close(self) -> None:
        self.http.close()


def install_crds(kube: RawClient) -> None:
    for path in sorted((REPO / "crds").glob("posttrain.io_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        kube.request(
            "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, ok=(201, 409)
        )
    for plural in PLURALS:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            crd = kube.request(
                "GET",
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{plural}.posttrain.io",
            )[1]
            if any(
                c["type"] == "Established" and c["status"] == "True"
                for c in (crd.get("status") or {}).get("conditions") or []
            ):
                break
            time.sleep(0.1)


def new_namespace(kube: RawClient) -> str:
    name = f"bench-{uuid.uuid4().hex[:6]}"
    kube.request(
        "POST",
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
    )
    return name


def pod_count(kube: RawClient, namespace: str) -> int:
    """Pods in the namespace from one tiny list call (limit=1 + remainingItemCount)."""
    data = kube.request("GET", resource_path("v1", "pods", namespace) + "?limit=1")[1]
    return len(data["items"]) + int(data["metadata"].get("remainingItemCount") or 0)


def wait_pods(kube: RawClient, namespace: str, n: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while pod_count(kube, namespace) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {pod_count(kube, namespace)}/{n} pods after {timeout_s} s")
        time.sleep(0.05)


def labelled_pods(kube: RawClient, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Full list with a label selector (the apiserver gives no remainingItemCount for those)."""
    path = resource_path("v1", "pods", namespace) + f"?labelSelector={selector}"
    items: list[dict[str, Any]] = kube.request("GET", path)[1]["items"]
    return items


class LabelWatch:
    """Counts pods that carry a label, from a watch opened before the clock starts.

    Polling a 500-pod list with a selector (no remainingItemCount there) would itself load
    the apiserver during the timed window; one watch stream costs next to nothing.
    """

    def __init__(self, kube: RawClient, namespace: str, label: str, n: int) -> None:
        self.seen: set[str] = set()
        self.done = threading.Event()
        self.finished_at = 0.0
        rv = kube.request("GET", resource_path("v1", "pods", namespace) + "?limit=1")[1][
            "metadata"
        ]["resourceVersion"]
        path = (
            resource_path("v1", "pods", namespace)
            + f"?watch=1&labelSelector={label}&resourceVersion={rv}"
        )
        self._stream = kube.http.stream("GET", path, timeout=None)
        self._n = n
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._stream as response:
            for line in response.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    self.seen.add(event["object"]["metadata"]["name"])
                if len(self.seen) >= self._n:
                    self.finished_at = time.perf_counter()
                    self.done.set()
                    return

    def wait(self, timeout_s: float = 600) -> float:
        if not self.done.wait(timeout_s):
            raise TimeoutError(f"only {len(self.seen)}/{self._n} labelled pods after {timeout_s} s")
        return self.finished_at


def clean_namespace(kube: RawClient, namespace: str) -> None:
    """Delete what a row created (no namespace controller here), so rows stay comparable."""
    for api_version, plural in (("v1", "pods"), (GV, "sandboxtasks"), (GV, "sandboxwarmpools")):
        kube.request("DELETE", resource_path(api_version, plural, namespace), ok=(200, 404))
    deadline = time.monotonic() + 60
    while pod_count(kube, namespace) and time.monotonic() < deadline:
        time.sleep(0.2)


def warm_up(kube: RawClient, config: OperatorConfig, n: int = 100) -> float:
    """Untimed: first writes of both kinds (CRD handler + OpenAPI models built lazily)."""
    ns = new_namespace(kube)
    started = time.perf_counter()
    for i in range(n):
        kube.request("POST", resource_path(GV, "sandboxtasks", ns), task_body(f"w-{i}", ns))
        kube.request("POST", resource_path("v1", "pods", ns), pod_manifest(config, f"w-{i}", ns))
    elapsed = time.perf_counter() - started
    clean_namespace(kube, ns)
    return elapsed


def task_body(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": GV,
        "kind": "SandboxTask",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"command": ["python", "-c", "print(42)"], "files": {"main.py": "print(1)"}},
    }


def pod_manifest(config: OperatorConfig, name: str, namespace: str) -> dict[str, Any]:
    body = task_body(name, namespace)
    body["metadata"]["uid"] = str(uuid.uuid4())  # owner refs need one; nothing checks it
    return build_sandbox_pod(SandboxTask.model_validate(body), config, 1)


def bench_raw(kube: RawClient, config: OperatorConfig, n: int) -> float:
    """The floor: a loop creating n equivalent pods directly."""
    ns = new_namespace(kube)
    manifests = [pod_manifest(config, f"t-{i}", ns) for i in range(n)]
    started = time.perf_counter()
    for manifest in manifests:
        kube.request("POST", resource_path("v1", "pods", ns), manifest)
    wait_pods(kube, ns, n)
    elapsed = time.perf_counter() - started
    clean_namespace(kube, ns)
    return elapsed


def bench_tasks_only(kube: RawClient, n: int) -> float:
    """The same loop creating n SandboxTasks with no operator: the floor of the operator path."""
    ns = new_namespace(kube)
    started = time.perf_counter()
    for i in range(n):
        kube.request("POST", resource_path(GV, "sandboxtasks", ns), task_body(f"t-{i}", ns))
    elapsed = time.perf_counter() - started
    clean_namespace(kube, ns)
    return elapsed


def start_operator(kubeconfig: Path, namespace: str) -> subprocess.Popen[bytes]:
    """``posttrain operator`` as its own process (as deployed), ready when /healthz answers.

    A separate process matters: in-process, the operator's threads would share the GIL with
    the client loop being timed.
    """
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain",
            "operator",
            "--standalone",
            "-n",
            namespace,
            f"--kubeconfig={kubeconfig}",
            f"--liveness-port={port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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


def bench_operator(kube: RawClient, kubeconfig: Path, n: int) -> float:
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
        print(
            f"  (the loop itself took {created:.2f} s to create {n} SandboxTasks; the operator "
            f"process used {cpu_seconds(proc.pid) - cpu_before:.2f} CPU-s)"
        )
        return elapsed
    finally:
        proc.terminate()
        proc.wait(30)
        clean_namespace(kube, ns)


def play_kubelet_ready(kube: RawClient, namespace: str, names: list[str]) -> None:
    """Mark pods Running and Ready (what a kubelet would report); there is none here."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {
        "status": {
            "phase": "Running",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True"}],
        }
    }
    for name in names:
        kube.patch(resource_path("v1", "pods", namespace, name), status, "status")


def bench_warm_pool(kube: RawClient, kubeconfig: Path, n: int) -> tuple[float, int]:
    """Second row: n tasks with spec.warmPoolRef against a pool pre-filled with n ready pods.

    Returns (seconds until n tasks are bound to a pooled pod, tasks that went cold).
    """
    ns = new_namespace(kube)
    proc = start_operator(kubeconfig, ns)
    try:
        kube.request(
            "POST",
            resource_path(GV, "sandboxwarmpools", ns),
            {
                "apiVersion": GV,
                "kind": "SandboxWarmPool",
                "metadata": {"name": "py", "namespace": ns},
                "spec": {"replicas": n},
            },
        )
        wait_pods(kube, ns, n)
        pods = labelled_pods(kube, ns, "posttrain.io/warm-pool=py")
        play_kubelet_ready(kube, ns, [p["metadata"]["name"] for p in pods])
        deadline = time.monotonic() + 120
        while True:
            pool = kube.request("GET", resource_path(GV, "sandboxwarmpools", ns, "py"))[1]
            if (pool.get("status") or {}).get("readyReplicas") == n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool not ready: {pool.get('status')}")
            time.sleep(0.2)
        bound = LabelWatch(kube, ns, "posttrain.io/task", n)  # claimed + any cold fallbacks
        cpu_before = cpu_seconds(proc.pid)
        started = time.perf_counter()
        for i in range(n):
            body = task_body(f"t-{i}", ns)
            body["spec"]["warmPoolRef"] = "py"
            kube.request("POST", resource_path(GV, "sandboxtasks", ns), body)
        created = time.perf_counter() - started
        elapsed = bound.wait() - started
        cold = len(labelled_pods(kube, ns, "posttrain.io/task,!posttrain.io/warm-pool"))
        print(
            f"  (the loop itself took {created:.2f} s; the operator process used "
            f"{cpu_seconds(proc.pid) - cpu_before:.2f} CPU-s, refills included)"
        )
        return elapsed, cold
    finally:
        proc.terminate()
        proc.wait(30)
        clean_namespace(kube, ns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved raw / tasks-only / operator rounds; medians reported",
    )
    parser.add_argument(
        "--warm-pool", action="store_true", help="add the (separately labelled) warm-pool claim row"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    n = args.tasks
    cp = ControlPlane().start()
    try:
        kube = RawClient(load_credentials(str(cp.kubeconfig)), pool_size=8)
        install_crds(kube)
        config = OperatorConfig()
        print(f"warm-up (untimed): 100 SandboxTasks + 100 pods in {warm_up(kube, config):.2f} s")
        raws, tasks, ops = [], [], []
        for round_ in range(1, args.repeats + 1):
            raws.append(bench_raw(kube, config, n))
            print(
                f"[{round_}] raw client loop: {n} pods in {raws[-1]:.2f} s "
                f"({n / raws[-1]:.0f} pods/s)"
            )
            tasks.append(bench_tasks_only(kube, n))
            print(f"[{round_}] SandboxTask creates alone (no operator): {tasks[-1]:.2f} s")
            ops.append(bench_operator(kube, cp.kubeconfig, n))
            print(
                f"[{round_}] operator: {n} SandboxTasks -> pods in {ops[-1]:.2f} s "
                f"({n / ops[-1]:.0f} pods/s); ratio {ops[-1] / raws[-1]:.2f}"
            )
        raw, tasks_only, op = (statistics.median(x) for x in (raws, tasks, ops))
        print(
            f"median of {args.repeats}: raw {raw:.2f} s, tasks alone {tasks_only:.2f} s, "
            f"operator {op:.2f} s"
        )
        print(
            f"ratio operator/raw: {op / raw:.2f} (target <= 1.5); "
            f"operator / (task creates + raw pod creates): {op / (tasks_only + raw):.2f}  "
            f"[{datetime.now(UTC):%Y-%m-%d %H:%M} UTC]"
        )
        if args.warm_pool:
            warm, cold = bench_warm_pool(kube, cp.kubeconfig, n)
            print(
                f"warm pool (separate row, not the target): {n} SandboxTasks bound to pooled "
                f"pods in {warm:.2f} s ({n / warm:.0f} tasks/s; {cold} went cold); "
                f"warm / raw pod creates: {warm / raw:.2f}"
            )
        kube.close()
    finally:
        cp.stop()


if __name__ == "__main__":
    main()
