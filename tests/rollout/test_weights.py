"""Finding and fetching published weight versions, including through posttrain.storage."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from posttrain.rollout import weights
from posttrain.rollout.server import ServerConfig, ServerThread


def test_version_dir_name() -> None:
    assert weights.version_dir_name(3) == "v00000003"
    with pytest.raises(ValueError, match=">= 0"):
        weights.version_dir_name(-1)


def test_plain_local_prefix(
    tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    assert weights.latest_version(str(tmp_path / "nothing")) is None
    publish_weights(tmp_path, 2, 0.1)
    publish_weights(tmp_path, 10, 0.1)
    (tmp_path / "v00000011").mkdir()  # created but nothing written yet
    (tmp_path / "notes").mkdir()
    assert weights.latest_version(str(tmp_path)) == 10
    assert weights.latest_version(f"file://{tmp_path}") == 10
    path, temporary = weights.fetch_weights(str(tmp_path), 2)
    assert (path, temporary) == (tmp_path / "v00000002", False)
    with pytest.raises(FileNotFoundError, match="v00000003"):
        weights.fetch_weights(str(tmp_path), 3)


def test_storage_registry_layout(
    tmp_path: Path, tiny_model_dir: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    """What the trainer does: WeightRegistry.publish, then hands us store.uri("weights")."""
    from posttrain.storage.checkpoints import WeightRegistry
    from posttrain.storage.store import open_store

    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=5)
    staging = tmp_path / "staging"
    for version in (1, 2):
        publish_weights(staging, version, 0.2)
        registry.publish(version, staging / weights.version_dir_name(version))
    uri = store.uri("weights")
    assert uri.startswith("file://")
    # An upload in progress (files, no manifest yet) must not be picked up.
    in_flight = tmp_path / "run" / "weights" / "v00000003"
    in_flight.mkdir()
    (in_flight / "model.safetensors").write_bytes(b"partial")
    assert weights.latest_version(uri) == 2

    # The s3 code path (registry fetch with manifest verification), on a file:// store.
    fetched = weights._fetch_s3(uri, 2, tmp_path)
    try:
        expected = load_file(str(staging / "v00000002" / "model.safetensors"))
        got = load_file(str(fetched / "model.safetensors"))
        assert expected.keys() == got.keys()
        assert all((expected[k] == got[k]).all() for k in expected)
    finally:
        import shutil

        shutil.rmtree(fetched)

    server = ServerThread(
        ServerConfig(model=str(tiny_model_dir), weights_uri=uri, num_threads=1)
    ).start()
    try:
        assert server.state.engine.weight_version == 2
    finally:
        server.stop()


def _damage(path: Path) -> None:
    """Flip one byte in the middle of a committed file (its digest no longer matches)."""
    with path.open("r+b") as handle:
        handle.seek(path.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_a_replica_joins_at_the_newest_version_that_verifies(
    tmp_path: Path, tiny_model_dir: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    """Pull on join when the latest committed version fails its digest: the replica serves
    the newest one that verifies and names the refused one in /health; with none that
    verifies it serves the base model (v0). The poll does not retry a refused version."""
    import httpx

    from posttrain.storage.checkpoints import WeightRegistry
    from posttrain.storage.store import open_store

    store = open_store(str(tmp_path / "run"))
    registry = WeightRegistry(store, "weights", keep_last=5)
    staging = tmp_path / "staging"
    for version in (1, 2):
        publish_weights(staging, version, 0.2)
        registry.publish(version, staging / weights.version_dir_name(version))
    uri = store.uri("weights")
    _damage(tmp_path / "run" / "weights" / "v00000002" / "model.safetensors")
    assert weights.latest_version(uri) == 2  # committed, but no longer what was committed

    server = ServerThread(
        ServerConfig(model=str(tiny_model_dir), weights_uri=uri, num_threads=1, poll_seconds=0.2)
    ).start()
    try:
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health["weight_version"] == 1 and health["refused_versions"] == [2]
        assert "digest" in server.state.refused[2]
        refused_before = dict(server.state.refused)
        time.sleep(1.0)  # several polls: v2 is not fetched again, v1 keeps serving
        assert server.state.engine.weight_version == 1
        assert server.state.refused == refused_before
    finally:
        server.stop()

    _damage(tmp_path / "run" / "weights" / "v00000001" / "model.safetensors")
    server = ServerThread(
        ServerConfig(model=str(tiny_model_dir), weights_uri=uri, num_threads=1)
    ).start()
    try:
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        assert health["weight_version"] == 0 and health["refused_versions"] == [1, 2]
    finally:
        server.stop()
