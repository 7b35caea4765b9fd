"""The dev-cluster examples, offline: they validate as the apiserver would, and the operator's
own builders turn them into what the laptop dev cluster can run (issue #35, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.api import RolloutPool, TrainingRun, load_manifests
from posttrain.api import env as env_names
from posttrain.devenv.nodeagent import ROLLOUT_IMAGE_NAME
from posttrain.devenv.podprocess import image_repository
from posttrain.operator.config import OperatorConfig
from posttrain.operator.rolloutpool import builders as b
from posttrain.operator.trainingrun import builders as run_builders

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SUFFIXES = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def parse_quantity(value: str) -> float:
    """The quantities the examples use: plain, m, Ki, Mi, Gi.

    >>> parse_quantity("500m"), parse_quantity("3Gi")
    (0.5, 3221225472.0)
    """
    for suffix, factor in SUFFIXES.items():
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * factor
    return float(value)


def test_dev_vllm_example_is_a_cpu_vllm_pool_on_the_rollout_image_and_a_run_on_it() -> None:
    resources = load_manifests(EXAMPLES / "dev-vllm-run.yaml")
    (pool,) = [r for r in resources if isinstance(r, RolloutPool)]
    (run,) = [r for r in resources if isinstance(r, TrainingRun)]
    assert run.spec.rollout.pool == pool.metadata.name
    pool.metadata.uid = run.metadata.uid = "uid"

    config = OperatorConfig()
    deployment = b.build_rollout_deployment(pool, config)
    pod = deployment["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    # The rollout image, which the dev node agent runs from .venv-vllm.
    assert server["image"] == config.vllm_image
    assert image_repository(server["image"]) == ROLLOUT_IMAGE_NAME
    assert all(image_repository(c["image"]) == ROLLOUT_IMAGE_NAME for c in pod["initContainers"])
    # No GPU asked for, and small enough to sit beside the trainer on a laptop.
    limits = server["resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    cpu = parse_quantity(limits["cpu"]) + parse_quantity(run.spec.resources.cpu)
    memory = parse_quantity(limits["memory"]) + parse_quantity(run.spec.resources.memory)
    assert cpu <= 2 and memory <= 8 * 2**30, (cpu, memory)
    # vLLM on CPU: float32 (bfloat16 needs AVX512-BF16), eager, a small KV cache.
    engine_args = json.loads(server["command"][server["command"].index("--engine-args") + 1])
    assert engine_args["dtype"] == "float32"
    assert "--enforce-eager" in engine_args["extra_args"]
    kv = engine_args["extra_args"][engine_args["extra_args"].index("--kv-cache-memory-bytes") + 1]
    assert int(kv) <= 512 << 20
    # Room for vLLM's four processes and weights (3.3 GiB measured in a real pod) besides the
    # KV cache: in 3Gi the replica refused to start (docs/real-node.md).
    assert parse_quantity(limits["memory"]) >= 3.3 * 2**30 + int(kv), limits
    # The trainer publishes in the pool's dtype, so replicas read float32 weights.
    trainer = run_builders.build_trainer_pod(
        run,
        config,
        0,
        0,
        rollout_endpoints=[b.pool_endpoint(pool)],
        rollout_dtype=b.pool_serving_dtype(pool),
    )
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    assert env[env_names.ROLLOUT_DTYPE] == "float32"
