"""CheckpointManager and WeightRegistry on LocalStore and a real MinIO."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest

from posttrain.storage.checkpoints import (
    CheckpointManager,
    WeightRegistry,
    fetch_weights,
    publish_weights,
)
from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.store import ArtifactStore
from posttrain.telemetry import memory_exporter


def make_checkpoint(root: Path, step: int, size: int = 2 * 1024 * 1024) -> Path:
    """A small safetensors-like checkpoint whose bytes identify the step."""
    path = root / f"local-{step}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(step.to_bytes(4, "little") + os.urandom(size))
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


def loaded_step(dest: Path) -> int:
    return json.loads((dest / "trainer_state.json").read_text())["step"]


def test_save_then_load_latest(store: ArtifactStore, tmp_path: Path) -> None:
    manager = CheckpointManager(store, "runs/ns/a/checkpoints")
    assert manager.load_latest(tmp_path / "dest") is None
    assert manager.latest_step() is None
    for step in (4, 8, 12):
        manager.save(step, make_checkpoint(tmp_path, step), metadata={"loss": 0.1 * step})
    assert manager.list_steps() == [4, 8, 12]
    assert store.exists("runs/ns/a/checkpoints/step-00000012/manifest.json")
    pointer = json.loads(store.get_bytes("runs/ns/a/checkpoints/latest.json"))
    assert pointer["step"] == 12 and pointer["dir"] == "step-00000012"
    assert manager.latest_step() == 12

    step, manifest = manager.load_latest(tmp_path / "dest")  # type: ignore[misc]
    assert step == 12 and loaded_step(tmp_path / "dest") == 12
    assert manifest.metadata["loss"] == pytest.approx(1.2)
    assert manager.last_refused == []
    spans = [s for s in memory_exporter().get_finished_spans() if s.name == "checkpoint.load"]
    assert spans[-1].attributes["checkpoint.step"] == 12
    assert spans[-1].attributes["storage.bytes"] == manifest.total_bytes

    # A later load replaces dest entirely (no files from the previous load survive).
    (tmp_path / "dest" / "stray").write_text("x")
    manager.load(8, tmp_path / "dest")
    assert loaded_step(tmp_path / "dest") == 8 and not (tmp_path / "dest" / "stray").exists()


class ListCountingStore:
    """Delegates to a real store and counts listings (resolving latest must not list)."""

    def __init__(self, inner: ArtifactStore) -> None:
        self.inner = inner
        self.listings = 0

    def list(self, prefix: str = "") -> list[str]:
        self.listings += 1
        return self.inner.list(prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_resolving_latest_needs_no_listing(store: ArtifactStore, tmp_path: Path) -> None:
    CheckpointManager(store).save(5, make_checkpoint(tmp_path, 5, size=10))
    counting = ListCountingStore(store)
    manager = CheckpointManager(counting)  # type: ignore[arg-type]
    assert manager.load_latest(tmp_path / "dest")[0] == 5  # type: ignore[index]
    assert manager.latest_step() == 5
    assert counting.listings == 0


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_latest_is_refused_and_previous_used(
    store: ArtifactStore, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(store, "checkpoints")
    for step in (1, 2, 3):
        manager.save(step, make_checkpoint(tmp_path, step))
    key = "checkpoints/step-00000003/model.safetensors"
    data = store.get_bytes(key)
    damaged = data[:-1] + bytes([data[-1] ^ 0xFF])  # always differs from the original
    store.put_bytes(key, damaged if damage == "corrupt" else data[: len(data) // 3])

    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "old").write_text("from before")
    with caplog.at_level(logging.ERROR, logger="posttrain.storage.checkpoints"):
        step, _ = manager.load_latest(tmp_path / "dest")  # type: ignore[misc]
    assert step == 2 and loaded_step(tmp_path / "dest") == 2
    assert len(manager.last_refused) == 1
    reason = "fails its checksum" if damage == "corrupt" else "is truncated"
    assert "step-00000003/model.safetensors" in manager.last_refused[0]
    assert reason in manager.last_refused[0]
    assert "refusing checkpoint step 3" in caplog.text and reason in caplog.text
    # Only verified checkpoints reach dest; no staging directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_every_checkpoint_corrupt_raises(store: ArtifactStore, tmp_path: Path) -> None:
    manager = CheckpointManager(store, "checkpoints")
    for step in (1, 2):
        manager.save(step, make_checkpoint(tmp_path, step, size=10))
        store.put_bytes(f"checkpoints/step-{step:08d}/model.safetensors", b"garbage")
    with pytest.raises(CorruptArtifactError, match=r"no checkpoint under .* passes verification"):
        manager.load_latest(tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_interrupted_save_is_invisible_and_cleaned_up(store: ArtifactStore, tmp_path: Path) -> None:
    manager = CheckpointManager(store, "checkpoints")
    manager.save(1, make_checkpoint(tmp_path, 1))
    manager.save(2, make_checkpoint(tmp_path, 2))
    # Step 3's files landed but the process died before the manifest (and the pointer).
    partial = make_checkpoint(tmp_path, 3)
    store.put_file("checkpoints/step-00000003/model.safetensors", partial / "model.safetensors")
    assert manager.list_steps() == [1, 2]
    step, _ = manager.load_latest(tmp_path / "dest")  # type: ignore[misc]
    assert step == 2 and manager.last_refused == []
    # Even with the pointer gone, listing only finds committed steps.
    store.delete("checkpoints/latest.json")
    assert manager.load_latest(tmp_path / "dest")[0] == 2  # type: ignore[index]
    # After resuming from 2 the trainer saves 3 again; no leftovers from the first attempt.
    manager.save(3, make_checkpoint(tmp_path, 3, size=100))
    assert manager.load_latest(tmp_path / "dest")[0] == 3  # type: ignore[index]
    # A leftover older than the newest commit is garbage-collected on the next save.
    store.put_bytes("checkpoints/step-00000000/model.safetensors", b"orphan")
    manager.save(4, make_checkpoint(tmp_path, 4, size=100))
    assert store.list("checkpoints/step-00000000") == []


def test_bad_pointer_falls_back_to_listing(store: ArtifactStore, tmp_path: Path) -> None:
    manager = CheckpointManager(store, "checkpoints")
    for step in (5, 6):
        manager.save(step, make_checkpoint(tmp_path, step, size=100))
    store.put_bytes("checkpoints/latest.json", b"\x00not json")
    assert manager.load_latest(tmp_path / "dest")[0] == 6  # type: ignore[index]
    # A pointer at a directory that was removed behind our back.
    store.put_bytes("checkpoints/latest.json", json.dumps({"step": 99}).encode())
    assert manager.load_latest(tmp_path / "dest")[0] == 6  # type: ignore[index]
    assert "step-00000099" in manager.last_refused[0]
    # A manifest rewritten after the pointer recorded its digest is not trusted.
    manager.save(7, make_checkpoint(tmp_path, 7, size=100))
    manifest_key = "checkpoints/step-00000007/manifest.json"
    body = json.loads(store.get_bytes(manifest_key))
    body["metadata"]["step"] = 70
    store.put_bytes(manifest_key, json.dumps(body).encode())
    assert manager.load_latest(tmp_path / "dest")[0] == 6  # type: ignore[index]
    assert "does not match the sha256 recorded" in manager.last_refused[0]


def test_retention_keeps_last_k_plus_best(store: ArtifactStore, tmp_path: Path) -> None:
    manager = CheckpointManager(store, "checkpoints", keep_last=2)
    scores = {1: 0.2, 2: 0.9, 3: 0.4, 4: None, 5: 0.5, 6: 0.1}
    for step, score in scores.items():
        manager.save(step, make_checkpoint(tmp_path, step, size=10), eval_score=score)
    assert manager.list_steps() == [2, 5, 6]  # best (0.9) + newest two
    assert store.list("checkpoints/step-00000001") == []  # files are gone too, not just manifests
    # A fresh manager (a restarted trainer) reads scores back from the manifests.
    restarted = CheckpointManager(store, "checkpoints", keep_last=2)
    restarted.save(7, make_checkpoint(tmp_path, 7, size=10), eval_score=0.95)
    assert restarted.list_steps() == [6, 7]
    lower = CheckpointManager(store, "loss-ckpts", keep_last=1, higher_is_better=False)
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
        lower.save(step, make_checkpoint(tmp_path, step, size=10), eval_score=loss)
    assert lower.list_steps() == [2, 3]


def test_weights_publish_and_fetch(store: ArtifactStore, tmp_path: Path) -> None:
    registry = WeightRegistry(store, "runs/ns/a/weights", keep_last=2)
    assert registry.latest_version() is None
    with pytest.raises(ArtifactNotFoundError, match="no weights published"):
        registry.fetch("latest", tmp_path / "w")
    for version in (1, 2, 3):
        publish_weights(
            store,
            version,
            make_checkpoint(tmp_path, version, size=10),
            prefix="runs/ns/a/weights",
            metadata={"trainer_step": version * 10},
        )
    assert registry.latest_version() == 3
    assert registry.versions() == [1, 2, 3]  # publish_weights uses the default keep_last=3
    registry.publish(4, make_checkpoint(tmp_path, 4, size=10))
    assert registry.versions() == [3, 4]
    assert store.exists("runs/ns/a/weights/v00000004/manifest.json")
    version, manifest = fetch_weights(store, "latest", tmp_path / "w", prefix="runs/ns/a/weights")
    assert version == 4 and loaded_step(tmp_path / "w") == 4
    assert manifest.metadata["version"] == 4
    version, manifest = registry.fetch(3, tmp_path / "w3")
    assert manifest.metadata == {"trainer_step": 30, "version": 3}
    with pytest.raises(ArtifactNotFoundError):
        registry.fetch(1, tmp_path / "w1")


def test_checkpoint_saved_with_sha256_manifest_v1_still_resumes(
    store: ArtifactStore,
    tmp_path: Path,
    write_v1_directory: Callable[[ArtifactStore, str, dict[str, bytes]], None],
) -> None:
    """A run saved by an older posttrain (v1 manifests) resumes after an upgrade, and a
    newer checkpoint that fails verification falls back to the old v1 one."""
    state = {"model.safetensors": os.urandom(3 * 1024 * 1024), "trainer_state.json": b'{"step": 7}'}
    write_v1_directory(store, "checkpoints/step-00000007", state)
    manifest = store.get_bytes("checkpoints/step-00000007/manifest.json")
    pointer = {"step": 7, "dir": "step-00000007", "manifest_sha256": sha256(manifest).hexdigest()}
    store.put_bytes("checkpoints/latest.json", json.dumps(pointer).encode())

    manager = CheckpointManager(store, "checkpoints", keep_last=3)
    step, loaded = manager.load_latest(tmp_path / "dest")  # type: ignore[misc]
    assert step == 7 and loaded.format == "posttrain.manifest/v1"
    assert (tmp_path / "dest" / "model.safetensors").read_bytes() == state["model.safetensors"]

    new = manager.save(8, make_checkpoint(tmp_path, 8))
    assert new.format == "posttrain.manifest/v2"
    assert {f.algorithm for f in new.files} == {"xxh3-128"}
    key = "checkpoints/step-00000008/model.safetensors"
    data = store.get_bytes(key)
    store.put_bytes(key, data[:-1] + bytes([data[-1] ^ 0xFF]))
    step, loaded = manager.load_latest(tmp_path / "dest")  # type: ignore[misc]
    assert step == 7 and "fails its checksum: xxh3-128" in manager.last_refused[0]
    assert loaded_step(tmp_path / "dest") == 7


def test_weight_retention_never_breaks_a_delta_chain(store: ArtifactStore, tmp_path: Path) -> None:
    """keep_last counts versions, but a retained delta keeps every base down to its full
    version; deltas go with their base. What a version holds does not matter here."""
    registry = WeightRegistry(store, "weights", keep_last=2)

    def publish(version: int, base: int | None) -> None:
        meta = {"delta": {"base": base}} if base is not None else {}
        registry.publish(version, make_checkpoint(tmp_path, version, size=10), meta)

    def chains_intact() -> bool:
        kept = registry.versions()
        for version in kept:
            while (base := registry.delta_base(version)) is not None:
                if base not in kept:
                    return False
                version = base
        return True

    publish(1, None)
    for version in (2, 3, 4, 5):
        publish(version, version - 1)
        assert registry.versions() == list(range(1, version + 1)) and chains_intact()
    publish(6, None)  # a full version; v5 is still among the newest two, so is its chain
    assert registry.versions() == [1, 2, 3, 4, 5, 6] and chains_intact()
    publish(7, 6)
    assert registry.versions() == [6, 7] and chains_intact()  # v1-v5 gone with their base
    publish(8, 7)
    assert registry.versions() == [6, 7, 8] and chains_intact()
    # A fresh registry object (another process) reads the chain from the manifests.
    assert WeightRegistry(store, "weights", keep_last=1).retained(registry.versions(), 8) == {
        6,
        7,
        8,
    }
    with pytest.raises(ValueError, match="delta over v3, which is not published"):
        publish(9, 3)
    assert registry.latest_version() == 8
