"""HA: two replicas with kopf peering; only the higher-priority one reconciles."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, list_pods, wait_for

pytestmark = pytest.mark.cluster


def test_only_the_highest_priority_replica_works(
    crds_installed: None, kubeconfig: Path, kube: KubeClient, namespace: str
) -> None:
    # crds/kopf-peering.yaml is applied by crds_installed; the peering object is per namespace.
    kube.request(
        "POST",
        resource_path("kopf.dev/v1", "kopfpeerings", namespace),
        {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": "posttrain-operator", "namespace": namespace},
        },
    )

    def replica(priority: int) -> OperatorThread:
        return OperatorThread(
            OperatorConfig(
                kubeconfig=str(kubeconfig),
                namespaces=(namespace,),
                standalone=False,
                priority=priority,
                resync_seconds=1.0,
            )
        ).start()

    leader = replica(100)
    follower = None
    try:
        wait_for(
            lambda: kube.request(
                "GET", resource_path("kopf.dev/v1", "kopfpeerings", namespace, "posttrain-operator")
            )[1].get("status"),
            what="leader announced in the KopfPeering",
        )
        follower = replica(10)
        for i in range(5):
            create_cr(
                kube,
                "sandboxtasks",
                namespace,
                {
                    "kind": "SandboxTask",
                    "metadata": {"name": f"ha-{i}"},
                    "spec": {"command": ["true"]},
                },
            )
        wait_for(lambda: len(list_pods(kube, namespace)) == 5, what="5 pods")
        assert len(leader.controller.state.tasks.snapshot_keys()) == 5
        # The follower's watches are paused: it never even saw the tasks.
        assert follower.controller.state.tasks.snapshot_keys() == []
    finally:
        if follower is not None:
            follower.stop()
        leader.stop()
