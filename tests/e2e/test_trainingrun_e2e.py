"""The whole system on the dev control plane: operator + node agent + MinIO + a cpu pool.

A TrainingRun really trains: the operator creates the trainer pod, the node agent runs
`posttrain run` with the checked-out code, the trainer samples from a cpu-engine RolloutPool
(a Deployment the agent's stand-in turned into a pod), writes checkpoints and trajectories to
MinIO and patches its own TrainingRun status with its ServiceAccount token. Killing the
operator and the trainer mid-run resumes from the last checkpoint, with no duplicate pods and
no lost or duplicated trajectories.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import free_port
from posttrain.storage.store import S3Store
from posttrain.storage.trajectories import read_trajectories

from .conftest import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.minio, pytest.mark.slow]

GROUP, VERSION = "posttrain.io", "v1alpha1"
PROMPTS, GROUP_SIZE = 2, 2


@dataclass
class Cluster:
    """One namespace wired like a real install: S3 Secret, operator config, a ready cpu pool."""

    namespace: str
    custom: Any
    core: Any
    config: Any  # posttrain.operator.config.OperatorConfig
    bucket: str

    def create(self, plural: str, body: dict[str, Any]) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", **body}
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, body)

    def status(self, plural: str, name: str) -> dict[str, Any]:
        obj = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, plural, name)
        return obj.get("status") or {}

    def run_prefix(self, name: str) -> str:
        """The run object's storage in the bucket: ``runs/<ns>/<name>/<uid>`` (each object its
        own, so a run created again under the same name starts fresh)."""
        obj = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "trainingruns", name
        )
        return f"runs/{self.namespace}/{name}/{obj['metadata']['uid']}"

    def run_body(self, name: str, max_steps: int, backoff_limit: int) -> dict[str, Any]:
        return {
            "kind": "TrainingRun",
            "metadata": {"name": name},
            "spec": {
                "model": "smollm2-135m-instruct",
                "algorithm": {
                    "groupSize": GROUP_SIZE,
                    "promptsPerStep": PROMPTS,
                    "maxSteps": max_steps,
                    "maxNewTokens": 16,
                    "microBatchSize": 4,
                    "dynamicSampling": False,  # every sample is kept, so counts are exact
                },
                "domains": [
                    {
                        "name": "arithmetic",
                        "dataset": "builtin:arithmetic",
                        "verifier": {"kind": "numeric"},
                    }
                ],
                # The pool's Service URL; the node agent's per-pod /etc/hosts resolves it.
                "rollout": {"pool": "pool", "timeoutSeconds": 300},
                "resources": {"cpu": "1", "memory": "4Gi", "gpusPerNode": 0},
                "checkpoint": {"everySteps": 1, "keepLast": 1},
                "evaluation": {"everySteps": 100, "maxItemsPerDomain": 2},
                "backoffLimit": backoff_limit,
            },
        }

    def wait_finished(self, name: str) -> dict[str, Any]:
        return wait_for(
            lambda: (
                (s := self.status("trainingruns", name)).get("phase") in ("Succeeded", "Failed")
                and s
            ),
            600,
            f"TrainingRun {name} finished",
        )


@contextlib.contextmanager
def running_operator(
    kube_api: Any,
    kubeconfig: Path,
    minio_server: MinioServer,
    namespace: str,
    **config: Any,
) -> Iterator[Cluster]:
    """The operator, in this process, reconciling ``namespace`` of the dev cluster, with the
    credentials Secret the trainer pods read (OperatorConfig.s3_credentials_secret) and the
    run's bucket ``e2e-<namespace>``; ``config`` adds or overrides OperatorConfig fields."""
    from kubernetes import client

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    core = client.CoreV1Api(kube_api)
    env = minio_server.env()
    core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "posttrain-s3"},
            "stringData": {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
        },
    )
    bucket = f"e2e-{namespace}"
    settings = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint=env["POSTTRAIN_S3_ENDPOINT"],
        s3_bucket=bucket,
        **config,
    )
    operator = OperatorThread(settings).start()
    try:
        yield Cluster(namespace, client.CustomObjectsApi(kube_api), core, settings, bucket)
    finally:
        operator.stop()


@pytest.fixture
def cluster(
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
                "metadata": {"name": "pool"},
                "spec": {
                    "model": "smollm2-135m-instruct",
                    "replicas": 1,
                    "engine": "cpu",
                    "port": free_port(),
                    "resources": {"cpu": "1", "memory": "2Gi"},
                },
            },
        )
        wait_for(lambda: c.status("rolloutpools", "pool").get("phase") == "Ready", 180, "pool")
    yield c  # the operator is stopped: each test runs (and kills) its own


def run_operator(c: Cluster) -> Any:
    from posttrain.operator.runtime import OperatorThread

    return OperatorThread(c.config).start()


def trajectory_steps(minio_server: MinioServer, c: Cluster, run: str) -> collections.Counter[int]:
    store = S3Store(
        minio_server.endpoint,
        c.bucket,
        c.run_prefix(run),
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
    )
    return collections.Counter(r["step"] for r in read_trajectories(store, "trajectories"))


def test_tiny_training_run_trains_end_to_end(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    operator = run_operator(cluster)
    try:
        cluster.create("trainingruns", cluster.run_body("tiny", max_steps=2, backoff_limit=0))
        final = cluster.wait_finished("tiny")
    finally:
        operator.stop()
    trainer_log = agent.log_path(cluster.namespace, "tiny-g0-0").read_text()
    pool_log = agent.log_path(cluster.namespace, "pool-0").read_text()
    assert final["phase"] == "Succeeded", trainer_log[-2000:] + "\n--- pool:\n" + pool_log[-3000:]
    # Written by the trainer itself (ServiceAccount token), not by the operator.
    prefix = cluster.run_prefix("tiny")
    assert final["lastCheckpoint"] == f"s3://{cluster.bucket}/{prefix}/checkpoints/step-00000002"
    assert final["evalAccuracy"].keys() == {"arithmetic"}
    stored = {
        obj.object_name
        for obj in minio_server.client().list_objects(
            cluster.bucket, prefix=f"{prefix}/checkpoints/step-00000002/", recursive=True
        )
    }
    assert any(name.endswith(".safetensors") for name in stored), sorted(stored)
    assert trajectory_steps(minio_server, cluster, "tiny") == {1: 4, 2: 4}
    assert final["resumedFrom"] == "fresh start"  # said in the status, and in the log:
    assert "fresh start from smollm2-135m-instruct" in trainer_log, trainer_log[-3000:]


def test_killing_operator_and_trainer_mid_run_resumes_from_the_last_checkpoint(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    name, steps = "resume", 4
    operator = run_operator(cluster)
    try:
        cluster.create("trainingruns", cluster.run_body(name, max_steps=steps, backoff_limit=2))
        # The trainer reports a step after that step's checkpoint is committed.
        wait_for(
            lambda: (cluster.status("trainingruns", name).get("step") or 0) >= 2,
            420,
            "step 2 reported",
        )
    finally:
        operator.stop()
    checkpointed = cluster.status("trainingruns", name)["step"]
    first = cluster.core.read_namespaced_pod(f"{name}-g0-0", cluster.namespace)
    runner = agent.runners[first.metadata.uid]
    assert runner.pid is not None
    os.killpg(runner.pid, signal.SIGKILL)  # the trainer dies with its node process group
    wait_for(
        lambda: (
            cluster.core.read_namespaced_pod(f"{name}-g0-0", cluster.namespace).status.phase
            == "Failed"
        ),
        60,
        "killed trainer pod Failed",
    )

    operator = run_operator(cluster)  # a fresh operator: state only from the apiserver
    try:
        final = cluster.wait_finished(name)
    finally:
        operator.stop()
    log = agent.log_path(cluster.namespace, f"{name}-g1-0").read_text()
    assert final["phase"] == "Succeeded", log[-3000:]
    assert final["step"] == steps and final["restarts"] == 1
    resumed = re.search(r"resumed from checkpoint step (\d+)", log)
    assert resumed is not None, log[-3000:]
    assert checkpointed <= int(resumed.group(1)) < steps
    # The same object (same uid): its own checkpoint, named in its status.
    own = f"s3://{cluster.bucket}/{cluster.run_prefix(name)}/checkpoints"
    assert final["resumedFrom"] == f"{own}/step-{int(resumed.group(1)):08d}", final

    def trainer_pods() -> list[Any]:
        return cluster.core.list_namespaced_pod(
            cluster.namespace, label_selector=f"posttrain.io/run={name}"
        ).items

    # The operator ends the run once the trainer pod exited 0; then no pod is left running.
    wait_for(
        lambda: not any(p.status.phase == "Running" for p in trainer_pods()),
        60,
        "trainer pods finished",
    )
    names = sorted(p.metadata.name for p in trainer_pods())
    assert len(names) == len(set(names)) and set(names) <= {f"{name}-g0-0", f"{name}-g1-0"}
    # Every step's trajectories exactly once: the ones the checkpoint covered were flushed
    # before it, the interrupted step's were re-sampled after the resume.
    assert trajectory_steps(minio_server, cluster, name) == {
        s: PROMPTS * GROUP_SIZE for s in range(1, steps + 1)
    }


def test_a_run_applied_again_starts_fresh_unless_it_asks_to_resume(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    """Issue #35: delete a run and apply it again, and it trains from the base model (its own
    storage, its own uid); with spec.resumeFrom.run it continues the deleted run's checkpoint,
    and says which, in its status and its log."""
    name = "again"

    def delete() -> None:
        cluster.custom.delete_namespaced_custom_object(
            GROUP, VERSION, cluster.namespace, "trainingruns", name
        )
        wait_for(
            lambda: (
                name
                not in {
                    i["metadata"]["name"]
                    for i in cluster.custom.list_namespaced_custom_object(
                        GROUP, VERSION, cluster.namespace, "trainingruns"
                    )["items"]
                }
            ),
            60,
            "run deleted",
        )

    operator = run_operator(cluster)
    try:
        cluster.create("trainingruns", cluster.run_body(name, max_steps=1, backoff_limit=0))
        first = cluster.wait_finished(name)
        first_prefix = cluster.run_prefix(name)
        assert first["phase"] == "Succeeded" and first["resumedFrom"] == "fresh start", first
        delete()

        cluster.create("trainingruns", cluster.run_body(name, max_steps=1, backoff_limit=0))
        second = cluster.wait_finished(name)
        second_prefix = cluster.run_prefix(name)
        assert second_prefix != first_prefix
        assert second["phase"] == "Succeeded" and second["resumedFrom"] == "fresh start", second
        assert second["lastCheckpoint"] == (
            f"s3://{cluster.bucket}/{second_prefix}/checkpoints/step-00000001"
        )
        delete()

        body = cluster.run_body(name, max_steps=2, backoff_limit=0)
        body["spec"]["resumeFrom"] = {"run": name}
        cluster.create("trainingruns", body)
        third = cluster.wait_finished(name)
    finally:
        operator.stop()
    # The newest earlier object's checkpoint (the second's), one step more on top of it.
    began = f"s3://{cluster.bucket}/{second_prefix}/checkpoints/step-00000001"
    # The agent keeps each pod's log under its name (the three objects' pods share it).
    log = agent.log_path(cluster.namespace, f"{name}-g0-0").read_text()
    assert third["phase"] == "Succeeded" and third["resumedFrom"] == began, (third, log[-3000:])
    assert f"resuming from checkpoint {began} (step 1)" in log, log[-3000:]
    assert third["step"] == 2
    assert third["lastCheckpoint"] == (
        f"s3://{cluster.bucket}/{cluster.run_prefix(name)}/checkpoints/step-00000002"
    )
