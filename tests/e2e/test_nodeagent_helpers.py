"""The node agent's pure helpers (no cluster): env expansion, downward API, bwrap argv."""

from __future__ import annotations

import doctest
import subprocess
import tempfile
from pathlib import Path

import pytest

from posttrain.devenv import deployments, garbage, kubeletlogs, nodeagent, podprocess
from posttrain.devenv.podprocess import PodSpecError, bwrap_prefix, field_ref_value


@pytest.mark.parametrize("module", [nodeagent, deployments, garbage, podprocess, kubeletlogs])
def test_docstring_examples_hold(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted >= 2
    assert result.failed == 0


def test_unsupported_field_ref_names_the_supported_ones() -> None:
    with pytest.raises(PodSpecError, match=r"metadata\.name"):
        field_ref_value({"metadata": {}}, "spec.containers[0].image")


def test_mount_points_are_made_in_the_sandbox_not_on_the_host(tmp_path: Path) -> None:
    volume = tmp_path / "vol"
    volume.mkdir()
    (volume / "run.yaml").write_text("steps: 1\n")
    target = "/posttrain-nodeagent-test/etc/posttrain"
    argv = bwrap_prefix([(str(volume), target, True)])
    # The new top-level directory is created on bwrap's tmpfs root, never bound from the host.
    top = argv.index("/posttrain-nodeagent-test")
    assert argv[top - 3 : top + 1] == ["--perms", "0755", "--dir", "/posttrain-nodeagent-test"]
    seen = subprocess.run(
        [*argv, "--", "cat", f"{target}/run.yaml"], capture_output=True, text=True, check=True
    )
    assert seen.stdout == "steps: 1\n"
    assert not Path("/posttrain-nodeagent-test").exists()


def test_a_dropped_to_user_reaches_the_interpreter_and_nothing_beside_it() -> None:
    # A pod running as uid 10001 on the agent: its stand-in interpreter may sit under a
    # directory only root may enter (pyenv under /root). ``reach`` opens the way down to it
    # and hides the closed directory's other entries, as the host's mode hid them.
    # Under /tmp itself: pytest's own tmp_path sits below 0700 directories.
    with tempfile.TemporaryDirectory(dir="/tmp") as top:
        base = Path(top)
        base.chmod(0o755)
        closed = base / "home"
        prefix = closed / "lang" / "3.11"
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "tool").write_text("#!/bin/sh\necho reached\n")
        (prefix / "bin" / "tool").chmod(0o755)
        (closed / "secret").write_text("root's\n")
        closed.chmod(0o700)
        script = f"{prefix}/bin/tool; ls {closed}; cat {closed}/secret"
        drop = ["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", "sh", "-c", script]

        def run(reach: list[str]) -> subprocess.CompletedProcess[str]:
            argv = [*bwrap_prefix([], reach=reach), "--chdir", "/", "--", *drop]
            return subprocess.run(argv, capture_output=True, text=True)

        closed_off = run([])
        assert "reached" not in closed_off.stdout, closed_off.stdout
        assert "Permission denied" in closed_off.stderr
        opened = run([str(prefix)])
        assert opened.stdout.splitlines() == ["reached", "lang"], opened.stderr
        assert "No such file" in opened.stderr  # the secret is not in the sandbox's view
        assert oct(closed.stat().st_mode & 0o777) == "0o700"  # the host's mode is untouched
    assert podprocess.interpreter_prefix(Path("/nonexistent-venv/bin")) == []


def test_agent_stops_with_one_message_when_the_apiserver_is_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the control plane stopped under it, the agent logs one warning and one error
    and stops, instead of a traceback every poll (9,495 of them in 14 minutes)."""
    import logging
    import socket

    from kubernetes import client

    with socket.socket() as sock:  # a port nothing listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{port}"
    configuration.verify_ssl = False
    configuration.retries = 0
    agent = nodeagent.NodeAgent(
        client.ApiClient(configuration),
        workdir=tmp_path,
        serve_logs=False,
        poll_interval_s=0.05,
        unreachable_exit_s=1.0,
    )
    with caplog.at_level(logging.INFO, logger="posttrain.devenv.nodeagent"):
        agent._loop()  # returns on its own once the apiserver was gone for 1 s
    assert agent.gave_up is not None and "unreachable" in agent.gave_up
    records = [r for r in caplog.records if r.name == "posttrain.devenv.nodeagent"]
    assert [r.levelname for r in records] == ["WARNING", "ERROR"], [r.getMessage() for r in records]
    assert not any(r.exc_info for r in records)
