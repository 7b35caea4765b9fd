"""Weight publishing (shared memory vs registry) and overlapped rollouts, against a real
in-process rollout server on a tiny model over real HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.rollout.client import RolloutClient
from posttrain.rollout.protocol import SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import open_store
from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.data.rollouts import RolloutProducer, RolloutRequest
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import WeightPublisher


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)


@pytest.fixture()
def client(tiny_model: Path) -> Iterator[RolloutClient]:
    server = ServerThread(ServerConfig(model=str(tiny_model), num_threads=1)).start()
    client = RolloutClient([server.url], timeout_s=120, max_in_flight=4)
    try:
        yield client
    finally:
        client.close()
        server.stop()


def _perturb(policy: Policy, seed: int) -> None:
    """Stand-in for an optimizer step: every weight moves, deterministically."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def _served_matches(policy: Policy, client: RolloutClient) -> tuple[int, bool]:
    """(version the server sampled with, whether its logprobs equal the policy's)."""
    prompt = policy.encode_prompt("What is 1 + 2?")
    (completion,) = client.generate([prompt], SamplingParams(n=1, max_tokens=5, seed=7))[0]
    sample = TrainSample(prompt, completion.token_ids, completion.logprobs, 0.0, 0.0)
    with torch.no_grad():
        logp, behaviour, mask = policy.completion_logprobs(policy.model, [sample], 1.0)
    close = torch.allclose(logp * mask, behaviour * mask, atol=1e-4)
    return completion.weight_version, close


def test_shared_memory_publish_serves_the_new_version(
    tiny_model: Path, client: RolloutClient, tmp_path: Path
) -> None:
    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=2)
    publisher = WeightPublisher(registry, store.uri("weights"), client, tmp_path, shared=True)
    policy = Policy(tiny_model, learning_rate=1e-3)
    assert publisher.transport == "shared"
    assert _served_matches(policy, client) == (0, True)

    _perturb(policy, seed=1)
    assert _served_matches(policy, client)[1] is False  # the server still has v0
    publisher.publish(policy, 1)
    assert _served_matches(policy, client) == (1, True)
    assert registry.versions() == []  # not durable: nothing hashed or written to storage

    _perturb(policy, seed=2)
    publisher.publish(policy, 2, durable=True)  # a checkpoint step: the registry gets it too
    assert _served_matches(policy, client) == (2, True)
    assert registry.versions() == [2] and publisher.transport == "shared"
    shared_dir = publisher.shared_dir
    assert shared_dir is not None
    assert [p.name for p in shared_dir.iterdir()] == ["v00000002"]  # older files deleted

    # The next checkpoint step: every fp32 weight moved, so the registry gets a full version
    # (no delta), and the server still reads it from shared memory.
    _perturb(policy, seed=3)
    publisher.publish(policy, 3, durable=True)
    assert _served_matches(policy, client) == (3, True)
    assert registry.versions() == [2, 3] and publisher.last_kind == "full"
    assert [p.name for p in shared_dir.iterdir()] == ["v00000003"]
    publisher.close()
    assert not shared_dir.exists()


def test_registry_publish_in_serving_dtype_halves_the_bytes(
    tiny_model: Path, client: RolloutClient, tmp_path: Path
) -> None:
    """bf16 from fp32 master weights: half the bytes, and the server serves them."""
    from safetensors import safe_open

    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=3)
    policy = Policy(tiny_model, learning_rate=1e-3)
    full = WeightPublisher(registry, store.uri("weights"), client, tmp_path, shared=False)
    full.publish(policy, 1)
    half = WeightPublisher(
        registry, store.uri("weights"), client, tmp_path, shared=False, dtype=torch.bfloat16
    )
    _perturb(policy, seed=3)
    half.publish(policy, 2)
    assert full.last_bytes > 0 and half.last_bytes < 0.55 * full.last_bytes
    with safe_open(str(tmp_path / "run" / "weights" / "v00000002" / "model.safetensors"),
                   "pt") as handle:  # fmt: skip
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}  # noqa: SIM118
    manifests = {  # each version records the dtype it was written in
        v: json.loads((tmp_path / "run" / "weights" / f"v0000000{v}" / "manifest.json").read_text())
        for v in (1, 2)
    }
    assert [manifests[v]["metadata"]["dtype"] for v in (1, 2)] == ["float32", "bfloat16"]
    prompt = policy.encode_prompt("What is 1 + 2?")
    (completion,) = client.generate([prompt], SamplingParams(n=1, max_tokens=5, seed=7))[0]
    assert completion.weight_version == 2
    sample = TrainSample(prompt, completion.token_ids, completion.logprobs, 0.0, 0.0)
    with torch.no_grad():  # the server runs the bf16-rounded weights: close, not equal
        logp, behaviour, mask = policy.completion_logprobs(policy.model, [sample], 1.0)
    assert ((logp - behaviour).abs() * mask).max() < 0.1


def test_publisher_falls_back_to_the_registry_when_the_server_cannot_read_our_files(
    tiny_model: Path, client: RolloutClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loopback URL may be a port-forward to another machine that cannot see /dev/shm."""
    import posttrain.rollout.weights as weights

    real_fetch = weights.fetch_weights

    def remote_fetch(uri: str, version: int, scratch: Path | None = None) -> tuple[Path, bool]:
        if "posttrain-weights-" in uri:  # our shared-memory directory: not on "that" host
            raise FileNotFoundError(f"no *.safetensors in {uri}")
        return real_fetch(uri, version, scratch)

    monkeypatch.setattr(weights, "fetch_weights", remote_fetch)
    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=2)
    publisher = WeightPublisher(registry, store.uri("weights"), client, tmp_path, shared=True)
    policy = Policy(tiny_model, learning_rate=1e-3)
    _perturb(policy, seed=3)
    publisher.publish(policy, 1)
    assert publisher.transport == "registry"
    assert registry.versions() == [1]
    assert _served_matches(policy, client) == (1, True)


def test_publish_records_where_its_time_went_and_transfer_falls_back_to_files(
    tiny_model: Path, client: RolloutClient, tmp_path: Path
) -> None:
    """Every publish keeps seconds per phase; a server without direct transfer (the CPU
    engine answers 404) makes the publisher use the shared files from then on."""
    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=2)
    policy = Policy(tiny_model, learning_rate=1e-3)
    by_registry = WeightPublisher(registry, store.uri("weights"), client, tmp_path,
                                  shared=False, deltas=None)  # fmt: skip
    started = time.monotonic()
    by_registry.publish(policy, 1)
    elapsed = time.monotonic() - started
    assert set(by_registry.last_phases) == {"write", "delta", "commit", "keep_base", "load"}
    assert all(s >= 0 for s in by_registry.last_phases.values())
    assert sum(by_registry.last_phases.values()) <= elapsed
    assert client.last_load_replies and all(
        r["weight_version"] == 1 for r in client.last_load_replies.values()
    )

    direct = WeightPublisher(registry, store.uri("weights"), client, tmp_path, shared=True,
                             transfer_bucket_bytes=1 << 20)  # fmt: skip
    assert direct.transport == "transfer"
    _perturb(policy, seed=4)
    direct.publish(policy, 2)
    assert direct.transport == "shared"  # the CPU engine has no /v1/weights/transfer
    assert set(direct.last_phases) == {"transfer", "write", "load"}
    assert _served_matches(policy, client) == (2, True)
    _perturb(policy, seed=5)
    direct.publish(policy, 3)
    assert "transfer" not in direct.last_phases  # not tried again
    assert _served_matches(policy, client) == (3, True)
    direct.close()


def test_a_publish_counts_how_long_the_replicas_drained_the_running_batch(
    tiny_model: Path, client: RolloutClient, tmp_path: Path
) -> None:
    """The CPU server swaps weights only between batches, so a publish while a completion
    is being generated waits for it: the load's answer says so (``phases.drain``), and the
    publisher keeps the slowest replica's (what the loop adds to the step's rollout wait).
    The completion in flight finishes on the old version."""
    from posttrain.processes import wait_for
    from posttrain.rollout.engine import RUNNING_SEQUENCES

    policy = Policy(tiny_model, learning_rate=1e-3)
    publisher = WeightPublisher(None, "unused://", client, tmp_path, shared=True)
    publisher.publish(policy, 1)  # idle server: nothing to wait for
    assert set(client.last_load_replies[client.urls[0]]["phases"]) == {"fetch", "drain", "reload"}
    idle_drain = publisher.last_replica_drain_seconds
    prompt = policy.encode_prompt("Count to a thousand.")
    params = SamplingParams(n=1, max_tokens=1500, temperature=1.0, seed=3)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.generate, [prompt], params)
        wait_for(lambda: RUNNING_SEQUENCES._value.get() > 0, timeout_s=60,
                 what="the completion to start decoding", interval_s=0.01)  # fmt: skip
        _perturb(policy, seed=9)
        publisher.publish(policy, 2)
        (completion,) = running.result()[0]
    assert completion.weight_version == 1  # it ran to its end on the old weights
    assert len(completion.token_ids) == 1500 or completion.finish_reason == "stop"
    drained = client.last_load_replies[client.urls[0]]["phases"]["drain"]
    assert publisher.last_replica_drain_seconds == pytest.approx(drained)
    assert drained > idle_drain and drained > 0.01
    publisher.close()


def _two_rank_publisher(
    rank: int, port: int, model: str, url: str, root: str, results: dict[str, Any]
) -> None:
    """One Gloo rank of a sharded trainer publishing twice with the direct transfer asked
    for, to a server without it: every rank must fall back together (no rank left waiting
    in a gather the others skipped) and the second publish must not try again."""
    import os

    import torch.distributed as dist

    from posttrain.trainer.model.policy import RankInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    policy = Policy(Path(model), learning_rate=1e-3, rank=RankInfo(rank, 2, rank))
    assert policy.sharded
    scratch = Path(root) / f"rank{rank}"
    scratch.mkdir()
    with RolloutClient([url], timeout_s=120) as client:
        publisher = WeightPublisher(None, "unused://", client, scratch, shared=True,
                                    deltas=None, transfer_bucket_bytes=1 << 20)  # fmt: skip
        seen = []
        for version in (1, 2):
            publisher.publish(policy, version)
            seen.append((publisher.transport, sorted(publisher.last_phases)))
        results[f"rank{rank}"] = seen
        publisher.close()
    dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks loading torch + a tiny model: ~1 min on 2 loaded cores
def test_two_ranks_asking_for_a_direct_transfer_fall_back_to_files_together(
    tiny_model: Path, client: RolloutClient, tmp_path: Path
) -> None:
    """A sharded trainer (two Gloo ranks): rank 0's transfer is refused by the server (the
    CPU engine has no /v1/weights/transfer), it walks the remaining gathers, the ranks agree
    and all publish through the shared file, which the server then serves."""
    import torch.multiprocessing as mp

    from posttrain.processes import free_port

    results = mp.Manager().dict()
    (url,) = client.urls
    mp.spawn(_two_rank_publisher,
             args=(free_port(), str(tiny_model), url, str(tmp_path), results),
             nprocs=2, join=True)  # fmt: skip
    assert results["rank0"] == [
        ("shared", ["load", "transfer", "write"]),  # refused, then the file
        ("shared", ["load", "write"]),  # not tried again
    ]
    assert [transport for transport, _ in results["rank1"]] == ["shared", "shared"]
    single = Policy(tiny_model, learning_rate=1e-3)  # the ranks published it unchanged
    assert _served_matches(single, client) == (2, True)


class _RecordingClient:
    """The real client, plus when each batch's sampling started and finished."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def generate(self, prompts: list[list[int]], params: Any) -> Any:
        batch = params.seed  # the test uses the batch index as the seed
        with self.lock:
            self.events.append(("start", batch))
        result = self.client.generate(prompts, params)
        with self.lock:
            self.events.append(("end", batch))
        return result


def test_lag_one_samples_the_next_batch_during_the_update_and_never_further(
    tiny_model: Path, client: RolloutClient
) -> None:
    """k=1: batch n+1 is sampled while step n trains; batch n+2 waits for step n's weights."""
    policy = Policy(tiny_model, learning_rate=1e-3)
    recording = _RecordingClient(client)
    producer = RolloutProducer(recording, SamplingParams(n=2, max_tokens=4), max_policy_lag=1)
    prompt = [policy.encode_prompt("What is 2 + 3?")]
    try:
        for batch_index in (1, 2, 3):
            producer.submit(RolloutRequest(batch_index, [], prompt, seed=batch_index))
        first = producer.take(1, timeout=60)  # "step 1" begins: batch 2 may be sampled now
        second = producer.take(2, timeout=60)
        assert ("end", 2) in recording.events  # sampled before step 1 finished: overlap
        time.sleep(0.5)
        assert ("start", 3) not in recording.events  # would be 2 versions stale at step 3
        producer.step_finished(1)
        third = producer.take(3, timeout=60)
    finally:
        producer.close()
    assert [b.error for b in (first, second, third)] == [None, None, None]
    assert recording.events.index(("start", 3)) > recording.events.index(("end", 2))


def test_a_replica_configured_as_a_colocated_sidecar_takes_shared_publishes_and_rejoins(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.colocated end to end on the real parts, short of a kubelet: a server started
    from the environment the operator gives a sidecar (the run's registry as its weight
    source, the pool's weight token) and a trainer given the loopback URL the operator gives
    it publish every version through /dev/shm (the token and the registry check let the
    shared file through); a server restarted with the same environment joins at the newest
    version committed to the registry (a checkpoint step), not at the base model.
    tests/real_cluster/test_chart.py runs the same in pods on the real kubelet."""
    from posttrain.api import RolloutPool, TrainingRun
    from posttrain.api.env import WEIGHTS_TOKEN, RolloutPoolEnv, TrainerEnv
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.trainingrun.builders import build_trainer_pod
    from posttrain.trainer.model.weight_sync import all_on_this_host

    token = "colocated-token"
    run = TrainingRun.model_validate({
        "metadata": {"name": "r", "namespace": "ns", "uid": "u"},
        "spec": {"model": "m", "rollout": {"pool": "p", "colocated": {"replicas": 1}},
                 "checkpoint": {"storageUri": f"file://{tmp_path / 'run'}"},
                 "domains": [{"name": "d", "dataset": "builtin:arithmetic",
                              "verifier": {"kind": "numeric"}}]},
    })  # fmt: skip
    pool = RolloutPool.model_validate({"metadata": {"name": "p", "namespace": "ns", "uid": "p"},
                                       "spec": {"model": "m", "engine": "cpu"}})  # fmt: skip
    pod = build_trainer_pod(run, OperatorConfig(), 0, 0, colocated_pool=pool)["spec"]
    (sidecar,) = pod["initContainers"]

    def plain(container: dict[str, Any]) -> dict[str, str]:
        return {e["name"]: e["value"] for e in container["env"] if "value" in e}

    replica_env = RolloutPoolEnv.from_env(plain(sidecar))  # what `posttrain serve` reads
    trainer_env = TrainerEnv.from_env(plain(pod["containers"][0]))
    assert replica_env.weights_uri == f"file://{tmp_path / 'run'}/weights"

    def start() -> ServerThread:
        return ServerThread(ServerConfig(
            model=str(tiny_model), num_threads=1, weights_uri=replica_env.weights_uri,
            poll_seconds=replica_env.weights_poll_seconds or 0.0, weights_token=token,
        )).start()  # fmt: skip

    server = start()
    # The operator's loopback URL, on the port this test's server got.
    (url,) = trainer_env.rollout_endpoints
    local = url.rsplit(":", 1)[0] + ":" + server.url.rsplit(":", 1)[1]
    assert all_on_this_host([local])
    monkeypatch.setenv(WEIGHTS_TOKEN, token)  # the trainer's copy of the pool's token
    client = RolloutClient([local], timeout_s=120)
    store = open_store(run.spec.checkpoint.storage_uri or "")
    registry = WeightRegistry(store, "weights", keep_last=2)
    publisher = WeightPublisher(
        registry, store.uri("weights"), client, tmp_path, shared=all_on_this_host([local])
    )
    policy = Policy(tiny_model, learning_rate=1e-3)
    try:
        _perturb(policy, seed=1)
        publisher.publish(policy, 1, durable=True)  # a checkpoint step
        _perturb(policy, seed=2)
        publisher.publish(policy, 2)
        assert publisher.transport == "shared" and registry.versions() == [1]
        assert _served_matches(policy, client) == (2, True)
        server.stop()
        server = start()  # the kubelet restarts a sidecar that exited: pull on join
        rejoined = RolloutClient([server.url], timeout_s=60)
        assert rejoined.weight_versions() == {server.url: 1}  # the committed one, not v0
        rejoined.close()
    finally:
        publisher.close()
        client.close()
        server.stop()
