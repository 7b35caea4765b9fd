"""docs/chart.md, "On the dev cluster", run as written on the real node: the evaluation install
(bundled MinIO on a local volume, the chart's default images), one TrainingRun through the
installed operator, the delete and the uninstall. Then what the block leaves is checked: the
run's checkpoint and trajectories are in MinIO's volume, the run's children are gone, the
operator and MinIO pods are gone, and the MinIO claim is kept."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from posttrain.devenv.binaries import link_client_tools, pinned_versions
from posttrain.devenv.realnode.cluster import RealCluster
from posttrain.processes import wait_for

from .conftest import Kubectl

pytestmark = [pytest.mark.real_cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "chart.md"
VALUES_DEV = REPO_ROOT / "charts" / "posttrain" / "values-dev.yaml"
RUN_NS, SYSTEM = "ml-demo", "posttrain-system"


def dev_cluster_block() -> str:
    """The ```bash block under docs/chart.md's "## On the dev cluster"."""
    section = DOC.read_text().split("## On the dev cluster\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None, "docs/chart.md has no bash block under 'On the dev cluster'"
    return block.group(1)


def gone(node_kubectl: Kubectl, namespace: str, kinds: str, timeout_s: float = 180) -> bool:
    """True once nothing of ``kinds`` is left in ``namespace``; AssertionError after
    ``timeout_s``."""
    return bool(wait_for(
        lambda: node_kubectl("get", kinds, "-n", namespace, "-o", "name").stdout == "",
        timeout_s=timeout_s, what=f"no {kinds} left in {namespace}", interval_s=2.0,
    ))  # fmt: skip


def test_values_dev_names_the_minio_image_build_sh_makes() -> None:
    pin = pinned_versions()["MINIO_VERSION"]
    text = VALUES_DEV.read_text()
    assert "repository: localhost/posttrain/minio" in text and f"tag: {pin}" in text, (
        f"charts/posttrain/values-dev.yaml must name localhost/posttrain/minio:{pin}"
    )


def test_the_docs_dev_cluster_install_runs_a_training_run_as_written(
    real_cluster: RealCluster, node_kubectl: Kubectl, tmp_path: Path
) -> None:
    venv_bin = REPO_ROOT / ".venv" / "bin"
    if not (venv_bin / "activate").exists():
        pytest.fail("the block sources .venv/bin/activate: run `make venv` first")
    link_client_tools(venv_bin)  # what `make venv` does: .venv/bin/kubectl and helm
    env = {**os.environ, "KUBECONFIG": str(real_cluster.kubeconfig)}
    log = tmp_path / "block.log"
    with open(log, "wb") as out:
        # A person's shell: the block's own commands, stopping at the first that fails.
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", dev_cluster_block()],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=3300,
        )  # fmt: skip
    output = log.read_text(errors="replace")
    try:
        assert done.returncode == 0, f"the block failed (exit {done.returncode}):\n{output}"
        assert "STATUS: deployed" in output, output
        # `posttrain watch` ended on Succeeded; `kubectl get -o wide` showed it at step 3 of 3;
        # `posttrain logs` printed the trainer's last lines.
        assert "trainingrun dev-run Succeeded at step 3/3" in output, output
        assert re.search(r"^trainingrun\.posttrain\.io/dev-run\s+Succeeded\s+3\s+3\s", output, re.M)
        assert "run finished: 3 steps" in output, output
        # The run's checkpoint and trajectories were written to the bundled MinIO: its data
        # lies on the node's local volume (MinIO keeps one directory per object).
        stored = sorted(
            path.relative_to(volume)
            for volume in (real_cluster.workdir / "volumes").glob("local-*")
            for path in volume.glob(f"*/runs/{RUN_NS}/dev-run/*/*")
        )
        kinds = {path.parts[-1] for path in stored}
        assert {"checkpoints", "trajectories"} <= kinds, stored
        # The delete collected the run's and the pool's children; the uninstall the operator
        # and MinIO pods. The MinIO claim stays (resource-policy keep).
        # Collection is asynchronous (the garbage collector, then each pod's grace period).
        assert gone(node_kubectl, RUN_NS, "pods,deploy,svc")
        assert gone(node_kubectl, SYSTEM, "pods,deploy")
        claims = node_kubectl("get", "pvc", "-n", SYSTEM, "-o", "name").stdout.split()
        assert claims == ["persistentvolumeclaim/posttrain-minio"], claims
    finally:
        print(output[-20000:])
        # Leave the node as the next module expects it: no release, no demo namespaces.
        node_kubectl("delete", "namespace", RUN_NS, SYSTEM, "--wait", "--ignore-not-found",
                     check=False, timeout=300)  # fmt: skip
