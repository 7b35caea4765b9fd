"""`posttrain dev up` / `status` / `down`, as a person runs them: the real node comes up (the
default) with its images, reports its components' start times, serves kubectl, and `dev down`
leaves nothing behind. Runs before the session's shared node starts (one node at a time)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.devenv.binaries import client_binary
from posttrain.devenv.realnode.cluster import leftovers, running_nodes

from .conftest import require_real_node

pytestmark = [pytest.mark.real_cluster, pytest.mark.timeout(1800)]


@pytest.fixture
def dev_dir() -> Iterator[Path]:
    """A short state directory: the kubelet puts unix sockets ~40 characters below it, and a
    socket path may not exceed 107 bytes. pytest's tmp_path
    (/tmp/pytest-of-root/pytest-<N>/<test name>0/) left too little room once N had two digits:
    the kubelet then failed with "bind: invalid argument"."""
    path = Path(tempfile.mkdtemp(prefix="pt-dev-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_dev_up_real_node_status_and_down_leave_nothing(dev_dir: Path) -> None:
    require_real_node()
    assert not running_nodes(), f"a real node is already running from {running_nodes()}"
    env = {**os.environ, "POSTTRAIN_DEV_DIR": str(dev_dir / "dev")}
    posttrain = [sys.executable, "-m", "posttrain.cli"]

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*posttrain, "dev", *args], env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip

    up = run("up", "--images", "operator,sandbox", timeout=1200)  # the real node by default
    workdir = dev_dir / "dev" / "node"
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "a real node" in up.stdout and "node-ready" in up.stdout, up.stdout
        again = run("up", "--node", "real")  # idempotent: the healthy node is reused
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout
        other = run("up", "--node", "none")  # never a second environment beside it
        assert other.returncode == 2 and "with --node real is running" in other.stderr, other
        status = run("status")
        assert status.returncode == 0 and "healthy" in status.stdout, status.stdout
        state = json.loads((dev_dir / "dev" / "state.json").read_text())
        nodes = subprocess.run(
            [str(client_binary("kubectl")), "--kubeconfig", state["kubeconfig"], "get", "nodes",
             "-o", "jsonpath={.items[0].status.conditions[?(@.type=='Ready')].status}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert nodes.stdout == "True", nodes.stderr
    finally:
        down = run("down", timeout=600)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not running_nodes()
    assert leftovers(workdir) == []
