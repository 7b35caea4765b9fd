"""A trainer whose RolloutPool has no ready replica waits, says so, then fails the run.

On the dev cluster (operator, node agent, MinIO): the run names a pool scaled to zero. The
trainer pod reads the pool's status, finds no replica, reports it in ``status.rollout``,
which the operator shows as the run's ``RolloutAvailable=False`` condition (reason
``NoReadyReplica``, naming the pool and the wait), and after ``spec.rollout.timeoutSeconds``
the trainer exits non-zero and the run fails with the reason in its message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import NodeAgent

from .conftest import wait_logged
from .test_trainingrun_e2e import Cluster, running_operator

pytestmark = [pytest.mark.cluster, pytest.mark.minio, pytest.mark.slow]

WAIT_S = 45  # spec.rollout.timeoutSeconds: how long the trainer waits for a replica


@pytest.fixture
def empty_pool_cluster(
    crds_installed: None,
    kube_api: Any,
    kubeconfig: Path,
    minio_server: MinioServer,
    agent: NodeAgent,
    namespace: str,
) -> Iterator[Cluster]:
    with running_operator(kube_api, kubeconfig, minio_server, namespace) as c:
        c.create(
            "rolloutpools",
            {
                "kind": "RolloutPool",
                "metadata": {"name": "empty"},
                "spec": {"model": "smollm2-135m-instruct", "replicas": 0, "engine": "cpu"},
            },
        )
        yield c


def condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), None)


def test_trainer_without_a_ready_replica_waits_with_a_condition_then_fails(
    empty_pool_cluster: Cluster, agent: NodeAgent
) -> None:
    c = empty_pool_cluster
    body = c.run_body("waits", max_steps=1, backoff_limit=0)
    body["spec"]["rollout"] = {"pool": "empty", "timeoutSeconds": WAIT_S}
    c.create("trainingruns", body)

    # The trainer pod starts (imports torch: a minute or more under load), finds no replica.
    waiting = wait_logged(
        lambda: (
            (cond := condition(c.status("trainingruns", "waits"), "RolloutAvailable"))
            and cond["status"] == "False"
            and cond
        ),
        900,
        "RolloutAvailable=False on the run",
    )
    assert waiting["reason"] == "NoReadyReplica", waiting
    assert "RolloutPool empty has no ready replica" in waiting["message"], waiting
    assert f"waits up to {WAIT_S}s" in waiting["message"], waiting
    assert c.status("trainingruns", "waits")["rollout"] == {
        "pool": "empty",
        "available": False,
        "readyReplicas": 0,
        "message": waiting["message"].split("has no ready replica: ", 1)[1],
    }

    final = wait_logged(
        lambda: (
            (s := c.status("trainingruns", "waits")).get("phase") in ("Succeeded", "Failed") and s
        ),
        900,
        "the run to end",
    )
    trainer_log = agent.log_path(c.namespace, "waits-g0-0").read_text()
    assert final["phase"] == "Failed", trainer_log[-3000:]
    assert f"RolloutPool {c.namespace}/empty has no ready replica after {WAIT_S}s" in trainer_log
    assert "step" not in final or not final["step"]  # nothing was trained
