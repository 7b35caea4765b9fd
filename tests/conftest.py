"""Session fixtures on REAL servers: etcd + kube-apiserver and MinIO, built from
pinned Go modules (tools/ensure-binaries.sh). A missing binary is built, never
skipped. Fixtures start lazily, so a unit-test-only run starts nothing."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.controlplane import ControlPlane
from posttrain.devenv.minio import MinioServer

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    cp = ControlPlane().start()
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> Path:
    return control_plane.kubeconfig


@pytest.fixture(scope="session")
def kube_api(kubeconfig: Path) -> Iterator[Any]:
    """A kubernetes.client.ApiClient logged in as the cluster admin."""
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def kubectl_bin() -> Path:
    return client_binary("kubectl")


@pytest.fixture(scope="session")
def helm_bin() -> Path:
    return client_binary("helm")


@pytest.fixture(scope="session")
def kubectl(kubectl_bin: Path, kubeconfig: Path) -> Any:
    """Run the real kubectl against the test control plane: kubectl("get", "tr")."""

    def run(
        *args: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kubectl_bin), f"--kubeconfig={kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=stdin,
            check=check,
            timeout=120,
        )

    return run


@pytest.fixture(scope="session")
def crds_installed(control_plane: ControlPlane, kube_api: Any, kubectl: Any) -> None:
    """The generated CRDs applied and Established."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO_ROOT / "crds"))
    for plural in ("trainingruns", "rolloutpools", "sandboxtasks"):
        control_plane.wait_for_crd(kube_api, f"{plural}.posttrain.io")


@pytest.fixture
def namespace(kube_api: Any) -> Iterator[str]:
    """A fresh namespace per test (deleted afterwards; no kubelet, so no pods run)."""
    from kubernetes import client

    name = f"t-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(kube_api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


_SESSION_MINIO: list[MinioServer] = []


@pytest.fixture(scope="session")
def minio_server() -> Iterator[MinioServer]:
    server = MinioServer().start()
    _SESSION_MINIO.append(server)
    yield server
    _SESSION_MINIO.clear()
    server.destroy()


def _bucket_names(server: MinioServer) -> set[str]:
    return {bucket.name for bucket in server.client().list_buckets()}


@pytest.fixture(scope="module", autouse=True)
def _drop_the_modules_buckets() -> Iterator[None]:
    """Each module's buckets go when the module's tests are done. A trained model's checkpoint
    is GBs, and the suite trains many: kept for the whole session they filled the disk, which
    also holds the images and the real node's containerd."""
    before = _bucket_names(_SESSION_MINIO[0]) if _SESSION_MINIO else set()
    yield
    if not _SESSION_MINIO:
        return
    server = _SESSION_MINIO[0]
    client = server.client()
    for bucket in _bucket_names(server) - before:
        from minio.deleteobjects import DeleteObject

        names = (DeleteObject(o.object_name) for o in client.list_objects(bucket, recursive=True))
        for error in client.remove_objects(bucket, names):
            raise AssertionError(f"could not delete from {bucket}: {error}")
        client.remove_bucket(bucket)
    server.empty_trash()


@pytest.fixture
def minio_env(minio_server: MinioServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point posttrain's storage at the session MinIO through the environment."""
    env = minio_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def pytest_report_header(config: pytest.Config) -> str:
    return f"posttrain binaries: {os.environ.get('POSTTRAIN_BIN_DIR', '~/.cache/posttrain/bin')}"
