"""One real single-node cluster for the session (posttrain.devenv.realnode): kubelet,
containerd, runc, CNI, kube-proxy, CoreDNS, with the images of `make images` on the node.

It needs root, containerd, runc, the CNI plugins and the images. Without them these tests skip,
saying what is missing; under `make test` (POSTTRAIN_REQUIRE_REAL_CLUSTER=1) they fail instead.
Stopping the cluster must leave nothing behind: the fixture checks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.realnode import addons
from posttrain.devenv.realnode.cluster import IMAGE_NAMES, RealCluster, image_refs, leftovers
from posttrain.devenv.realnode.network import CNI_BIN_DIR

from ..images.podman import missing_images

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


def missing_requirements() -> list[str]:
    """What the real node needs and this machine lacks ([] when it can start)."""
    missing = [f"command {c}" for c in ("containerd", "ctr", "runc", "iptables", "ip")
               if shutil.which(c) is None]  # fmt: skip
    if os.geteuid() != 0:
        missing.append("root")
    if not (CNI_BIN_DIR / "bridge").exists():
        missing.append("CNI plugins (containernetworking-plugins)")
    missing += [f"image {name}" for name in missing_images()]
    return missing


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    missing = missing_requirements()
    if missing:
        why = f"the real node cannot start: missing {', '.join(missing)} (make test installs them)"
        if os.environ.get("POSTTRAIN_REQUIRE_REAL_CLUSTER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-node-"))
    # The images these tests run; the rollout image (7 GB) is imported by the one test
    # that runs a vLLM pool (test_chart.py), so other sessions skip its first import.
    images = image_refs([name for name in IMAGE_NAMES if name != "rollout"])
    # A node an earlier, killed test session left running is stopped; a person's
    # `posttrain dev up --node real` is not (start() then says so).
    cluster = RealCluster(workdir, images=images).start(
        reap=lambda other: other.name.startswith("posttrain-node-")
    )
    try:
        yield cluster
    finally:
        # Stopped as `posttrain dev down` stops one: from the record `dev up` saves.
        RealCluster.from_record(cluster.record()).stop(keep_workdir=True)
        left = leftovers(workdir)
        shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"the real node left these behind: {left}"


@pytest.fixture(scope="session")
def node_controllers(real_cluster: RealCluster) -> Iterator[dict[str, float]]:
    """KubeRay's operator and Kueue, built from their pinned modules, running against the
    node's apiserver with their CRDs (and Kueue's webhooks) installed; yields how long each
    took to become ready. Stopped, and Kueue's webhooks removed, at the end of the session."""
    import time

    started: dict[str, float] = {}
    processes = []
    workdir = real_cluster.workdir / "controllers"
    workdir.mkdir(exist_ok=True)
    try:
        begin = time.monotonic()
        addons.apply(real_cluster.kubeconfig, addons.kuberay_crds())
        kuberay = addons.kuberay_process(workdir, real_cluster.kubeconfig)
        processes.append(kuberay)
        kuberay.start(180.0)
        started["kuberay"] = round(time.monotonic() - begin, 1)
        begin = time.monotonic()
        kueue = addons.kueue_process(workdir, real_cluster.kubeconfig, real_cluster.node_ip)
        processes.append(kueue)
        kueue.start(300.0)
        started["kueue"] = round(time.monotonic() - begin, 1)
        print(f"controllers ready: {started}", flush=True)
        yield started
    finally:
        for process in reversed(processes):
            process.stop()
        # No webhook may point at the stopped Kueue: it would refuse Kueue's kinds.
        kubectl = client_binary("kubectl")
        for kind in ("mutating", "validating"):
            subprocess.run([str(kubectl), "--kubeconfig", str(real_cluster.kubeconfig), "delete",
                            f"{kind}webhookconfiguration", f"kueue-{kind}-webhook-configuration",
                            "--ignore-not-found"], capture_output=True, check=False)  # fmt: skip


@pytest.fixture(scope="session")
def node_api(real_cluster: RealCluster) -> Iterator[Any]:
    api = real_cluster.api()
    yield api
    api.close()


@pytest.fixture(scope="session")
def node_kubectl(real_cluster: RealCluster) -> Kubectl:
    binary = client_binary("kubectl")

    def run(*args: str, check: bool = True, timeout: float = 120, input: str | None = None
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        result = subprocess.run(
            [str(binary), "--kubeconfig", str(real_cluster.kubeconfig), *args],
            capture_output=True, text=True, timeout=timeout, input=input,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
        return result

    return run


@pytest.fixture
def node_namespace(node_api: Any) -> Iterator[str]:
    """A fresh namespace on the real node, enforcing Pod Security "baseline" (deleted after)."""
    from kubernetes import client

    name = f"rc-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(node_api)
    labels = {"pod-security.kubernetes.io/enforce": "baseline"}
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels))
    )
    yield name
    core.delete_namespace(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`dev up --node real` starts a node of its own, and one node runs at a time: its test
    goes before the first test that starts the session's shared node."""
    here = Path(__file__).parent
    first = [item for item in items if item.path == here / "test_dev_cli.py"]
    if first:
        rest = [item for item in items if item not in first]
        shared = next((i for i, item in enumerate(rest) if item.path.parent == here), len(rest))
        items[:] = [*rest[:shared], *first, *rest[shared:]]
