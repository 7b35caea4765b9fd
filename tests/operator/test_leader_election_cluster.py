"""HA: two operator replicas elect a leader on a Lease (leader.py); only the leader
reconciles, and the other takes over when the leader stops. Both answer /healthz (health.py)
all along, each saying whether it leads."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.process import free_port
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.leader import LEASE_API_VERSION
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, list_pods, wait_for

pytestmark = pytest.mark.cluster


def healthz(op: OperatorThread) -> dict[str, Any]:
    """The replica's liveness answer (what the chart's probes read)."""
    url = f"http://127.0.0.1:{op.config.liveness_port}/healthz"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        body: dict[str, Any] = json.loads(response.read())
        return body


def test_one_replica_works_and_the_other_takes_over_when_it_stops(
    crds_installed: None, kubeconfig: Path, kube: KubeClient, namespace: str
) -> None:
    lease = resource_path(LEASE_API_VERSION, "leases", namespace, "posttrain-operator")

    def holder() -> str:
        status, body = kube.request("GET", lease, ok=(200, 404))
        return str((body.get("spec") or {}).get("holderIdentity") or "") if status == 200 else ""

    def replica(identity: str) -> OperatorThread:
        return OperatorThread(
            OperatorConfig(
                kubeconfig=str(kubeconfig),
                namespaces=(namespace,),
                standalone=False,
                identity=identity,
                # Short timings, so a takeover after a crash would fit the test too.
                lease_duration_seconds=3.0,
                lease_renew_deadline_seconds=2.0,
                lease_retry_period_seconds=0.2,
                resync_seconds=1.0,
                liveness_port=free_port(),
            )
        ).start()

    def task(name: str) -> None:
        create_cr(
            kube,
            "sandboxtasks",
            namespace,
            {"kind": "SandboxTask", "metadata": {"name": name}, "spec": {"command": ["true"]}},
        )

    leader = replica("first")
    follower = None
    try:
        wait_for(lambda: holder() == "first", what="the first replica to take the Lease")
        follower = replica("second")
        for i in range(5):
            task(f"ha-{i}")
        wait_for(lambda: len(list_pods(kube, namespace)) == 5, what="5 pods")
        assert len(leader.controller.state.tasks.snapshot_keys()) == 5
        # The follower's informers never listed: it has not even seen the tasks.
        assert follower.controller.state.tasks.snapshot_keys() == []
        assert holder() == "first"
        # Both are alive (a standby must pass its probes too); each says whether it leads.
        assert healthz(leader) == {"status": "ok", "leading": True}
        assert healthz(follower) == {"status": "ok", "leading": False}

        # A clean stop releases the Lease: the follower takes over without waiting it out.
        leader.stop()
        leader = None
        wait_for(lambda: holder() == "second", timeout_s=5, what="the takeover")
        task("after")
        wait_for(lambda: len(list_pods(kube, namespace)) == 6, what="the new leader's pod")
        assert len(follower.controller.state.tasks.snapshot_keys()) == 6
        assert healthz(follower)["leading"] is True
    finally:
        if follower is not None:
            follower.stop()
        if leader is not None:
            leader.stop()
