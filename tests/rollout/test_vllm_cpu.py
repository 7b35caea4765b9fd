"""Real vLLM (its CPU build, ``.venv-vllm``) behind posttrain's front door, on SmolLM2-135M.

Two replicas start once per session (vLLM's start-up costs CPU-minutes); every test drives
them the way the trainer does: weights go through the trainer's ``WeightPublisher`` into a
``WeightRegistry`` and ``/v1/weights/load`` reaches every replica through ``RolloutClient``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client import REGISTRY

from posttrain.devenv.minio import MinioServer
from posttrain.processes import wait_for
from posttrain.rollout.client import RolloutClient, RolloutError
from posttrain.rollout.deltas import SafetensorsDir, diff_state_dicts, write_delta
from posttrain.rollout.discovery import follow_pool
from posttrain.rollout.protocol import SamplingParams
from posttrain.rollout.vllm_local import REPO_VLLM_VENV, LocalVllmReplica, vllm_python
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import LocalStore
from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import WeightPublisher

log = logging.getLogger(__name__)

_PYTHON = vllm_python()
_REQUIRED = os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1"  # set by `make test`
if _PYTHON is None and _REQUIRED:
    raise RuntimeError(f"POSTTRAIN_REQUIRE_VLLM=1 but {REPO_VLLM_VENV} is missing: make venv-vllm")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        _PYTHON is None,
        reason=f"no vLLM environment ({REPO_VLLM_VENV}): run `make venv-vllm` (make test does)",
    ),
    # vLLM boots in ~1 min on an idle core and 5+ under load; the session fixture's set-up
    # counts against the first test.
    pytest.mark.timeout(3600),
]

# Agreement of vLLM's processed logprobs with the trainer's recomputation, per sampled token,
# both fp32 on CPU but different kernels (vLLM's CPU attention vs. transformers' SDPA).
# Measured 2026-12-03: max 6.1e-05, mean 6.0e-06 over 192 tokens (~8x margin below).
LOGPROB_MAX_ABS = 5e-4
LOGPROB_MEAN_ABS = 5e-5
TEMPERATURE = 0.8
GREEDY = SamplingParams(n=1, max_tokens=12, temperature=0.0)
# Tokens per request of the scale-down rollout: long enough that the leaving replica is
# mid-generation when SIGTERM arrives (seconds per request on vLLM's CPU build here).
SCALE_DOWN_TOKENS = 128
# How long a replica the pool lists may take to be in the trainer's endpoints: the
# follower's interval (0.5 s here, 5 s in a run) plus one weight load (3.5-6 s for a
# reload on a loaded 2-core machine, docs/rollout.md); a wide margin for a shared machine.
JOIN_BOUND_S = 120.0
# The pool's replicas abandon a direct transfer after this long without a step (production:
# 120 s). A live trainer's steps come one bucket-pack apart (well under a second, a few under
# load), so no other test's transfer comes near it.
TRANSFER_IDLE_S = 30.0


class Pool:
    """Two vLLM replicas reading one weight registry, plus the trainer-side objects."""

    def __init__(self, root: Path, model_dir: Path) -> None:
        self.root = root
        self.model_dir = model_dir
        self.store = LocalStore(root / "store")
        self.registry = WeightRegistry(self.store, "weights", keep_last=3)
        self.registry_uri = self.store.uri("weights")
        self.replicas = [
            LocalVllmReplica(
                model_dir,
                root / f"replica-{i}.log",
                weights_uri=self.registry_uri,
                transfer_idle_s=TRANSFER_IDLE_S,
            )
            for i in range(2)
        ]
        self.policy = Policy(model_dir, learning_rate=1e-5)
        self.version = 0
        self.lock = threading.Lock()

    def client(self, *replicas: LocalVllmReplica) -> RolloutClient:
        return RolloutClient([r.url for r in replicas or self.replicas], timeout_s=600)

    def prompts(self) -> list[list[int]]:
        return [self.policy.encode_prompt(p) for p in ("What is 7 * 6?", "Name a prime.")]

    def perturb(self, seed: int, scale: float = 0.5) -> None:
        """A different policy: 50% noise on the final norm (changes the greedy output; 5% did
        not change 12 greedy tokens of SmolLM2)."""
        generator = torch.Generator().manual_seed(seed)
        norm = self.policy.model.model.norm.weight
        with torch.no_grad():
            norm.mul_(1 + scale * torch.randn(norm.shape, generator=generator))  # (H,)

    def publish(self, client: RolloutClient) -> int:
        """The trainer's publish path (registry transport) to ``client``'s replicas."""
        self.version += 1
        publisher = WeightPublisher(self.registry, self.registry_uri, client,
                                    self.root / "scratch", shared=False)  # fmt: skip
        (self.root / "scratch").mkdir(exist_ok=True)
        publisher.publish(self.policy, self.version)
        return self.version


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from posttrain.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def vllm_pool(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[Pool]:
    pool = Pool(tmp_path_factory.mktemp("vllm-pool"), smollm2_dir)
    try:
        for replica in pool.replicas:
            replica.start()
        for replica in pool.replicas:
            assert replica.wait_ready(timeout_s=2400)["weight_version"] == 0
        yield pool
    finally:
        for replica in pool.replicas:
            replica.stop()


def greedy(client: RolloutClient, prompts: list[list[int]]) -> list[list[int]]:
    return [group[0].token_ids for group in client.generate(prompts, GREEDY)]


def served_versions(pool: Pool) -> list[int]:
    return [int(httpx.get(f"{r.url}/v1/weights/version", timeout=30).json()["weight_version"])
            for r in pool.replicas]  # fmt: skip


def test_publish_reaches_both_replicas_and_changes_outputs(vllm_pool: Pool) -> None:
    pool = vllm_pool
    with (
        pool.client() as both,
        pool.client(pool.replicas[0]) as first,
        pool.client(pool.replicas[1]) as second,
    ):
        prompts = pool.prompts()
        before = greedy(first, prompts)
        for seed in (1, 2):
            pool.perturb(seed)
            version = pool.publish(both)
            assert served_versions(pool) == [version, version]
            after_first, after_second = greedy(first, prompts), greedy(second, prompts)
            # The same weights on both replicas: identical greedy output, stamped version.
            assert after_first == after_second
            assert after_first != before, "new weights did not change the greedy output"
            stamped = first.generate(prompts, GREEDY)
            assert {c.weight_version for g in stamped for c in g} == {version}
            before = after_first


def test_logprobs_match_trainer_recomputation(vllm_pool: Pool) -> None:
    """vLLM's processed logprobs at T=0.8 are the trainer's log_softmax(logits / 0.8)."""
    pool = vllm_pool
    with pool.client(pool.replicas[0]) as client:
        version = pool.publish(client)  # the replica now serves the policy's exact weights
        prompts = pool.prompts()
        params = SamplingParams(n=4, max_tokens=24, temperature=TEMPERATURE, top_p=1.0, seed=7)
        groups = client.generate(prompts, params)
    samples = [
        TrainSample(prompt, c.token_ids, c.logprobs, advantage=0.0, coefficient=1.0)
        for prompt, group in zip(prompts, groups, strict=True)
        for c in group
    ]
    assert all(c.weight_version == version for g in groups for c in g)
    with torch.no_grad():
        logp, behaviour, mask = pool.policy.completion_logprobs(
            pool.policy.model, samples, TEMPERATURE
        )  # (B, L) each
        plain, _, _ = pool.policy.completion_logprobs(pool.policy.model, samples, 1.0)
    diff = ((logp - behaviour).abs() * mask)[mask.bool()]  # (N,)
    log.info("logprob |vLLM - trainer| over %d tokens: max %.2e, mean %.2e",
             diff.numel(), diff.max(), diff.mean())  # fmt: skip
    assert diff.numel() > 50
    assert diff.max() < LOGPROB_MAX_ABS and diff.mean() < LOGPROB_MEAN_ABS
    # The check can fail: the same tokens scored at T=1 (vLLM's default raw_logprobs mode)
    # are far outside the tolerance.
    raw_gap = ((plain - behaviour).abs() * mask)[mask.bool()]
    assert raw_gap.mean() > 20 * LOGPROB_MEAN_ABS


def test_digest_failure_is_refused_and_previous_version_keeps_serving(vllm_pool: Pool) -> None:
    pool = vllm_pool
    replica = pool.replicas[0]
    with pool.client(replica) as client:
        good = pool.publish(client)
        prompts = pool.prompts()
        expected = greedy(client, prompts)
        # Commit the next version, then damage its weights file in the registry.
        pool.perturb(3)
        bad = good + 1
        pool.version = bad
        local = pool.root / "bad-version"
        pool.policy.save_weights(local)
        pool.registry.publish(bad, local)
        damage_committed(pool, bad)
        with pytest.raises(RolloutError, match="digest"):
            client.load_weights(pool.registry_uri, bad)
        assert httpx.get(f"{replica.url}/v1/weights/version", timeout=30).json() == {
            "weight_version": good
        }
        groups = client.generate(prompts, GREEDY)
        assert [g[0].token_ids for g in groups] == expected
        assert {g[0].weight_version for g in groups} == {good}
    # Leave both replicas on one good version for the tests that follow.
    pool.perturb(4)
    pool.version = bad
    with pool.client() as both:
        pool.publish(both)


def test_vllm_rpc_is_not_reachable_through_the_front_door(vllm_pool: Pool) -> None:
    url = vllm_pool.replicas[0].url
    response = httpx.post(f"{url}/collective_rpc", json={"method": "weights_checksum"})
    assert response.status_code == 404
    assert httpx.post(f"{url}/reset_prefix_cache").status_code == 404
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 200


def damage_committed(pool: Pool, version: int, name: str = "model.safetensors") -> None:
    """Flip one byte of a committed version's file ``name``: its digest no longer matches."""
    weights_file = pool.root / "store" / pool.registry.version_key(version) / name
    with weights_file.open("r+b") as handle:
        handle.seek(weights_file.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_killed_replica_rejoins_at_the_latest_version_before_ready(vllm_pool: Pool) -> None:
    """A replica down while the trainer publishes pulls the latest version on restart; when
    the newest committed version fails its digest it joins at the newest one that verifies
    and says which it refused."""
    pool = vllm_pool
    survivor, victim = pool.replicas
    victim.kill()
    with pool.client(survivor) as client:
        pool.perturb(5)
        version = pool.publish(client)  # only the survivor hears about it
        expected = greedy(client, pool.prompts())
    # A newer version is committed and then damaged in the registry (nobody loads it).
    pool.perturb(7)
    broken = version + 1
    local = pool.root / "broken-version"
    pool.policy.save_weights(local)
    pool.registry.publish(broken, local)
    damage_committed(pool, broken)
    pool.version = broken  # the next publish is broken + 1
    victim.start()
    # The first 200 from /health already reports the version it loaded before ready: the
    # newest that verifies, with the damaged one named.
    health = victim.wait_ready(timeout_s=2400)
    assert health["weight_version"] == version
    assert health["refused_versions"] == [broken]
    assert f"refused weights v{broken}" in victim.log_path.read_text()
    with pool.client(victim) as client:
        groups = client.generate(pool.prompts(), GREEDY)
    assert [g[0].token_ids for g in groups] == expected
    assert {g[0].weight_version for g in groups} == {version}
    assert served_versions(pool) == [version, version]


def test_concurrent_requests_during_a_load_report_one_version_each(vllm_pool: Pool) -> None:
    """Requests in flight while a version loads each report the version they ran on."""
    pool = vllm_pool
    replica = pool.replicas[0]
    with pool.client(replica) as client:
        old = served_versions(pool)[0]  # pool.version may name a damaged, unserved one
        params = SamplingParams(n=2, max_tokens=16, temperature=TEMPERATURE, seed=1)
        with ThreadPoolExecutor(2) as executor:
            sampling = executor.submit(client.generate, pool.prompts() * 3, params)
            pool.perturb(6)
            new = pool.publish(client)
            groups = sampling.result()
    versions = {c.weight_version for g in groups for c in g}
    assert versions <= {old, new} and versions


def test_a_delta_version_serves_exactly_what_the_full_version_does(vllm_pool: Pool) -> None:
    """The trainer publishes a step as a delta (only the final norm moved), then the same
    weights again as a full version: each replica's greedy token ids and logprobs agree."""
    pool = vllm_pool
    scratch = pool.root / "delta-scratch"
    scratch.mkdir(exist_ok=True)
    with pool.client() as both:
        deltas = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=False)
        full = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=False,
                               deltas=None)  # fmt: skip
        pool.version += 1
        deltas.publish(pool.policy, pool.version)  # this publisher's first: full
        pool.perturb(seed=21)
        pool.version += 1
        deltas.publish(pool.policy, pool.version)
        assert deltas.last_kind == "delta" and deltas.last_bytes < full_bytes(pool) / 20
        assert served_versions(pool) == [pool.version, pool.version]
        via_delta = [outputs(pool, replica) for replica in pool.replicas]
        pool.version += 1
        full.publish(pool.policy, pool.version)
        assert full.last_kind == "full"
        assert served_versions(pool) == [pool.version, pool.version]
        via_full = [outputs(pool, replica) for replica in pool.replicas]
        assert via_delta == via_full
        deltas.close()
        full.close()


def full_bytes(pool: Pool) -> int:
    return sum(f.stat().st_size for f in pool.model_dir.glob("*.safetensors"))


def outputs(pool: Pool, replica: LocalVllmReplica) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and logprobs, one prompt per request and one request at a time: the
    client sends a list's prompts concurrently, and which requests vLLM batches together
    changes the float sums (a logprob, sometimes a token), whatever the weights. Alone, each
    prompt is computed the same way under two versions with the same bytes."""
    with pool.client(replica) as client:
        return [(group[0].token_ids, group[0].logprobs)
                for prompt in pool.prompts()
                for group in client.generate([prompt], GREEDY)]  # fmt: skip


def worker_rpc(replica: LocalVllmReplica, method: str, *args: str) -> list[Any]:
    """The worker extension's ``method`` through vLLM's own port (inside the "pod")."""
    response = httpx.post(f"http://127.0.0.1:{replica.internal_port}/collective_rpc",
                          json={"method": method, "args": list(args)}, timeout=600)  # fmt: skip
    response.raise_for_status()
    return list(response.json()["results"])


def checksums(pool: Pool) -> list[float]:
    return [worker_rpc(replica, "weights_checksum")[0] for replica in pool.replicas]


def test_direct_transfer_serves_exactly_what_a_registry_load_does(vllm_pool: Pool) -> None:
    """The same weights through the registry (files, digests, vLLM's reload) and by direct
    transfer (16 MiB shared-memory buckets through vLLM's weight-transfer API): each replica
    ends with the same parameters and the same greedy token ids and logprobs; both say
    where their time went. vLLM's reload of the registry's bytes from memory gives the same
    parameters too (what bench/weight_publish.py compares against)."""
    from posttrain.rollout.vllm import LOAD_PHASES

    pool = vllm_pool
    scratch = pool.root / "transfer-scratch"
    scratch.mkdir(exist_ok=True)
    with pool.client() as both:
        files = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=False,
                                deltas=None)  # fmt: skip
        direct = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=True,
                                 deltas=None, transfer_bucket_bytes=16 << 20)  # fmt: skip
        pool.perturb(seed=31)
        pool.version += 1
        files.publish(pool.policy, pool.version)
        assert served_versions(pool) == [pool.version] * 2
        for reply in both.last_load_replies.values():
            assert set(reply["phases"]) == set(LOAD_PHASES)
            assert 0 < reply["phases"]["reload_in_worker"] <= reply["phases"]["reload"]
        via_files, sums = [outputs(pool, r) for r in pool.replicas], checksums(pool)
        registry_dir = pool.root / "store" / pool.registry.version_key(pool.version)

        pool.version += 1
        direct.publish(pool.policy, pool.version)
        assert direct.transport == "transfer" and set(direct.last_phases) == {
            "transfer",
            "gather",
            "pack",
        }
        tensor_bytes = sum(t.numel() * t.element_size() for _, t in pool.policy.full_weights())
        assert direct.last_bytes == tensor_bytes  # fp32, every tensor once
        assert served_versions(pool) == [pool.version] * 2
        for reply in both.last_load_replies.values():
            assert {"drain", "start", "update", "finish", "flip"} <= set(reply["phases"])
        assert checksums(pool) == sums
        assert [outputs(pool, r) for r in pool.replicas] == via_files

        replica = pool.replicas[0]
        worker_rpc(replica, "stage_weights_in_memory", str(registry_dir))
        (timed,) = worker_rpc(replica, "reload_staged_weights")
        worker_rpc(replica, "drop_staged_weights")
        assert timed["tensors"] > 0 and timed["seconds"] > 0
        assert checksums(pool)[0] == sums[0]
        files.close()
        direct.close()


def _two_rank_transfer(
    rank: int, port: int, model: str, urls: list[str], version: int, root: str,
    results: dict[str, Any],
) -> None:  # fmt: skip
    """One Gloo rank of a sharded trainer (FSDP2) publishing ``model``'s weights by direct
    transfer: both ranks gather every tensor, rank 0 alone packs and sends."""
    import torch.distributed as dist

    from posttrain.trainer.model.policy import RankInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    policy = Policy(Path(model), learning_rate=1e-5, rank=RankInfo(rank, 2, rank))
    assert policy.sharded
    scratch = Path(root) / f"rank{rank}"
    scratch.mkdir()
    with RolloutClient(urls, timeout_s=600) as client:
        publisher = WeightPublisher(None, "unused://", client, scratch, shared=True,
                                    deltas=None, transfer_bucket_bytes=16 << 20)  # fmt: skip
        publisher.publish(policy, version)
        results[f"rank{rank}"] = (publisher.transport, sorted(publisher.last_phases),
                                  publisher.last_bytes)  # fmt: skip
        publisher.close()
    dist.destroy_process_group()


def test_two_trainer_ranks_transfer_directly_what_one_process_publishes(vllm_pool: Pool) -> None:
    """A sharded trainer (two Gloo ranks, FSDP2) publishes by direct transfer: rank 0 sends
    what both gathered, and every replica then holds exactly the parameters -- and serves
    exactly the greedy token ids and logprobs -- of the same weights published through the
    registry by one process."""
    import torch.multiprocessing as mp

    from posttrain.processes import free_port

    pool = vllm_pool
    root = pool.root / "two-rank-transfer"
    root.mkdir(exist_ok=True)
    results = mp.Manager().dict()
    pool.version += 1
    transferred = pool.version
    urls = [r.url for r in pool.replicas]
    mp.spawn(_two_rank_transfer,
             args=(free_port(), str(pool.model_dir), urls, transferred, str(root), results),
             nprocs=2, join=True)  # fmt: skip
    transport, phases, sent = results["rank0"]
    assert (transport, phases) == ("transfer", ["gather", "pack", "transfer"])
    assert results["rank1"][0] == "transfer" and results["rank1"][2] == 0  # sent nothing
    assert served_versions(pool) == [transferred] * 2
    via_transfer = [fresh_outputs(pool, r) for r in pool.replicas], checksums(pool)

    base = Policy(pool.model_dir, learning_rate=1e-5)  # the same weights, one process
    assert sent == sum(t.numel() * t.element_size() for _, t in base.full_weights())
    scratch = root / "files"
    scratch.mkdir(exist_ok=True)
    with pool.client() as both:
        files = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=False,
                                deltas=None)  # fmt: skip
        pool.version += 1
        files.publish(base, pool.version)
        files.close()
    assert served_versions(pool) == [pool.version] * 2
    assert ([fresh_outputs(pool, r) for r in pool.replicas], checksums(pool)) == via_transfer


def served_version(replica: LocalVllmReplica) -> int:
    response = httpx.get(f"{replica.url}/v1/weights/version", timeout=30)
    return int(response.json()["weight_version"])


def vllm_metric(replica: LocalVllmReplica, name: str) -> float:
    """vLLM's ``name`` summed over its label sets, through the front door's /metrics (0
    when the replica does not answer)."""
    try:
        text = httpx.get(f"{replica.url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return 0.0
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def client_answers(url: str, outcome: str = "ok") -> float:
    """The trainer side's count of ``url``'s answers (posttrain_rollout_client_requests_total)."""
    value = REGISTRY.get_sample_value(
        "posttrain_rollout_client_requests_total", {"endpoint": url, "outcome": outcome}
    )
    return value or 0.0


def fresh_outputs(pool: Pool, replica: LocalVllmReplica) -> list[tuple[list[int], list[float]]]:
    """:func:`outputs` with vLLM's prefix cache emptied first (inside the "pod", as a load
    does): a prompt whose blocks are cached is prefilled by another kernel path, which can
    change a logprob's last bits whatever the weights."""
    reset = httpx.post(f"http://127.0.0.1:{replica.internal_port}/reset_prefix_cache", timeout=60)
    reset.raise_for_status()
    return outputs(pool, replica)


def commit_delta(
    pool: Pool, version: int, base_version: int, base: Path, new: Path, scratch: Path,
    wrong_sha256_of: str | None = None,
) -> None:  # fmt: skip
    """Commit ``new``'s tensors to the registry as ``version``, a delta over
    ``base_version`` (whose tensors are ``base``), as the trainer's publisher does; with
    ``wrong_sha256_of``, the manifest promises another sha256 for that tensor's result."""
    plan = diff_state_dicts(base_version, SafetensorsDir(base), SafetensorsDir(new))
    assert plan is not None
    if wrong_sha256_of is not None:
        plan.metadata["tensors"][wrong_sha256_of]["sha256"] = "0" * 64
    directory = write_delta(plan, scratch / f"delta-v{version}").parent
    pool.registry.publish(version, directory, {"delta": plan.metadata})


def test_a_corrupt_delta_is_refused_and_the_replica_stays_on_its_version(vllm_pool: Pool) -> None:
    """A delta committed to the registry, then damaged -- a byte of its file, or the sha256
    its result must have -- is refused by a vLLM replica with an error saying why; it keeps
    serving its version exactly (version endpoint, greedy token ids and logprobs), and the
    next good delta still applies on the copy it holds and changes what it serves."""
    pool = vllm_pool
    replica = pool.replicas[0]
    scratch = pool.root / "corrupt-scratch"
    scratch.mkdir(exist_ok=True)
    with pool.client() as both, pool.client(replica) as single:
        publisher = WeightPublisher(pool.registry, pool.registry_uri, both, scratch, shared=False)
        pool.version += 1
        good = pool.version
        publisher.publish(pool.policy, good)  # this publisher's first: full
        assert publisher.last_kind == "full"
        expected = outputs(pool, replica)
        pool.perturb(seed=61)
        new = pool.policy.save_weights(scratch / "next")  # as the publisher writes it
        assert new is not None
        base = pool.root / "store" / pool.registry.version_key(good)
        damaged, misdigested = good + 1, good + 2
        pool.version = misdigested
        commit_delta(pool, damaged, good, base, new, scratch)
        damage_committed(pool, damaged, "delta.safetensors")
        with pytest.raises(RolloutError, match=f"refused weights v{damaged} ") as refused:
            single.load_weights(pool.registry_uri, damaged)
        assert "digest" in str(refused.value) and "delta.safetensors" in str(refused.value)
        commit_delta(pool, misdigested, good, base, new, scratch, "model.norm.weight")
        with pytest.raises(
            RolloutError,
            match=re.escape("tensor model.norm.weight after applying the delta does not match"),
        ):
            single.load_weights(pool.registry_uri, misdigested)
        assert served_versions(pool) == [good, good]
        assert fresh_outputs(pool, replica) == expected
        groups = single.generate(pool.prompts(), GREEDY)
        assert {g[0].weight_version for g in groups} == {good}
        # The same weights as a good delta over the held copy: loaded, and they change the
        # output (so "unchanged" above says the refused bytes were not served).
        pool.version += 1
        publisher.publish(pool.policy, pool.version)
        assert publisher.last_kind == "delta"
        assert served_versions(pool) == [pool.version, pool.version]
        assert outputs(pool, replica) != expected
        publisher.close()


def test_scale_down_mid_rollout_loses_nothing(vllm_pool: Pool) -> None:
    """SIGTERM (the kubelet, on a scale-down) to one replica's front door while a
    two-replica rollout is in flight: what it is generating finishes there (uvicorn drains
    without a limit), everything else goes to the other replica, and every request
    completes with its tokens. The leaver stays down: the next test brings it back."""
    pool = vllm_pool
    leaver = pool.replicas[1]
    prompts = [pool.policy.encode_prompt(f"Tell a long story about the number {i}.")
               for i in range(8)]  # fmt: skip
    params = SamplingParams(n=1, max_tokens=SCALE_DOWN_TOKENS, temperature=1.0, seed=1)
    urls = [r.url for r in pool.replicas]
    with (
        RolloutClient(urls, timeout_s=600, max_in_flight=2, max_retries=4) as client,
        ThreadPoolExecutor(1) as executor,
    ):
        rollout = executor.submit(client.generate, prompts, params)
        wait_for(lambda: vllm_metric(leaver, "vllm:num_requests_running") >= 1,
                 timeout_s=600, what="the leaver generating", interval_s=0.2)  # fmt: skip
        answered_before = client_answers(leaver.url)
        assert leaver.process is not None
        leaver.process.send_signal(signal.SIGTERM)  # the front door only, as in a pod
        groups = rollout.result(timeout=1800)
    drained = client_answers(leaver.url) - answered_before
    refused = client_answers(leaver.url, "transport_error")
    log.info("scale-down: %.0f request(s) finished on the leaver after SIGTERM, %.0f "
             "connection(s) to it failed and went elsewhere", drained, refused)  # fmt: skip
    assert leaver.process.wait(timeout=300) is not None  # it exits once drained
    leaver.stop()  # reap vLLM's engine processes
    assert leaver.health() is None
    assert len(groups) == len(prompts)
    for index, (completion,) in enumerate(groups):
        assert completion.prompt_index == index
        assert completion.finish_reason in ("length", "stop")
        assert 0 < len(completion.token_ids) == len(completion.logprobs) <= SCALE_DOWN_TOKENS
    assert drained >= 1, "what the leaver was generating at SIGTERM did not finish there"


def test_a_replica_that_joins_between_two_deltas_catches_up_and_is_sampled_from(
    vllm_pool: Pool,
) -> None:
    """Scale-up under a running trainer. A replica that was down while the trainer published
    a full version and then a delta starts, rebuilds full + delta from the registry, and its
    first ready /health says so; it serves exactly what the replica that loaded each
    version serves. The trainer publishes the next delta before the pool lists the new
    replica; the trainer's pool follower (``follow_pool``, fed by a list standing in for
    status.replicaEndpoints) loads that delta onto it -- applied on the copy it holds --
    before it samples from it, within JOIN_BOUND_S."""
    pool = vllm_pool
    survivor, joiner = pool.replicas
    joiner.stop()  # down: the scale-down test left it so; this makes sure when run alone
    assert joiner.health() is None
    scratch = pool.root / "join-scratch"
    scratch.mkdir(exist_ok=True)
    ready = [survivor.url]  # status.replicaEndpoints as the operator writes it
    with RolloutClient([survivor.url], discover=lambda: list(ready), timeout_s=600) as client:
        publisher = WeightPublisher(pool.registry, pool.registry_uri, client, scratch,
                                    shared=False)  # fmt: skip
        kinds: list[str] = []
        served: list[list[tuple[list[int], list[float]]]] = []
        for seed in (71, 72):
            pool.perturb(seed)
            pool.version += 1
            publisher.publish(pool.policy, pool.version)
            kinds.append(publisher.last_kind)
            served.append(outputs(pool, survivor))
        assert kinds == ["full", "delta"]
        assert served[0] != served[1]  # which of the two a replica serves shows
        joiner.start()
        health = joiner.wait_ready(timeout_s=2400)
        assert health["weight_version"] == pool.version
        assert "refused_versions" not in health
        assert outputs(pool, joiner) == served[1]
        assert len(set(checksums(pool))) == 1

        pool.perturb(73)
        pool.version += 1
        publisher.publish(pool.policy, pool.version)  # the trainer moves on meanwhile
        assert publisher.last_kind == "delta"
        assert served_version(joiner) == pool.version - 1  # behind: it must be caught up
        stop = follow_pool(client, lambda: list(ready), interval_s=0.5)
        try:
            listed = time.monotonic()
            ready.append(joiner.url)
            wait_for(lambda: joiner.url in client.urls, timeout_s=JOIN_BOUND_S,
                     what="the new replica among the trainer's endpoints", interval_s=0.05)  # fmt: skip
            joined_s = time.monotonic() - listed
            assert served_version(joiner) == pool.version  # loaded before it was used
            finished = vllm_metric(joiner, "vllm:request_success_total")
            params = SamplingParams(n=1, max_tokens=8, temperature=TEMPERATURE, seed=5)
            groups = client.generate(pool.prompts() * 4, params)
            assert {c.weight_version for g in groups for c in g} == {pool.version}
            assert vllm_metric(joiner, "vllm:request_success_total") > finished
        finally:
            stop.set()
        log.info("scale-up: the new replica was in the trainer's endpoints %.1fs after the "
                 "pool listed it", joined_s)  # fmt: skip
        assert fresh_outputs(pool, joiner) == fresh_outputs(pool, survivor)
        assert len(set(checksums(pool))) == 1
        publisher.close()


def test_a_joining_replica_refuses_a_damaged_delta_and_joins_at_the_version_before(
    vllm_pool: Pool,
) -> None:
    """Pull on join over a delta chain whose newest link is damaged (a byte of the delta's
    file flipped after commit). The restarting replica refuses that version, says so in its
    first ready /health, and joins at the newest version that verifies -- full + the good
    delta, rebuilt from the registry -- serving exactly what the replica that loaded it
    serves; the trainer's next delta (over the version both hold) then applies on it."""
    pool = vllm_pool
    survivor, joiner = pool.replicas
    joiner.stop()
    scratch = pool.root / "join-damaged-scratch"
    scratch.mkdir(exist_ok=True)
    with pool.client(survivor) as client:
        publisher = WeightPublisher(pool.registry, pool.registry_uri, client, scratch,
                                    shared=False)  # fmt: skip
        kinds: list[str] = []
        for seed in (81, 82):
            pool.perturb(seed)
            pool.version += 1
            publisher.publish(pool.policy, pool.version)
            kinds.append(publisher.last_kind)
        assert kinds == ["full", "delta"]
        good = pool.version
        expected = outputs(pool, survivor)
        base = pool.policy.save_weights(scratch / "good", weights_only=True)
        assert base is not None
        pool.perturb(83)
        new = pool.policy.save_weights(scratch / "damaged", weights_only=True)
        assert new is not None
        damaged = good + 1
        commit_delta(pool, damaged, good, base, new, scratch)
        damage_committed(pool, damaged, "delta.safetensors")
        pool.version = damaged  # the trainer's next version number comes after it

        joiner.start()
        health = joiner.wait_ready(timeout_s=2400)
        assert health["weight_version"] == good
        assert health["refused_versions"] == [damaged]
        assert f"refused weights v{damaged}" in joiner.log_path.read_text()
        assert fresh_outputs(pool, joiner) == fresh_outputs(pool, survivor) == expected
        assert len(set(checksums(pool))) == 1

        pool.version += 1
        with pool.client() as both:
            publisher.client = both
            publisher.publish(pool.policy, pool.version)  # its base: `good`, not the damaged one
        assert publisher.last_kind == "delta"
        assert served_versions(pool) == [pool.version, pool.version]
        assert fresh_outputs(pool, joiner) == fresh_outputs(pool, survivor) != expected
        assert len(set(checksums(pool))) == 1
        publisher.close()


def test_a_transfer_nobody_feeds_is_abandoned_by_each_replica_on_its_own(vllm_pool: Pool) -> None:
    """The trainer hangs after one bucket of other weights and sends nothing more -- not even
    its abort (a trainer killed outright looks the same). After TRANSFER_IDLE_S without a
    step each replica's watchdog abandons the session by itself, goes back to the bytes it
    served, bit for bit, and keeps serving them; and it loads the next version (the session
    let go of the replica's load locks)."""
    from posttrain.rollout.weight_transfer import BucketStream

    pool = vllm_pool
    with pool.client() as both:
        version = pool.publish(both)  # registry: each replica holds these bytes
        expected, sums = [outputs(pool, r) for r in pool.replicas], checksums(pool)
        marks = [r.log_path.stat().st_size for r in pool.replicas]
        pool.perturb(seed=43)
        stream = BucketStream(bucket_bytes=8 << 20)
        hung, release = threading.Event(), threading.Event()

        def hangs_after_one_bucket() -> Iterator[dict[str, Any]]:
            updates = stream.updates(pool.policy.full_weights())
            yield next(updates)
            hung.set()
            release.wait(timeout=3 * TRANSFER_IDLE_S + 600)
            raise RuntimeError("the trainer came back after its session was gone")

        failures: list[BaseException] = []

        def trainer() -> None:
            try:
                both.transfer_weights(version + 1, hangs_after_one_bucket())
            except BaseException as exc:  # the late abort finds no session: any error is fine
                failures.append(exc)

        def abandoned() -> bool:
            logs = [r.log_path.read_bytes()[m:].decode(errors="replace")
                    for r, m in zip(pool.replicas, marks, strict=True)]  # fmt: skip
            return all(f"restored weights v{version} from its held copy" in t for t in logs)

        thread = threading.Thread(target=trainer, name="hung-trainer", daemon=True)
        thread.start()
        try:
            assert hung.wait(timeout=600), "the first bucket never went out"
            started = time.monotonic()
            wait_for(abandoned, timeout_s=TRANSFER_IDLE_S + 600, interval_s=1.0,
                     what="both replicas to abandon the idle transfer")  # fmt: skip
            waited = time.monotonic() - started
        finally:
            release.set()
            thread.join(timeout=600)
            stream.close()
        assert not thread.is_alive()
        # The watchdog, not anything sooner: the session stayed open for the idle time.
        assert waited >= TRANSFER_IDLE_S - 2, waited
        for replica, mark in zip(pool.replicas, marks, strict=True):
            text = replica.log_path.read_bytes()[mark:].decode(errors="replace")
            assert (
                f"weight transfer of v{version + 1} abandoned after 1 buckets: no step for" in text
            )
        assert served_versions(pool) == [version, version]
        assert checksums(pool) == sums
        assert [outputs(pool, r) for r in pool.replicas] == expected
        # The session let go of the replica's load locks: the next version loads.
        newer = pool.publish(both)
        assert served_versions(pool) == [newer, newer]
        assert checksums(pool) != sums


def test_an_aborted_transfer_leaves_each_replica_on_its_version(vllm_pool: Pool) -> None:
    """The trainer dies before its first bucket (vLLM's session was opened), then after one
    bucket of other weights: each time every replica goes back to the bytes it served, bit
    for bit -- the first time as vLLM left them, the second from its held copy (the
    registry version it loaded) -- and keeps serving them. (Last in this file: a replica
    that cannot restore exits.)"""
    from posttrain.rollout.weight_transfer import BucketStream

    pool = vllm_pool
    with pool.client() as both:
        version = pool.publish(both)  # registry: each replica holds these bytes
        expected, sums = [outputs(pool, r) for r in pool.replicas], checksums(pool)
        embed = pool.policy.model.model.embed_tokens.weight  # the first bucket's tensor
        with torch.no_grad():
            embed.mul_(
                1 + 0.5 * torch.randn(embed.shape, generator=torch.Generator().manual_seed(41))
            )
        stream = BucketStream(bucket_bytes=8 << 20)

        def dies_before_a_bucket() -> Iterator[dict[str, Any]]:
            raise RuntimeError("the trainer died before its first bucket")
            yield {}

        with pytest.raises(RuntimeError, match="before its first bucket"):
            both.transfer_weights(version + 1, dies_before_a_bucket())
        assert served_versions(pool) == [version, version]
        assert checksums(pool) == sums

        def dies_after_one_bucket() -> Iterator[dict[str, Any]]:
            updates = stream.updates(pool.policy.full_weights())
            yield next(updates)
            raise RuntimeError("the trainer died mid-transfer")

        try:
            with pytest.raises(RuntimeError, match="died mid-transfer"):
                both.transfer_weights(version + 1, dies_after_one_bucket())
        finally:
            stream.close()
    assert served_versions(pool) == [version, version]
    assert checksums(pool) == sums
    assert [outputs(pool, r) for r in pool.replicas] == expected
    for replica in pool.replicas:
        text = replica.log_path.read_text()
        assert f"restored weights v{version} (no bucket had been loaded)" in text
        assert f"restored weights v{version} from its held copy" in text


def test_streamed_versions_from_object_storage_serve_what_downloads_do(
    vllm_pool: Pool, minio_server: MinioServer, minio_env: dict[str, str]
) -> None:
    """A replica whose registry is in a real MinIO: an idle replica streams each full
    version into vLLM as it downloads (the bytes also become its held copy, the base of the
    next delta); the same bytes streamed and downloaded serve the same greedy token ids and
    logprobs; a version damaged in storage is refused after part of it reached vLLM, which
    is back on the served version's exact parameters before anyone samples."""
    from posttrain.rollout.vllm import STREAM_PHASES
    from posttrain.storage.store import open_store

    pool = vllm_pool
    store = open_store("s3://vllm-stream/run")
    registry = WeightRegistry(store, "weights", keep_last=3)
    uri = store.uri("weights")
    scratch = pool.root / "stream-scratch"
    scratch.mkdir(exist_ok=True)
    replica = LocalVllmReplica(pool.model_dir, pool.root / "replica-s3.log", weights_uri=uri,
                               env=minio_server.env())  # fmt: skip
    with replica, RolloutClient([replica.url], timeout_s=600) as client:
        assert replica.wait_ready(timeout_s=2400)["weight_version"] == 0
        publisher = WeightPublisher(registry, uri, client, scratch, shared=False,
                                    dtype=torch.bfloat16)  # fmt: skip
        pool.perturb(seed=51)
        publisher.publish(pool.policy, 1)  # idle, at v0: streams (the way back is the model)
        assert publisher.last_kind == "full"
        assert set(client.last_load_replies[replica.url]["phases"]) == set(STREAM_PHASES)
        pool.perturb(seed=52)
        publisher.publish(pool.policy, 2)  # a delta over the streamed version's held copy
        assert publisher.last_kind == "delta"
        assert "fetch" in client.last_load_replies[replica.url]["phases"]

        def commit_full(version: int) -> None:
            local = scratch / f"full-{version}"
            pool.policy.save_weights(local, weights_only=True, dtype=torch.bfloat16)
            registry.publish(version, local)

        commit_full(3)
        commit_full(4)  # the same bytes again
        client.load_weights(uri, 3, stream=False)
        assert "fetch" in client.last_load_replies[replica.url]["phases"]
        downloaded, downloaded_sum = outputs_of(replica), worker_rpc(replica, "weights_checksum")
        client.load_weights(uri, 4, stream=True)
        phases = client.last_load_replies[replica.url]["phases"]
        assert set(phases) == set(STREAM_PHASES), phases
        assert outputs_of(replica) == downloaded
        assert worker_rpc(replica, "weights_checksum") == downloaded_sum

        pool.perturb(seed=53)
        commit_full(5)
        damage_object(minio_server, "vllm-stream", f"run/{registry.version_key(5)}")
        with pytest.raises(RolloutError, match="fails its checksum"):
            client.load_weights(uri, 5, stream=True)
        assert httpx.get(f"{replica.url}/v1/weights/version", timeout=30).json() == {
            "weight_version": 4
        }
        assert worker_rpc(replica, "weights_checksum") == downloaded_sum
        assert outputs_of(replica) == downloaded
        # Cut short (as a connection lost for good would leave it): vLLM's reload is
        # interrupted inside a layer, finished, and the served version reloaded.
        commit_full(6)
        damage_object(minio_server, "vllm-stream", f"run/{registry.version_key(6)}", cut=0.4)
        with pytest.raises(RolloutError, match="ends after"):
            client.load_weights(uri, 6, stream=True)
        assert worker_rpc(replica, "weights_checksum") == downloaded_sum
        assert outputs_of(replica) == downloaded
        text = replica.log_path.read_text()
        assert "streaming weights v5 failed; vLLM reloaded v4" in text
        assert "streaming weights v6 failed; vLLM reloaded v4" in text
        publisher.close()


def outputs_of(replica: LocalVllmReplica) -> list[tuple[list[int], list[float]]]:
    """:func:`outputs` for a replica outside the pool (same prompts, one at a time)."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    with RolloutClient([replica.url], timeout_s=600) as client:
        return [(group[0].token_ids, group[0].logprobs)
                for prompt in prompts
                for group in client.generate([prompt], GREEDY)]  # fmt: skip


def damage_object(minio: MinioServer, bucket: str, prefix: str, cut: float = 0.0) -> None:
    """Flip one byte in the middle of the committed ``model.safetensors`` under ``prefix``,
    in place in the store (the same size: only its digest can tell); with ``cut``, keep
    only that fraction of its bytes instead."""
    import io

    client = minio.client()
    name = f"{prefix}/model.safetensors"
    response = client.get_object(bucket, name)
    try:
        data = bytearray(response.read())
    finally:
        response.close()
        response.release_conn()
    if cut:
        data = data[: int(len(data) * cut)]
    else:
        data[len(data) // 2] ^= 0xFF
    client.put_object(bucket, name, io.BytesIO(bytes(data)), len(data))
