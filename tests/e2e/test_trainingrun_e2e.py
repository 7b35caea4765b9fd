"""The whole system on the dev control plane: operator + node agent + MinIO + a cpu pool.

A two-step TrainingRun really trains: the operator creates the trainer pod, the node agent
runs `posttrain run` with the checked-out code, the trainer samples from a cpu-engine
RolloutPool (a Deployment the agent's stand-in turned into a pod), writes checkpoints to
MinIO and patches its own TrainingRun status with its ServiceAccount token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import free_port

from .conftest import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.minio, pytest.mark.slow]

GROUP, VERSION = "posttrain.io", "v1alpha1"


def test_tiny_training_run_trains_end_to_end(
    crds_installed: None,
    kube_api: Any,
    kubeconfig: Path,
    minio_server: MinioServer,
    agent: NodeAgent,
    namespace: str,
) -> None:
    from kubernetes import client

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    core = client.CoreV1Api(kube_api)
    custom = client.CustomObjectsApi(kube_api)
    env = minio_server.env()
    # The credentials Secret the operator's trainer pods read (OperatorConfig.s3_credentials_secret).
    core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "posttrain-s3"},
            "stringData": {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")},
        },
    )
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint=env["POSTTRAIN_S3_ENDPOINT"],
        s3_bucket=f"e2e-{namespace}",
    )

    def create(plural: str, body: dict[str, Any]) -> None:
        body = {"apiVersion": f"{GROUP}/{VERSION}", **body}
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)

    def status(plural: str, name: str) -> dict[str, Any]:
        obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        return obj.get("status") or {}

    operator = OperatorThread(config).start()
    try:
        create(
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
        wait_for(lambda: status("rolloutpools", "pool").get("phase") == "Ready", 180, "pool Ready")
        pool_pod = core.read_namespaced_pod("pool-0", namespace)
        port = status("rolloutpools", "pool")["endpoint"].rsplit(":", 1)[1]
        # No cluster DNS here: the run samples from the pool's pod IP directly.
        endpoint = f"http://{pool_pod.status.pod_ip}:{port}"
        create(
            "trainingruns",
            {
                "kind": "TrainingRun",
                "metadata": {"name": "tiny"},
                "spec": {
                    "model": "smollm2-135m-instruct",
                    "algorithm": {
                        "groupSize": 2,
                        "promptsPerStep": 2,
                        "maxSteps": 2,
                        "maxNewTokens": 16,
                        "microBatchSize": 4,
                    },
                    "domains": [
                        {
                            "name": "arithmetic",
                            "dataset": "builtin:arithmetic",
                            "verifier": {"kind": "numeric"},
                        }
                    ],
                    "rollout": {"endpoints": [endpoint], "timeoutSeconds": 300},
                    "resources": {"cpu": "1", "memory": "4Gi", "gpusPerNode": 0},
                    "checkpoint": {"everySteps": 1, "keepLast": 1},
                    "evaluation": {"everySteps": 100, "maxItemsPerDomain": 2},
                    "backoffLimit": 0,
                },
            },
        )
        final = wait_for(
            lambda: (
                (s := status("trainingruns", "tiny")).get("phase") in ("Succeeded", "Failed") and s
            ),
            420,
            "TrainingRun finished",
        )
    finally:
        operator.stop()
    trainer_log = agent.log_path(namespace, "tiny-g0-0").read_text()
    assert final["phase"] == "Succeeded", trainer_log[-3000:]
    # Written by the trainer itself (ServiceAccount token), not by the operator.
    bucket = f"e2e-{namespace}"
    checkpoint = f"s3://{bucket}/runs/{namespace}/tiny/checkpoints/step-00000002"
    assert final["lastCheckpoint"] == checkpoint
    assert final["evalAccuracy"].keys() == {"arithmetic"}
    stored = {
        obj.object_name
        for obj in minio_server.client().list_objects(
            bucket, prefix=f"runs/{namespace}/tiny/checkpoints/step-00000002/", recursive=True
        )
    }
    assert any(name.endswith(".safetensors") for name in stored), sorted(stored)
