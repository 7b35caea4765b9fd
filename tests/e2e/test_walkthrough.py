"""The README's dev-cluster walkthrough, command for command, as a person types it.

`posttrain dev up`, `posttrain dev agent`, `posttrain operator --standalone` and
`kubectl apply -f examples/dev-run.yaml` run as separate processes with the environment
`posttrain dev env` prints; the TrainingRun samples from the RolloutPool through its Service
name (resolved by the node agent's per-pod /etc/hosts), trains to its last step and
`kubectl get tr` shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.devenv.process import stop_pid

pytestmark = [pytest.mark.cluster, pytest.mark.minio, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
POSTTRAIN = [sys.executable, "-m", "posttrain"]


def dev_env(dev_dir: Path) -> dict[str, str]:
    """The shell environment after `eval "$(posttrain dev env)"`."""
    env = {**os.environ, "POSTTRAIN_DEV_DIR": str(dev_dir)}
    exports = subprocess.run(
        [*POSTTRAIN, "dev", "env"], env=env, capture_output=True, text=True, check=True
    ).stdout
    for line in exports.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    return env


@pytest.fixture
def dev_cluster(tmp_path: Path, kubectl_bin: Path) -> Iterator[tuple[dict[str, str], Path]]:
    """`posttrain dev up` in a private state dir; `posttrain dev down` afterwards."""
    base = {**os.environ, "POSTTRAIN_DEV_DIR": str(tmp_path / "dev")}
    up = subprocess.run([*POSTTRAIN, "dev", "up"], env=base, capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        env = dev_env(tmp_path / "dev")
        env["PATH"] = f"{kubectl_bin.parent}:{env['PATH']}"
        yield env, tmp_path
    finally:
        subprocess.run([*POSTTRAIN, "dev", "down"], env=base, capture_output=True)


def kubectl(kubectl_bin: Path, env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [str(kubectl_bin), *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_readme_walkthrough_trains_on_the_dev_cluster(
    dev_cluster: tuple[dict[str, str], Path], kubectl_bin: Path
) -> None:
    env, tmp_path = dev_cluster
    agent_log = open(tmp_path / "agent.log", "wb")  # noqa: SIM115 (closed in finally)
    operator_log = open(tmp_path / "operator.log", "wb")  # noqa: SIM115
    agent = subprocess.Popen(
        [*POSTTRAIN, "dev", "agent"],
        env=env,
        stdout=agent_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    operator = subprocess.Popen(
        [*POSTTRAIN, "operator", "--standalone"],
        env=env,
        stdout=operator_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pods_dir = Path(json.loads((tmp_path / "dev" / "state.json").read_text())["workdir"])
    try:
        kubectl(kubectl_bin, env, "apply", "-f", str(REPO_ROOT / "examples/dev-run.yaml"))
        deadline = time.monotonic() + 900
        phase = ""
        while time.monotonic() < deadline and phase not in ("Succeeded", "Failed"):
            time.sleep(2)
            assert agent.poll() is None and operator.poll() is None, "agent or operator exited"
            phase = kubectl(
                kubectl_bin, env, "get", "tr", "dev-run", "-o", "jsonpath={.status.phase}"
            )
        logs = {p.name: p.read_text() for p in (pods_dir / "nodeagent").glob("*.log")}
        assert phase == "Succeeded", json.dumps({k: v[-3000:] for k, v in logs.items()}, indent=1)
        table = kubectl(kubectl_bin, env, "get", "tr", "dev-run")
        header, row = table.splitlines()[:2]
        columns = dict(zip(header.split(), row.split(), strict=False))
        assert columns["PHASE"] == "Succeeded" and columns["STEP"] == "3", table
        # Sampled through the Service name, not a pod IP: the agent resolved it.
        trainer_log = logs["default_dev-run-g0-0.log"]
        assert "endpoint(s) http://dev-pool.default.svc:8000" in trainer_log, trainer_log[:3000]
        status = json.loads(kubectl(kubectl_bin, env, "get", "tr", "dev-run", "-o", "json"))
        assert status["status"]["lastCheckpoint"].startswith("s3://posttrain/runs/default/dev-run/")
        pool = kubectl(
            kubectl_bin, env, "get", "rp", "dev-pool", "-o", "jsonpath={.status.readyReplicas}"
        )
        assert pool == "1"
    finally:
        for process in (operator, agent):
            stop_pid(process.pid)
            process.wait(timeout=30)
        agent_log.close()
        operator_log.close()
