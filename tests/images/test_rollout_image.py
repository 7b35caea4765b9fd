"""The rollout image: the vLLM pool pod the operator builds (fetch-model init step, then the
front door with vLLM's CPU build behind it) serves completions with logprobs and takes the
trainer's published weights through the front door, from the real MinIO weight registry."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from posttrain.api.envnames import WEIGHTS_TOKEN
from posttrain.api.manifests import parse_resource
from posttrain.devenv.minio import MinioServer
from posttrain.devenv.process import free_port
from posttrain.operator.config import OperatorConfig
from posttrain.operator.rolloutpool import builders
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.protocol import SamplingParams
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import S3Store
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import WeightPublisher

from .podman import PodContainer, image_ref, run_to_completion, start

IMAGES = ("rollout",)  # what images_built checks

pytestmark = [
    pytest.mark.images,
    pytest.mark.minio,
    pytest.mark.slow,
    pytest.mark.usefixtures("images_built"),
    pytest.mark.timeout(3600),
]

BOOT_S = 1800.0  # vLLM's CPU start-up: about a minute idle, several under load
GREEDY = SamplingParams(n=1, max_tokens=8, temperature=0.0)


def _pool(port: int, weights_uri: str) -> Any:
    return parse_resource({
        "apiVersion": "posttrain.io/v1alpha1", "kind": "RolloutPool",
        "metadata": {"name": "smoke-vllm", "namespace": "default", "uid": "u-vllm"},
        "spec": {
            "model": "smollm2-135m-instruct", "engine": "vllm", "replicas": 1, "port": port,
            "engineArgs": {"dtype": "float32", "maxModelLen": 512,
                           "extraArgs": ["--enforce-eager", "--kv-cache-memory-bytes",
                                         str(256 << 20), "--max-num-seqs", "4"]},
            "resources": {"gpus": 0, "cpu": "1", "memory": "3Gi"},
            "weightUpdate": {"sourceUri": weights_uri, "pollSeconds": 600},
        },
    })  # fmt: skip


def _wait_healthy(url: str, running: Any) -> dict[str, Any]:
    deadline = time.monotonic() + BOOT_S
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return response.json()  # type: ignore[no-any-return]
        except httpx.HTTPError:
            pass
        assert running.exit_code() is None, f"server exited:\n{running.logs()[-6000:]}"
        time.sleep(2)
    pytest.fail(f"vLLM pod not healthy after {BOOT_S} s:\n{running.logs()[-6000:]}")


def test_vllm_pool_pod_serves_and_takes_published_weights(
    workdir: Path, minio_server: MinioServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = f"smoke-{uuid.uuid4().hex[:8]}"
    store = S3Store(minio_server.endpoint, bucket, access_key=minio_server.access_key,
                    secret_key=minio_server.secret_key)  # fmt: skip
    registry = WeightRegistry(store, "weights", keep_last=2)
    config = OperatorConfig(s3_endpoint=minio_server.endpoint, s3_bucket=bucket)
    port = free_port()
    deployment = builders.build_rollout_deployment(_pool(port, store.uri("weights")), config)
    pod_spec = deployment["spec"]["template"]["spec"]
    secrets = {
        (config.s3_credentials_secret, "AWS_ACCESS_KEY_ID"): minio_server.access_key,
        (config.s3_credentials_secret, "AWS_SECRET_ACCESS_KEY"): minio_server.secret_key,
        # The pool's weight token (the operator's Secret); the publisher below holds it too.
        (builders.pool_token_secret_name("smoke-vllm"), "token"): "smoke-token",
    }
    monkeypatch.setenv(WEIGHTS_TOKEN, "smoke-token")
    volume_dirs: dict[str, Path] = {}  # the pod's emptyDirs, shared by its two containers
    fetch = PodContainer(pod_spec, "fetch-model", field_refs={"status.podIP": "127.0.0.1"},
                         secrets=secrets, volume_dirs=volume_dirs)  # fmt: skip
    fetched = run_to_completion(fetch, image_ref("rollout"), workdir, timeout=900)
    assert fetched.returncode == 0, fetched.stdout[-3000:] + fetched.stderr[-3000:]
    server = PodContainer(pod_spec, "server", field_refs={"status.podIP": "127.0.0.1"},
                          secrets=secrets, volume_dirs=volume_dirs)  # fmt: skip
    running = start(server, image_ref("rollout"), workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(url, running)["weight_version"] == 0
        client = RolloutClient([url], timeout_s=600)
        # The pod's model, read on the host: /models/current links inside the container.
        link = Path(os.readlink(volume_dirs["models"] / "current"))
        model_dir = volume_dirs["models"] / link.relative_to(builders.MODEL_MOUNT)
        policy = Policy(model_dir, learning_rate=1e-5)
        prompt = [policy.encode_prompt("What is 7 * 6?")]
        before = client.generate(prompt, GREEDY)
        sample = before[0][0]
        assert sample.token_ids and len(sample.logprobs) == len(sample.token_ids), sample
        assert sample.weight_version == 0
        # A different policy (noise on the final norm changes greedy output), published by
        # the trainer's own path: the S3 registry, then /v1/weights/load on the front door.
        norm = policy.model.model.norm.weight
        with torch.no_grad():
            norm.mul_(1 + 0.5 * torch.randn(norm.shape, generator=torch.Generator().manual_seed(0)))
        scratch = workdir / "scratch"
        scratch.mkdir()
        WeightPublisher(registry, store.uri("weights"), client, scratch, shared=False).publish(
            policy, 1
        )
        assert httpx.get(f"{url}/v1/weights/version", timeout=30).json()["weight_version"] == 1
        after = client.generate(prompt, GREEDY)
        assert after[0][0].token_ids != before[0][0].token_ids
    finally:
        running.stop()
