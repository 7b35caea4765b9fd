"""The operator as the CLI runs it (its own event loop and thread pool, runtime.py) stops
cleanly on SIGTERM, as the kubelet sends it, and on SIGINT (Ctrl-C): it says so, releases
its Lease, so a successor need not wait it out, and the process exits 0 soon after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from posttrain.devenv.process import free_port
from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.leader import LEASE_API_VERSION

from .conftest import wait_for

pytestmark = pytest.mark.cluster


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_operator_and_releases_its_lease(
    crds_installed: None,
    kubeconfig: Path,
    kube: KubeClient,
    namespace: str,
    tmp_path: Path,
    sig: signal.Signals,
) -> None:
    port = free_port()
    log = tmp_path / "operator.log"
    env = {**os.environ, "POD_NAME": "shutdown-test"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain",
            "operator",
            "--namespace",
            namespace,
            "--kubeconfig",
            str(kubeconfig),
            "--liveness-port",
            str(port),
            "--lease",
            "shutdown-test",
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    lease = resource_path(LEASE_API_VERSION, "leases", namespace, "shutdown-test")

    def holder() -> str:
        status, body = kube.request("GET", lease, ok=(200, 404))
        return str((body.get("spec") or {}).get("holderIdentity") or "") if status == 200 else ""

    try:
        wait_for(lambda: answers(port), what="/healthz")
        wait_for(lambda: holder() == "shutdown-test", what="the operator to take the Lease")
        process.send_signal(sig)
        assert process.wait(20) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    output = log.read_text()
    assert f"signal {sig.name} received; operator stopping" in output, output[-3000:]
    assert "posttrain operator stopped" in output, output[-3000:]
    assert holder() == "", "the Lease was not released"
    assert not answers(port)
