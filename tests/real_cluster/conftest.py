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
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.realnode import addons
from posttrain.devenv.realnode.cluster import IMAGE_NAMES, RealCluster, image_refs, leftovers
from posttrain.devenv.realnode.requirements import missing_for_real_node

Kubectl = Callable[..., subprocess.CompletedProcess[str]]


# The images these tests run (the rollout image's vLLM pool is tested by tests/images).
NODE_IMAGES = [name for name in IMAGE_NAMES if name != "rollout"]


def missing_requirements() -> list[str]:
    """What the real node needs and this machine lacks, each with what provides it ([] when
    it can start): what `posttrain dev up` checks before it starts one."""
    return [str(item) for item in missing_for_real_node(image_refs(NODE_IMAGES))]


def require_real_node() -> None:
    """Skip when this machine cannot start the real node, naming what it lacks; fail
    instead where `make test` set it up (POSTTRAIN_REQUIRE_REAL_CLUSTER=1)."""
    missing = missing_requirements()
    if missing:
        why = f"the real node cannot start: missing {'; '.join(missing)} (make test provides them)"
        if os.environ.get("POSTTRAIN_REQUIRE_REAL_CLUSTER") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    require_real_node()
    workdir = Path(tempfile.mkdtemp(prefix="posttrain-node-"))
    # The images these tests run (`dev up`'s default set); the rollout image (7 GB) is
    # imported by the one test that runs a vLLM pool (test_chart.py).
    images = image_refs(NODE_IMAGES)
    # A node an earlier, killed test session left running is stopped; a person's
    # `posttrain dev up` is not (start() then says so).
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


def wait_for(what: str, predicate: Any, timeout_s: float = 300.0, on_timeout: Any = None) -> Any:
    """Poll ``predicate`` each second until truthy and return its value; say every minute
    what is still awaited (real-node waits take minutes), and on timeout add
    ``on_timeout()``'s description of the cluster to the failure."""
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


def pod_security_namespace(node_api: Any, level: str, prefix: str) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security ``level``, ready for pods (its default
    ServiceAccount exists), deleted after."""
    from kubernetes import client

    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(node_api)
    labels = {"pod-security.kubernetes.io/enforce": level}
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels))
    )
    # Pods are refused until the ServiceAccount controller has made the namespace's default.
    wait_for("the namespace's default ServiceAccount",
             lambda: any(sa.metadata.name == "default"
                         for sa in core.list_namespaced_service_account(name).items), 60)  # fmt: skip
    yield name
    core.delete_namespace(name)


@pytest.fixture
def node_namespace(node_api: Any) -> Iterator[str]:
    """A fresh namespace on the real node, enforcing Pod Security "baseline" (deleted after)."""
    yield from pod_security_namespace(node_api, "baseline", "rc")


@pytest.fixture
def restricted_namespace(node_api: Any) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security "restricted" (deleted after)."""
    yield from pod_security_namespace(node_api, "restricted", "rc-r")


# Tests that start a node of their own with `posttrain dev up`.
OWN_NODE = ("test_dev_cli.py", "test_readme_walkthrough.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`posttrain dev up` starts a node of its own, and one node runs at a time: the tests
    that run it go before the first test that starts the session's shared node."""
    here = Path(__file__).parent
    first = [item for item in items if item.path in [here / name for name in OWN_NODE]]
    if first:
        rest = [item for item in items if item not in first]
        shared = next((i for i, item in enumerate(rest) if item.path.parent == here), len(rest))
        items[:] = [*rest[:shared], *first, *rest[shared:]]
