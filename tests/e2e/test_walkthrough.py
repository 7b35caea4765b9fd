"""docs/e2e.md's two command blocks on the stand-in node, taken out of the page and run in bash
as written: the control plane alone, and a TrainingRun end to end with `posttrain dev agent`.

A private ``POSTTRAIN_DEV_DIR`` keeps the test's dev environment apart from a person's; the
rest is the page's text: ``posttrain dev up --node none``, ``eval "$(posttrain dev env)"``,
the agent and the operator started with ``&``, ``kubectl apply``, ``posttrain watch``,
``kubectl get -o wide``, ``posttrain logs``, and ``posttrain dev down`` (run as a second
shell, as from another terminal), after which no process the block started may be left
running. The README's walkthrough on the real node: tests/real_cluster/test_readme_walkthrough.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.devenv.binaries import link_client_tools

from ..docblocks import bash_block, processes_of, running

pytestmark = [pytest.mark.cluster, pytest.mark.minio]

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = "docs/e2e.md"
VENV_KUBECTL = REPO_ROOT / ".venv" / "bin" / "kubectl"  # the kubectl of the page's commands


@pytest.fixture
def person_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a person in the repository root after ``make venv``, with a
    private dev state dir."""
    if Path(sys.executable).parent != VENV_KUBECTL.parent:
        pytest.skip(
            "the page's commands run posttrain from .venv (source .venv/bin/activate): run "
            "the tests with the repository's own .venv (make venv)"
        )
    link_client_tools(VENV_KUBECTL.parent)  # what make venv does: .venv/bin/kubectl and helm
    return {**os.environ, "POSTTRAIN_DEV_DIR": str(tmp_path / "dev")}


def run_script(lines: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    """Run ``lines`` in one bash, stopping at the first failing command; output goes to
    ``log`` (a file, not a pipe: the ``&`` processes keep writing after bash exits)."""
    script = "set -e\n" + "\n".join(lines) + "\n"
    with open(log, "ab") as out:
        return subprocess.run(
            ["bash", "-c", script],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        ).returncode


def test_local_control_plane_block(person_env: dict[str, str], tmp_path: Path) -> None:
    lines = bash_block(DOC, "The control plane alone")
    log = tmp_path / "out.log"
    try:
        code = run_script(lines, person_env, log, timeout_s=300)
        output = log.read_text()
        assert code == 0, output
        assert "posttrain dev environment is up" in output, output
        assert "trainingrun.posttrain.io/arith-code created" in output, output
        assert "posttrain dev environment stopped and removed" in output, output
    finally:
        subprocess.run(
            [".venv/bin/posttrain", "dev", "down"],
            cwd=REPO_ROOT,
            env=person_env,
            capture_output=True,
            timeout=120,
        )


@pytest.mark.slow
@pytest.mark.timeout(3000)  # a real 3-step run: ~2 min idle, over 15 min at a load of 20
def test_the_stand_in_walkthrough_trains_a_run(person_env: dict[str, str], tmp_path: Path) -> None:
    lines = bash_block(DOC, "End to end on the stand-in node")
    activate, down = lines[0], lines[-1]
    assert activate.startswith("source .venv/bin/activate"), activate
    assert down.startswith("posttrain dev down"), down
    log = tmp_path / "walkthrough.log"
    dev_dir = person_env["POSTTRAIN_DEV_DIR"]
    try:
        code = run_script(lines[:-1], person_env, log, timeout_s=2700)
        output = log.read_text()
        assert code == 0, output[-6000:]
        assert "trainingrun dev-run Succeeded at step 3/3" in output, output[-6000:]
        wide = next(line for line in output.splitlines() if line.startswith("NAME"))
        assert "CHECKPOINT" in wide.split(), wide  # `kubectl get tr,rp -o wide`
        state = json.loads((Path(dev_dir) / "state.json").read_text())
        kept = Path(state["workdir"]) / "nodeagent"
        trainer_log = (kept / "default_dev-run-g0-0.log").read_text()
        # The trainer found the pool's ready replicas through the RolloutPool's status (so each
        # weight version reaches every replica, not one behind a Service) and sampled from them.
        assert re.search(
            r"sampling from rollout endpoint\(s\) http://127\.\d+\.\d+\.\d+:8000", trainer_log
        ), trainer_log[:3000]
        # pods/log through the apiserver, served by the agent (no "no such host").
        kubectl = [str(VENV_KUBECTL), "--kubeconfig", state["kubeconfig"]]
        pods = subprocess.run(
            [*kubectl, "get", "pods", "-l", "posttrain.io/pool=dev-pool", "-o", "name"],
            env=person_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert pods, "no pool pod"
        pool_log = subprocess.run(
            [*kubectl, "logs", pods[0]], env=person_env, capture_output=True, text=True
        )
        assert pool_log.returncode == 0 and pool_log.stdout.strip(), pool_log.stderr
        started = processes_of(
            [f"POSTTRAIN_DEV_DIR={dev_dir}", state["minio_endpoint"], state["workdir"]]
        )
        assert len(started) >= 3, started  # the agent, the operator and the pool's server
    finally:
        stopped = subprocess.run(
            ["bash", "-c", f"{activate}\n{down}"],
            cwd=REPO_ROOT,
            env=person_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped operator" in stopped.stdout and "stopped agent" in stopped.stdout, (
        stopped.stdout
    )
    deadline = time.monotonic() + 10  # reaping by init may lag a moment behind the kill
    while any(running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in started if running(pid)]
    assert not left, [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]
