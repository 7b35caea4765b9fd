"""Delta weight versions end to end: the trainer's WeightPublisher and WeightRegistry, the
CPU rollout server (ServerThread, real HTTP), on a tiny model published in bf16."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from prometheus_client import REGISTRY

from posttrain.rollout import weights
from posttrain.rollout.client import RolloutClient, RolloutError
from posttrain.rollout.deltas import diff_state_dicts, write_delta
from posttrain.rollout.engine import read_safetensors_dir
from posttrain.rollout.protocol import SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import open_store
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import DeltaPolicy, WeightPublisher

if TYPE_CHECKING:
    from posttrain.devenv.minio import MinioServer

    from .conftest import ServeProcess


class Replicas:
    """Servers started in a test, stopped at its end."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.servers: list[ServerThread] = []
        self.clients: list[RolloutClient] = []

    def start(self, weights_uri: str | None = None) -> tuple[ServerThread, RolloutClient]:
        config = ServerConfig(model=str(self.model), weights_uri=weights_uri, num_threads=1)
        server = ServerThread(config).start()
        client = RolloutClient([server.url], timeout_s=120)
        self.servers.append(server)
        self.clients.append(client)
        return server, client


@pytest.fixture()
def replicas(tiny_model_dir: Path) -> Iterator[Replicas]:
    started = Replicas(tiny_model_dir)
    try:
        yield started
    finally:
        for client in started.clients:
            client.close()
        for server in started.servers:
            server.stop()


def _sparse_step(policy: Policy, seed: int, fraction: float = 0.02) -> None:
    """Stand-in for an optimizer step at an RL learning rate: a few weights move enough to
    change their bf16 bits, the rest stay bit-identical."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            moved = torch.rand(parameter.shape, generator=generator) < fraction
            noise = 0.05 * torch.randn(parameter.shape, generator=generator)
            parameter.add_(noise * moved)


def _publisher(tmp: Path, name: str, client: RolloutClient, **kwargs: object) -> WeightPublisher:
    store = open_store(str(tmp / name))
    (tmp / f"scratch-{name}").mkdir()
    registry = WeightRegistry(store, "weights", keep_last=2)
    return WeightPublisher(registry, store.uri("weights"), client, tmp / f"scratch-{name}",
                           shared=False, dtype=torch.bfloat16, **kwargs)  # type: ignore[arg-type]  # fmt: skip


def _expected_bf16(policy: Policy, tmp: Path) -> dict[str, torch.Tensor]:
    """The bytes of the full version the trainer publishes now."""
    path = policy.save_weights(tmp / "expected", weights_only=True, dtype=torch.bfloat16)
    assert path is not None
    return read_safetensors_dir(path)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


def _greedy(client: RolloutClient, policy: Policy) -> tuple[int, list[int], list[float]]:
    prompt = policy.encode_prompt("What is 1 + 2?")
    params = SamplingParams(n=1, max_tokens=8, temperature=0.0, seed=0)
    (completion,) = client.generate([prompt], params)[0]
    return completion.weight_version, completion.token_ids, completion.logprobs


def test_delta_and_full_versions_serve_identical_logits(
    tiny_model_dir: Path, replicas: Replicas, tmp_path: Path
) -> None:
    policy = Policy(tiny_model_dir, learning_rate=1e-3)
    full_server, full_client = replicas.start()
    delta_server, delta_client = replicas.start()
    full = _publisher(tmp_path, "full", full_client, deltas=None)
    delta = _publisher(tmp_path, "delta", delta_client)
    for version in (1, 2, 3):
        if version > 1:
            _sparse_step(policy, seed=version)
        full.publish(policy, version)
        delta.publish(policy, version)
        assert (full.last_kind, delta.last_kind) == ("full", "full" if version == 1 else "delta")
    assert delta.last_bytes < full.last_bytes / 5  # 2% changed
    deltas_counted = REGISTRY.get_sample_value(
        "posttrain_trainer_weight_versions_total", {"kind": "delta"}
    )
    assert deltas_counted is not None and deltas_counted >= 2
    manifest = json.loads((tmp_path / "delta/weights/v00000003/manifest.json").read_text())
    assert manifest["metadata"]["delta"]["base"] == 2
    assert [f["path"] for f in manifest["files"]] == ["delta.safetensors"]

    served_full, served_delta = _greedy(full_client, policy), _greedy(delta_client, policy)
    assert served_full[0] == served_delta[0] == 3
    assert served_full == served_delta  # same token ids, same logprobs
    expected = _expected_bf16(policy, tmp_path)
    assert _same_bits(read_safetensors_dir(delta_server.state.held.directory), expected)
    assert _same_bits(read_safetensors_dir(full_server.state.held.directory), expected)
    for publisher in (full, delta):
        publisher.close()


def test_a_replica_that_joins_between_two_deltas_catches_up(
    tiny_model_dir: Path, replicas: Replicas, tmp_path: Path
) -> None:
    policy = Policy(tiny_model_dir, learning_rate=1e-3)
    _, first = replicas.start()
    publisher = _publisher(tmp_path, "run", first, deltas=DeltaPolicy(max_chain=3))
    publisher.publish(policy, 1)
    _sparse_step(policy, seed=2)
    publisher.publish(policy, 2)
    assert publisher.last_kind == "delta"

    # Joins after v2 (a delta): rebuilds v1 + v2 from the registry before it is ready.
    late, late_client = replicas.start(weights_uri=publisher.registry_uri)
    assert late.state.engine.weight_version == 2
    assert late.state.held is not None and late.state.held.version == 2
    assert _same_bits(read_safetensors_dir(late.state.held.directory),
                      _expected_bf16(policy, tmp_path / "v2"))  # fmt: skip

    # The next delta (v3 over v2) applies on what it holds, and it serves v3 exactly.
    _sparse_step(policy, seed=3)
    publisher.client = RolloutClient([s.url for s in replicas.servers], timeout_s=120)
    replicas.clients.append(publisher.client)
    publisher.publish(policy, 3)
    assert publisher.last_kind == "delta"
    assert _same_bits(read_safetensors_dir(late.state.held.directory),
                      _expected_bf16(policy, tmp_path / "v3"))  # fmt: skip
    assert _greedy(late_client, policy) == _greedy(first, policy)

    # max_chain=3: after the deltas v2, v3, v4 comes a full v5; a replica joining then
    # takes it as it is.
    for version in (4, 5):
        _sparse_step(policy, seed=version)
        publisher.publish(policy, version)
    assert publisher.last_kind == "full"
    newest, _ = replicas.start(weights_uri=publisher.registry_uri)
    assert newest.state.engine.weight_version == 5
    assert _same_bits(read_safetensors_dir(newest.state.held.directory),
                      _expected_bf16(policy, tmp_path / "v5"))  # fmt: skip
    publisher.close()


def test_a_corrupt_delta_is_refused_and_the_replica_stays_on_its_version(
    tiny_model_dir: Path, replicas: Replicas, tmp_path: Path
) -> None:
    policy = Policy(tiny_model_dir, learning_rate=1e-3)
    server, client = replicas.start()
    publisher = _publisher(tmp_path, "run", client)
    publisher.publish(policy, 1)
    _sparse_step(policy, seed=2)
    publisher.publish(policy, 2)
    assert publisher.last_kind == "delta"
    served_before = _greedy(client, policy)

    # v3: a well-formed delta whose file matches its manifest, but the result does not have
    # the bytes the manifest promises (a delta made from another base would do the same).
    v2 = _expected_bf16(policy, tmp_path / "v2")
    _sparse_step(policy, seed=3)
    plan = diff_state_dicts(2, v2, _expected_bf16(policy, tmp_path / "v3"))
    assert plan is not None
    name = sorted(plan.metadata["tensors"])[0]
    plan.metadata["tensors"][name]["sha256"] = "0" * 64
    registry: WeightRegistry = publisher.registry
    registry.publish(3, write_delta(plan, tmp_path / "bad-v3").parent, {"delta": plan.metadata})
    with pytest.raises(RolloutError, match=f"tensor {name} after applying the delta does not"):
        client.load_weights(publisher.registry_uri, 3)
    assert server.state.engine.weight_version == 2
    assert _greedy(client, policy) == served_before

    # A replica joining now refuses v3 (and says so in /health) and serves v2, exactly.
    joined, joined_client = replicas.start(weights_uri=publisher.registry_uri)
    assert joined.state.engine.weight_version == 2
    assert "does not match the sha256" in joined.state.refused[3]
    assert _greedy(joined_client, policy) == served_before

    # A delta whose file was damaged after commit fails its file digest: refused the same way.
    _sparse_step(policy, seed=4)
    plan = diff_state_dicts(2, v2, _expected_bf16(policy, tmp_path / "v4"))
    assert plan is not None
    registry.publish(4, write_delta(plan, tmp_path / "v4-delta").parent, {"delta": plan.metadata})
    delta_file = tmp_path / "run/weights/v00000004/delta.safetensors"
    data = bytearray(delta_file.read_bytes())
    data[-1] ^= 0xFF
    delta_file.write_bytes(bytes(data))
    with pytest.raises(RolloutError, match="digest"):
        client.load_weights(publisher.registry_uri, 4)
    assert server.state.engine.weight_version == 2
    assert _greedy(client, policy) == served_before
    publisher.close()


def test_fetch_version_refuses_a_chain_whose_base_is_gone(tmp_path: Path) -> None:
    """Nothing to rebuild from: the version is unusable (the replica keeps what it has)."""
    store = open_store(str(tmp_path / "run"))
    base = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    new = {"w": torch.tensor([0, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bfloat16)}
    plan = diff_state_dicts(1, base, new)
    assert plan is not None
    (tmp_path / "run" / "weights" / "v00000001").mkdir(parents=True)
    delta_dir = write_delta(plan, tmp_path / "d").parent
    # Committed by hand: WeightRegistry.publish itself refuses a delta over a missing base.
    from posttrain.storage.commit import upload_dir

    upload_dir(store, "weights/v00000002", delta_dir, metadata={"delta": plan.metadata})
    with pytest.raises(weights.unusable_version_errors(), match="no longer published"):
        weights.fetch_version(store.uri("weights"), 2, tmp_path)


def test_a_step_that_moves_most_weights_publishes_a_full_version(
    tiny_model_dir: Path, replicas: Replicas, tmp_path: Path
) -> None:
    policy = Policy(tiny_model_dir, learning_rate=1e-3)
    _, client = replicas.start()
    publisher = _publisher(tmp_path, "run", client)
    publisher.publish(policy, 1)
    _sparse_step(policy, seed=2, fraction=1.0)  # every weight moves
    publisher.publish(policy, 2)
    assert publisher.last_kind == "full" and publisher.last_changed_fraction is None
    manifest = json.loads((tmp_path / "run/weights/v00000002/manifest.json").read_text())
    assert "delta" not in manifest["metadata"]
    assert _greedy(client, policy)[0] == 2
    publisher.close()


def test_a_delta_chain_through_s3_rebuilds_the_full_bytes_and_refuses_a_bad_digest(
    minio_server: MinioServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The s3:// path a cluster replica takes (real MinIO): the manifests name the bases,
    each directory is downloaded and verified, the result is checked tensor by tensor."""
    from posttrain.storage.store import S3Store

    monkeypatch.setenv("POSTTRAIN_S3_ENDPOINT", minio_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", minio_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", minio_server.secret_key)
    store = S3Store(minio_server.endpoint, "deltas", "run", access_key=minio_server.access_key,
                    secret_key=minio_server.secret_key)  # fmt: skip
    registry = WeightRegistry(store, "weights", keep_last=5)
    generator = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(64, 32, generator=generator).to(torch.bfloat16)}]
    for _ in range(3):
        moved = states[-1]["w"].clone()
        moved[torch.rand(moved.shape, generator=generator) < 0.05] += 1
        states.append({"w": moved})
    from safetensors.torch import save_file

    (tmp_path / "v1").mkdir()
    save_file(states[0], str(tmp_path / "v1" / "model.safetensors"))
    registry.publish(1, tmp_path / "v1")
    for version in (2, 3, 4):
        plan = diff_state_dicts(version - 1, states[version - 2], states[version - 1])
        assert plan is not None
        if version == 4:
            plan.metadata["tensors"]["w"]["sha256"] = "f" * 64
        delta_dir = write_delta(plan, tmp_path / f"d{version}").parent
        registry.publish(version, delta_dir, {"delta": plan.metadata})
    uri = "s3://deltas/run/weights"

    path, temporary = weights.fetch_version(uri, 3, tmp_path)  # joins late: v1 + v2 + v3
    assert temporary and _same_bits(read_safetensors_dir(path), states[2])
    held = weights.hold(3, path, temporary, tmp_path)
    with pytest.raises(weights.unusable_version_errors(), match="tensor w after applying"):
        weights.fetch_version(uri, 4, tmp_path, held)
    assert _same_bits(read_safetensors_dir(held.directory), states[2])  # still v3's bytes


def test_held_root_removes_the_copies_of_processes_that_are_gone(tmp_path: Path) -> None:
    """A replica killed mid-run leaves its held copy; the next one removes it, and a
    directory under its own pid from an earlier start (a restarted container), never a
    live process's (pid 1, with or without its start time)."""
    import os
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me, init = weights._process_tag(os.getpid()), weights._process_tag(1)
    names = [f"{gone.pid}", f"{gone.pid}-123", f"{os.getpid()}", f"{os.getpid()}-1",
             "1", init, "1-1", "not-a-pid"]  # fmt: skip
    for name in names:
        (tmp_path / f"{weights.HELD_PREFIX}{name}").mkdir()
        (tmp_path / f"{weights.HELD_PREFIX}{name}" / "model.safetensors").write_bytes(b"x")
    root = weights.held_root(tmp_path)
    assert root == tmp_path / f"{weights.HELD_PREFIX}{me}" and not any(root.iterdir())
    (root / "weights-v00000001-x").mkdir()
    assert weights.held_root(tmp_path) == root  # a second server in this process shares it
    assert (root / "weights-v00000001-x").is_dir()
    assert sorted(p.name.removeprefix(weights.HELD_PREFIX) for p in tmp_path.iterdir()) == sorted(
        ["1", init, "not-a-pid", me]
    )  # pid 1 under another start time ("1-1") is a reused pid: removed


def test_a_killed_servers_held_copy_is_removed_by_the_next_server(
    tmp_path: Path,
    tiny_model_dir: Path,
    serve_process: type[ServeProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``posttrain serve`` keeps the version it serves under a held root of its own in the
    scratch directory; SIGKILL runs no cleanup, so the next server removes the copy the
    killed one left, and a server stopped with SIGTERM (a pod's deletion) removes its own."""
    import signal

    from posttrain.api.env import WEIGHTS_SCRATCH

    from .conftest import publish_perturbed

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv(WEIGHTS_SCRATCH, str(scratch))
    store = open_store(str(tmp_path / "registry"))
    published = publish_perturbed(tiny_model_dir, tmp_path / "staging", 1, 0.01)
    WeightRegistry(store, "weights").publish(1, published)

    def held() -> dict[int, list[str]]:
        """pid -> the files each server holds."""
        return {int(root.name.removeprefix(weights.HELD_PREFIX).split("-")[0]):
                sorted(f.name for f in root.rglob("*.safetensors"))
                for root in scratch.glob(weights.HELD_PREFIX + "*")}  # fmt: skip

    killed = serve_process(tiny_model_dir, "--weights-uri", store.uri("weights")).wait_ready()
    assert held() == {killed.process.pid: ["model.safetensors"]}
    killed.kill()
    assert held() == {killed.process.pid: ["model.safetensors"]}  # SIGKILL: left behind

    following = serve_process(tiny_model_dir, "--weights-uri", store.uri("weights")).wait_ready()
    assert held() == {following.process.pid: ["model.safetensors"]}
    following.process.send_signal(signal.SIGTERM)
    following.process.wait(timeout=60)
    assert held() == {}
