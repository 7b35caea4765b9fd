"""README.md's "End to end on a local cluster", run as written on the real node: `posttrain dev
up` (the single-node cluster, by default), the chart's evaluation install (bundled MinIO on a
local volume, the images of `make images`), one TrainingRun through the installed operator,
the delete, the uninstall, and `posttrain dev down`. Then what the block leaves is checked:
the run's checkpoint and trajectories are in MinIO's volume, the run's children are gone, the
operator and MinIO pods are gone, the MinIO claim is kept; and after `dev down` nothing of the
node is left on the host (process, mount, cgroup, iptables rule, containerd shim, bridge).

The block's first line, `make images`, is not run: `make test` runs it before the tests, and
the real_cluster tests need the images anyway. The block's `posttrain dev down` runs as a second
shell, after the checks that need the cluster, as from another terminal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.devenv.binaries import client_binary, link_client_tools, pinned_versions
from posttrain.devenv.realnode.cluster import leftovers, running_nodes
from posttrain.processes import wait_for

from ..docblocks import bash_block, processes_of, running
from .conftest import require_real_node

pytestmark = [pytest.mark.real_cluster, pytest.mark.slow, pytest.mark.timeout(3600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
VALUES_DEV = REPO_ROOT / "charts" / "posttrain" / "values-dev.yaml"
RUN_NS, SYSTEM = "ml-demo", "posttrain-system"


@pytest.fixture
def dev_dir() -> Iterator[Path]:
    """A short state directory (the kubelet's sockets lie ~40 characters below it, and a socket
    path may not exceed 107 bytes: test_dev_cli.py). Purged after the test."""
    path = Path(tempfile.mkdtemp(prefix="pt-walk-"))
    yield path
    subprocess.run([sys.executable, "-m", "posttrain.cli", "dev", "down", "--purge"],
                   env={**os.environ, "POSTTRAIN_DEV_DIR": str(path)}, capture_output=True,
                   timeout=600, check=False)  # fmt: skip
    shutil.rmtree(path, ignore_errors=True)


def test_values_dev_names_the_minio_image_build_sh_makes() -> None:
    pin = pinned_versions()["MINIO_VERSION"]
    text = VALUES_DEV.read_text()
    assert "repository: localhost/posttrain/minio" in text and f"tag: {pin}" in text, (
        f"charts/posttrain/values-dev.yaml must name localhost/posttrain/minio:{pin}"
    )


def test_the_readme_walkthrough_trains_on_the_real_node_and_dev_down_leaves_nothing(
    dev_dir: Path, tmp_path: Path
) -> None:
    require_real_node()
    assert not running_nodes(), f"a real node is already running from {running_nodes()}"
    venv_bin = REPO_ROOT / ".venv" / "bin"
    if not (venv_bin / "activate").exists():
        pytest.fail("the block sources .venv/bin/activate: run `make venv` first")
    link_client_tools(venv_bin)  # what `make venv` does: .venv/bin/kubectl and helm
    lines = bash_block("README.md", "End to end on a local cluster")
    assert lines[0].startswith("make images"), lines[0]
    assert lines[-1].startswith("posttrain dev down"), lines[-1]
    activate, down = lines[1], lines[-1]
    assert activate.startswith("source .venv/bin/activate"), activate
    # A person's root shell; KUBECONFIG is what the block's `dev env` exports.
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["POSTTRAIN_DEV_DIR"] = str(dev_dir / "dev")
    log = tmp_path / "block.log"

    def shell(script: list[str], timeout_s: float) -> int:
        with open(log, "ab") as out:  # stopping at the first command that fails
            return subprocess.run(
                ["bash", "-euo", "pipefail", "-c", "\n".join(script)],
                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
            ).returncode  # fmt: skip

    state: dict[str, object] = {}
    try:
        code = shell(lines[1:-1], timeout_s=3300)
        output = log.read_text(errors="replace")
        state_file = dev_dir / "dev" / "state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        assert code == 0, f"the block failed (exit {code}):\n{output}"
        assert state.get("node") == "real", state  # `posttrain dev up` chose the real node
        assert "posttrain dev cluster is up (a real node" in output, output
        assert re.search(r"^posttrain-node\s+Ready\s", output, re.M), output
        assert "STATUS: deployed" in output, output
        # `posttrain watch` ended on Succeeded; `kubectl get -o wide` showed it at step 3 of 3;
        # `posttrain logs` printed the trainer's last lines.
        assert "trainingrun dev-run Succeeded at step 3/3" in output, output
        assert re.search(r"^trainingrun\.posttrain\.io/dev-run\s+Succeeded\s+3\s+3\s", output, re.M)
        assert "run finished: 3 steps" in output, output
        # The run's checkpoint and trajectories were written to the bundled MinIO: its data
        # lies on the node's local volume (MinIO keeps one directory per object).
        workdir = Path(str(state["workdir"]))
        stored = sorted(
            path.relative_to(volume)
            for volume in (workdir / "volumes").glob("local-*")
            for path in volume.glob(f"*/runs/{RUN_NS}/dev-run/*/*")
        )
        assert {"checkpoints", "trajectories"} <= {path.parts[-1] for path in stored}, stored
        # The delete collected the run's and the pool's children; the uninstall the operator
        # and MinIO pods. The MinIO claim stays (resource-policy keep). Collection is
        # asynchronous (the garbage collector, then each pod's grace period).
        kubectl = [str(client_binary("kubectl")), "--kubeconfig", str(state["kubeconfig"])]

        def names(kinds: str, namespace: str) -> list[str]:
            listed = subprocess.run([*kubectl, "get", kinds, "-n", namespace, "-o", "name"],
                                    capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
            return listed.stdout.split()

        def none_left(kinds: str, namespace: str) -> None:
            wait_for(lambda: names(kinds, namespace) == [], timeout_s=180, interval_s=2,
                     what=f"no {kinds} left in {namespace}")  # fmt: skip

        none_left("pods,deploy,svc", RUN_NS)
        none_left("pods,deploy", SYSTEM)
        assert names("pvc", SYSTEM) == ["persistentvolumeclaim/posttrain-minio"]
    finally:
        print(log.read_text(errors="replace")[-20000:] if log.exists() else "no output")
        started = processes_of([str(dev_dir)])
        stopped = shell([activate, down], timeout_s=600)
    output = log.read_text(errors="replace")
    assert stopped == 0, output[-4000:]
    assert "posttrain dev environment stopped; its data is kept" in output, output[-4000:]
    assert len(started) >= 8, started  # etcd, apiserver, controllers, kubelet, containerd...
    assert not running_nodes()
    assert leftovers(workdir) == []
    # Reaping by init may lag a moment behind the kill.
    wait_for(lambda: not any(running(pid) for pid in started), timeout_s=10,
             what="the node's processes to exit")  # fmt: skip
