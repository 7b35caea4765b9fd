"""`posttrain dev up/down/status` as a person runs them: real processes, real ports."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.devenv.process import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[2]


def posttrain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=180,
    )


@pytest.mark.cluster
def test_up_is_idempotent_and_down_stops_everything(tmp_path: Path, kubectl_bin: Path) -> None:
    env = {"POSTTRAIN_DEV_DIR": str(tmp_path)}
    first = posttrain("dev", "up", "--node", "none", env=env)
    assert first.returncode == 0, first.stderr
    assert "kubeconfig:" in first.stdout

    state = json.loads((tmp_path / "state.json").read_text())
    try:
        second = posttrain("dev", "up", env=env)  # reused as what it is: no --node needed
        assert second.returncode == 0 and "already running" in second.stdout
        real = posttrain("dev", "up", "--node", "real", env=env)
        assert real.returncode == 2 and "with --node none is running" in real.stderr, real
        assert json.loads((tmp_path / "state.json").read_text())["pids"] == state["pids"]
        resources = subprocess.run(
            [
                str(kubectl_bin),
                "--kubeconfig",
                state["kubeconfig"],
                "api-resources",
                "--api-group=posttrain.io",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "trainingruns" in resources and "rolloutpools" in resources
        exports = posttrain("dev", "env", env=env).stdout
        assert f"export KUBECONFIG={state['kubeconfig']}" in exports
        assert f"export POSTTRAIN_OPERATOR_S3_ENDPOINT={state['minio_endpoint']}" in exports
        # The Secret the operator hands trainer pods, with the MinIO keys of this environment.
        key = subprocess.run(
            [
                str(kubectl_bin),
                "--kubeconfig",
                state["kubeconfig"],
                "get",
                "secret",
                "posttrain-s3",
                "-n",
                "default",
                "-o",
                "jsonpath={.data.AWS_ACCESS_KEY_ID}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        import base64

        assert base64.b64decode(key).decode() == state["minio_access_key"]
    finally:
        down = posttrain("dev", "down", env=env)
    assert down.returncode == 0
    assert not any(pid_alive(p) for p in state["pids"])
    assert posttrain("dev", "status", env=env).returncode == 1


@pytest.mark.cluster
def test_port_in_use_is_reported_and_nothing_is_left_running(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = ("dev", "up", "--node", "none", "--minio-port", str(port))
        result = posttrain(*up, env={"POSTTRAIN_DEV_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
    assert not (tmp_path / "state.json").exists()
    # The control plane that did start before MinIO failed was stopped again.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


def test_missing_go_toolchain_is_explained(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "POSTTRAIN_BIN_DIR": str(tmp_path), "HOME": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "ensure-binaries.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert "the Go toolchain is missing" in result.stderr


@pytest.mark.cluster
@pytest.mark.minio
def test_a_broken_environment_restarts_in_place_and_only_purge_deletes(
    tmp_path: Path, kubectl_bin: Path
) -> None:
    """MinIO dies under a running environment: `dev status` says so, `dev up` restarts it in
    place with its TrainingRuns, objects, CA and keys, and the operator registered before is
    still stopped by `dev down`; `dev down` keeps the data for the next `dev up`; `--purge`
    says what it deletes and deletes it."""
    import signal
    import time

    from minio import Minio

    from posttrain.devenv.registry import register

    env = {"POSTTRAIN_DEV_DIR": str(tmp_path)}
    assert posttrain("dev", "up", "--node", "none", env=env).returncode == 0
    state = json.loads((tmp_path / "state.json").read_text())
    kubectl = [str(kubectl_bin), "--kubeconfig", state["kubeconfig"]]
    operator = subprocess.Popen(["sleep", "600"])  # stands for `posttrain operator`
    try:
        subprocess.run([*kubectl, "apply", "-f", str(REPO_ROOT / "examples/dev-run.yaml")],
                       check=True, capture_output=True)  # fmt: skip
        s3 = Minio(state["minio_endpoint"], access_key=state["minio_access_key"],
                   secret_key=state["minio_secret_key"], secure=False)  # fmt: skip
        s3.make_bucket("keep")
        s3.put_object("keep", "runs/a/checkpoint", io.BytesIO(b"weights"), 7)
        ca_before = (Path(state["workdir"]) / "controlplane/pki/ca.crt").read_bytes()
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("POSTTRAIN_DEV_DIR", str(tmp_path))
            assert register("operator", operator.pid) is not None

        os.kill(state["pids"][-1], signal.SIGKILL)  # MinIO
        time.sleep(1)
        status = posttrain("dev", "status", env=env)
        assert status.returncode == 1 and "stopped or unhealthy" in status.stdout, status.stdout

        again = posttrain("dev", "up", env=env)  # restarts as what it was: no --node needed
        assert again.returncode == 0, again.stdout + again.stderr
        assert "restarting the dev environment in place" in again.stdout, again.stdout
        restarted = json.loads((tmp_path / "state.json").read_text())
        assert restarted["node"] == "none"
        assert restarted["apiserver"] == state["apiserver"]
        assert restarted["minio_endpoint"] == state["minio_endpoint"]
        assert (Path(state["workdir"]) / "controlplane/pki/ca.crt").read_bytes() == ca_before
        got = subprocess.run([*kubectl, "get", "trainingrun", "dev-run", "-o", "name"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        assert got.stdout.strip() == "trainingrun.posttrain.io/dev-run"
        assert s3.get_object("keep", "runs/a/checkpoint").read() == b"weights"

        down = posttrain("dev", "down", env=env)
        assert down.returncode == 0 and "its data is kept in" in down.stdout, down.stdout
        assert operator.wait(timeout=30) is not None  # the registry survived the restart
        assert posttrain("dev", "up", "--node", "none", env=env).returncode == 0
        assert s3.get_object("keep", "runs/a/checkpoint").read() == b"weights"

        purge = posttrain("dev", "down", "--purge", env=env)
        assert purge.returncode == 0, purge.stdout + purge.stderr
        assert "1 TrainingRun(s), 1 object(s) in MinIO" in purge.stdout, purge.stdout
        assert not Path(state["workdir"]).exists() and not (tmp_path / "state.json").exists()
    finally:
        operator.kill()
        posttrain("dev", "down", "--purge", env=env)


def test_dev_up_refuses_where_the_real_node_cannot_run_and_names_the_fallback(
    tmp_path: Path,
) -> None:
    """Without containerd, runc, iptables and podman on PATH, `dev up` (the real node by
    default) refuses before starting anything: it names what is missing, what provides it, and
    the explicit stand-in; it never falls back to it on its own."""
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    env = {"POSTTRAIN_DEV_DIR": str(tmp_path / "dev"), "PATH": str(empty_path)}
    for args in ((), ("--node", "real")):
        result = posttrain("dev", "up", *args, env=env)
        said = result.stderr
        assert result.returncode == 2, result.stdout + said
        assert "starts a real single-node cluster, which cannot run on this machine" in said
        assert "command containerd, ctr, runc, iptables, ip, podman: `make system-deps`" in said
        assert said.count("make system-deps") == 1, said  # each missing piece said once
        assert "`posttrain dev up --node none`" in said and "docs/e2e.md" in said, said
        assert "posttrain dev environment is up" not in result.stdout
        assert not (tmp_path / "dev").exists()  # nothing started, nothing recorded


def test_missing_images_are_named_with_make_images() -> None:
    """The image check reads podman's store: an image `make images` never builds is missing,
    with `make images` as the fix (without podman, podman itself is what is missing)."""
    from posttrain.devenv.realnode.requirements import missing_for_real_node

    missing = [str(item) for item in missing_for_real_node(["ghcr.io/posttrain/none:0"])]
    if any("podman" in item for item in missing):
        assert not any("ghcr.io/posttrain/none:0" in item for item in missing), missing
    else:
        assert any(
            item.startswith("image ")
            and "ghcr.io/posttrain/none:0" in item
            and item.endswith("`make images` builds them")
            for item in missing
        ), missing


def test_the_stand_in_agent_refuses_a_real_node_environment(tmp_path: Path) -> None:
    """A node agent beside the real kubelet would bind and run the same pods twice."""
    state = {
        "workdir": str(tmp_path / "node"), "kubeconfig": str(tmp_path / "kubeconfig"),
        "apiserver": "https://10.244.0.1:6443", "minio_endpoint": "10.244.0.1:9000",
        "minio_access_key": "a", "minio_secret_key": "b", "pids": [], "node": "real",
    }  # fmt: skip
    (tmp_path / "state.json").write_text(json.dumps(state))
    result = posttrain("dev", "agent", env={"POSTTRAIN_DEV_DIR": str(tmp_path)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the stand-in agent is for `posttrain dev up --node none`" in result.stderr
