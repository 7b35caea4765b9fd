"""A TrainingRun that samples from a two-replica real-vLLM RolloutPool on the dev cluster.

Everything is real: kube-apiserver + etcd, MinIO, the operator (in-process), and pods run
by the node agent -- the pool's pods with the rollout environment (``.venv-vllm``, vLLM's
CPU build) as a cluster runs them from the rollout image: the ``fetch-model`` init step,
then ``posttrain rollout vllm-entry`` (the front door) with vLLM behind it on a pod-internal
port. The trainer discovers both replicas from the pool's status, publishes every weight
version to both through the MinIO weight registry, and samples from them.

Mid-run one replica is killed (its process group, like a crashed pod). The agent's
Deployment stand-in replaces it; the replacement pulls the latest committed version before
it reports ready (pull on join), and the run still trains every step at the version it
published. The test checks the reward recorded per step, the version stamped on every
sample, that the surviving replica served every version, and that at the end both report
the final version in the pool's status. The trainer publishes in the pool's serving dtype
(the operator hands ``engineArgs.dtype`` to the trainer pod; the manifests record it).

Sized for 2 shared cores: 3 steps of 2 prompts x 2 samples of 8 tokens, 256 MiB of KV
cache per replica. Every wait is on a condition with a generous deadline and progress
lines (vLLM boots in about a minute on an idle core, 5+ under load).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import ROLLOUT_IMAGE_NAME, NodeAgent
from posttrain.devenv.process import free_port
from posttrain.rollout.vllm_local import REPO_VLLM_VENV, vllm_python
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import S3Store
from posttrain.storage.trajectories import read_trajectories

from .conftest import wait_logged
from .test_trainingrun_e2e import Cluster

log = logging.getLogger(__name__)

_REQUIRED = os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1"  # set by `make test`
if vllm_python() is None and _REQUIRED:
    raise RuntimeError(f"POSTTRAIN_REQUIRE_VLLM=1 but {REPO_VLLM_VENV} is missing: make venv-vllm")

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.minio,
    pytest.mark.slow,
    pytest.mark.skipif(
        vllm_python() is None,
        reason=f"no vLLM environment ({REPO_VLLM_VENV}): run `make venv-vllm` (make test does)",
    ),
    pytest.mark.timeout(3 * 3600),  # the waits below have their own deadlines
]

RUN, POOL = "vrun", "vpool"
DTYPE = "float32"  # SmolLM2's converted weights; CPU bf16 needs AVX512-BF16, not on every CI
STEPS, PROMPTS, GROUP_SIZE = 3, 2, 2
BOOT_S = 2400.0  # one vLLM replica's start-up on a loaded 2-core machine, with margin


def pool_body(weights_uri: str) -> dict[str, Any]:
    return {
        "kind": "RolloutPool",
        "metadata": {"name": POOL},
        "spec": {
            # The packaged id: each pod's fetch step converts the GGUF onto its own volume, as
            # in a cluster. Not this host's converted copy: the agent runs pool pods as their
            # runAsUser (10001), which cannot read root's ~/.cache.
            "model": "smollm2-135m-instruct",
            "replicas": 2,
            "engine": "vllm",
            "port": free_port(),
            "engineArgs": {
                "dtype": DTYPE,
                "maxModelLen": 512,
                "extraArgs": [
                    "--enforce-eager",
                    "--kv-cache-memory-bytes",
                    str(256 << 20),
                    "--max-num-seqs",
                    "8",
                ],
            },
            "resources": {"gpus": 0, "cpu": "1", "memory": "3Gi"},
            # Pull on join (and catch-up polls) read the run's weight registry.
            "weightUpdate": {"sourceUri": weights_uri, "pollSeconds": 20},
        },
    }


def run_body(storage_uri: str) -> dict[str, Any]:
    return {
        "kind": "TrainingRun",
        "metadata": {"name": RUN},
        "spec": {
            "model": "smollm2-135m-instruct",
            "algorithm": {
                "groupSize": GROUP_SIZE,
                "promptsPerStep": PROMPTS,
                "maxSteps": STEPS,
                "maxNewTokens": 8,
                "microBatchSize": 4,
                "dynamicSampling": False,  # every sample kept: counts are exact
                "maxPolicyLag": 0,  # every batch sampled at the version just published
            },
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "numeric"},
                }
            ],
            "rollout": {"pool": POOL, "timeoutSeconds": 900},
            "resources": {"cpu": "1", "memory": "4Gi", "gpusPerNode": 0},
            # Storage named up front (not <name>/<uid>, known only once the run exists): the
            # pool, created first, pulls weights from it.
            "checkpoint": {"everySteps": 100, "keepLast": 1, "storageUri": storage_uri},
            "evaluation": {"everySteps": 100, "maxItemsPerDomain": 2},
            "backoffLimit": 0,  # a trainer crash (e.g. a failed publish) fails the test
        },
    }


@pytest.fixture
def vllm_cluster(
    crds_installed: None,
    kube_api: Any,
    kubeconfig: Path,
    minio_server: MinioServer,
    agent: NodeAgent,
    namespace: str,
) -> Iterator[Cluster]:
    """The namespace wired like a real install (S3 Secret, bucket, operator) with the
    two-replica vLLM pool Ready; the operator keeps running for the whole test."""
    from kubernetes import client

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    assert ROLLOUT_IMAGE_NAME in agent.image_bin_dirs, agent.image_bin_dirs
    core = client.CoreV1Api(kube_api)
    env = minio_server.env()
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
    minio_server.client().make_bucket(config.s3_bucket)  # a platform team creates it first
    c = Cluster(namespace, client.CustomObjectsApi(kube_api), core, config, config.s3_bucket)
    weights_uri = f"s3://{c.bucket}/runs/{namespace}/{RUN}/weights"
    operator = OperatorThread(config).start()
    try:
        c.create("rolloutpools", pool_body(weights_uri))
        wait_logged(
            lambda: (s := c.status("rolloutpools", POOL)).get("readyReplicas") == 2 and s,
            BOOT_S,
            "both vLLM replicas ready",
        )
        yield c
    finally:
        operator.stop(timeout_s=300)  # a loaded apiserver answers the shutdown's requests slowly


def run_store(minio_server: MinioServer, c: Cluster) -> S3Store:
    return S3Store(
        minio_server.endpoint,
        c.bucket,
        f"runs/{c.namespace}/{RUN}",
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
    )


def safetensors_dtypes(store: S3Store, key: str) -> set[str]:
    """The tensor dtypes a published safetensors file declares, read from its header (the
    first bytes: an 8-byte little-endian length, then that much JSON) without the tensors."""
    head = b""
    chunks = store.iter_chunks(key, chunk_size=1 << 16)
    try:
        for chunk in chunks:
            head += chunk
            if len(head) >= 8 and len(head) >= 8 + int.from_bytes(head[:8], "little"):
                break
    finally:
        chunks.close()  # type: ignore[attr-defined]
    header = json.loads(head[8 : 8 + int.from_bytes(head[:8], "little")])
    return {t["dtype"] for name, t in header.items() if name != "__metadata__"}


def served_versions(log_text: str) -> list[int]:
    """Versions a front door loaded, in order (its "now serving weights vN" lines)."""
    return [int(v) for v in re.findall(r"vLLM now serving weights v(\d+) from", log_text)]


def test_training_run_on_a_two_replica_vllm_pool_survives_a_replica_kill(  # noqa: PLR0915
    vllm_cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    c = vllm_cluster
    status = c.status("rolloutpools", POOL)
    assert status["weightVersion"] == 0 and len(status["replicaEndpoints"]) == 2, status
    pods = {p.metadata.name: p for p in c.core.list_namespaced_pod(c.namespace).items}
    victim_name = sorted(n for n in pods if n.startswith(f"{POOL}-"))[-1]
    survivor_name = sorted(n for n in pods if n.startswith(f"{POOL}-"))[0]
    # The pods run the front door from the rollout environment, after the init step.
    survivor_log = agent.log_path(c.namespace, survivor_name).read_text()
    assert "==> container fetch-model" in survivor_log, survivor_log[:3000]
    assert "(linked at /models/current)" in survivor_log, survivor_log[:3000]
    assert "vLLM replica ready at weight version 0" in survivor_log, survivor_log[-3000:]

    store = run_store(minio_server, c)
    registry = WeightRegistry(store, "weights")
    c.create("trainingruns", run_body(f"s3://{c.bucket}/runs/{c.namespace}/{RUN}"))
    # The operator tells the trainer the pool's serving dtype, to publish in.
    trainer = wait_logged(
        lambda: next(
            (p for p in c.core.list_namespaced_pod(c.namespace).items
             if p.metadata.name.startswith(f"{RUN}-g")),
            None,
        ),
        BOOT_S,
        "the trainer pod",
    )  # fmt: skip
    trainer_env = {e.name: e.value for e in trainer.spec.containers[0].env}
    assert trainer_env["POSTTRAIN_ROLLOUT_DTYPE"] == DTYPE, trainer_env

    # Kill one replica as soon as v1 is committed to the registry: the trainer is then
    # loading it onto the replicas (or has), so the kill can land in the middle of a load.
    def published() -> int:
        phase = c.status("trainingruns", RUN).get("phase")
        assert phase != "Failed", c.status("trainingruns", RUN)
        return registry.latest_version() or 0

    wait_logged(lambda: published() >= 1, BOOT_S, "the trainer's first weight publish")
    victim = agent.runner(c.namespace, victim_name)
    assert victim is not None and victim.pid is not None
    victim_log = agent.log_path(c.namespace, victim_name)
    offset = victim_log.stat().st_size  # the replacement appends its own lines after this
    os.killpg(victim.pid, signal.SIGKILL)
    at_kill = registry.latest_version() or 0
    log.info("killed replica %s at weight version %d", victim_name, at_kill)

    final = wait_logged(
        lambda: (s := c.status("trainingruns", RUN)).get("phase") in ("Succeeded", "Failed") and s,
        2 * BOOT_S,
        f"TrainingRun {RUN} finished",
    )
    trainer_log = agent.log_path(c.namespace, f"{RUN}-g0-0").read_text()
    assert final["phase"] == "Succeeded", trainer_log[-4000:]
    assert final["step"] == STEPS

    # Both replicas (the survivor and the replacement) serve the final version, as the
    # pool's status reports from each front door.
    # (A replica that does not answer the operator's probe in time shows no version until
    # a later resync asks again: wait for both answers.)
    pool = wait_logged(
        lambda: (
            (s := c.status("rolloutpools", POOL)).get("readyReplicas") == 2
            and [r.get("weightVersion") for r in s.get("replicaWeights") or []] == [STEPS] * 2
            and s
        ),
        BOOT_S,
        f"both replicas of the pool serving v{STEPS}",
    )
    assert pool["weightVersion"] == STEPS, pool
    assert sorted(r["endpoint"] for r in pool["replicaWeights"]) == pool["replicaEndpoints"]

    # The last version went out in the pool's serving dtype, as its manifest records.
    prefix = f"weights/v{STEPS:08d}"
    manifest = json.loads(store.get_bytes(f"{prefix}/manifest.json"))
    assert manifest["metadata"]["dtype"] == DTYPE, manifest
    tensors = [f["path"] for f in manifest["files"] if f["path"].endswith(".safetensors")]
    assert tensors, manifest
    safetensors_name = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[DTYPE]
    for name in tensors:
        assert safetensors_dtypes(store, f"{prefix}/{name}") == {safetensors_name}, name

    # The reward of every step, each step trained at the version it published.
    metrics = [
        json.loads(line)
        for line in store.get_bytes("reports/metrics.jsonl").decode().splitlines()
        if line.strip()
    ]
    rl = [m for m in metrics if "reward_mean" in m]
    assert [m["step"] for m in rl] == list(range(1, STEPS + 1)), metrics
    for m in rl:
        assert isinstance(m["reward_mean"], float) and math.isfinite(m["reward_mean"]), m
        assert m["applied"] and m["weight_version"] == m["step"] and m["staleness"] == 0, m

    # Every sample is stamped with the version the trainer had published before its step.
    records = list(read_trajectories(store, "trajectories"))
    per_step: dict[int, set[int]] = {}
    for record in records:
        per_step.setdefault(record["step"], set()).add(record["weight_version"])
    assert per_step == {s: {s - 1} for s in range(1, STEPS + 1)}, per_step
    assert len(records) == STEPS * PROMPTS * GROUP_SIZE

    # The survivor loaded every version the trainer published, in order.
    survivor_versions = served_versions(
        agent.log_path(c.namespace, survivor_name).read_text(errors="replace")
    )
    assert sorted(set(survivor_versions)) == list(range(1, STEPS + 1)), survivor_versions

    # The replacement loaded the latest committed version *before* reporting ready (pull on
    # join): its first ready line names a published version no older than the one at the
    # kill, and it loaded that version before. It then served every later one.
    with victim_log.open("rb") as handle:
        handle.seek(offset)
        rejoined = handle.read().decode(errors="replace")
    ready = re.search(r"vLLM replica ready at weight version (\d+)", rejoined)
    assert ready is not None, rejoined[-4000:]
    joined_at = int(ready.group(1))
    assert joined_at >= max(at_kill, 1), (joined_at, at_kill)
    before_ready = served_versions(rejoined[: ready.start()])
    assert before_ready and before_ready[-1] == joined_at, rejoined[: ready.start()][-3000:]
    after = set(served_versions(rejoined[ready.end() :]))
    assert set(range(joined_at + 1, STEPS + 1)) <= after, (joined_at, after)
