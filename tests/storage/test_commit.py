"""Committed directories: manifest written last, verified downloads, clear corruption errors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from posttrain.storage.commit import (
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    delete_dir,
    download_dir,
    read_manifest,
    upload_dir,
)
from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.store import ArtifactStore, Digest
from posttrain.telemetry import memory_exporter


class RecordingStore:
    """Delegates to a real store and records the order of writes (a spy, not a fake)."""

    def __init__(self, inner: ArtifactStore, fail_after_files: int | None = None) -> None:
        self.inner = inner
        self.writes: list[str] = []
        self.fail_after_files = fail_after_files

    def put_file(self, key: str, path: Any, **kwargs: Any) -> Digest:
        if self.fail_after_files is not None and len(self.writes) >= self.fail_after_files:
            raise KeyboardInterrupt("trainer killed mid-upload")
        digest = self.inner.put_file(key, path, **kwargs)
        self.writes.append(key)
        return digest

    def put_bytes(self, key: str, data: bytes) -> Digest:
        digest = self.inner.put_bytes(key, data)
        self.writes.append(key)
        return digest

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "model.safetensors": os.urandom(11 * 1024 * 1024 + 3),  # multipart on S3
        "config.json": b'{"hidden": 576}',
        "optimizer/state-0.bin": os.urandom(300_000),
        "empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def test_upload_writes_manifest_last_and_download_verifies(
    store: ArtifactStore, tmp_path: Path
) -> None:
    files = make_tree(tmp_path / "src")
    spy = RecordingStore(store)
    manifest = upload_dir(spy, "ckpt/step-1", tmp_path / "src", metadata={"step": 1})  # type: ignore[arg-type]
    assert spy.writes[-1] == "ckpt/step-1/manifest.json"
    assert len(spy.writes) == len(files) + 1
    assert {f.path for f in manifest.files} == set(files)
    assert manifest.total_bytes == sum(map(len, files.values()))
    assert manifest.metadata == {"step": 1} and manifest.created.endswith("Z")

    stored = json.loads(store.get_bytes("ckpt/step-1/manifest.json"))
    assert stored["format"] == "posttrain.manifest/v2"
    assert all(f["digest"].startswith("xxh3-128:") for f in stored["files"])
    assert {f["path"]: f["size"] for f in stored["files"]} == {k: len(v) for k, v in files.items()}

    fetched = download_dir(store, "ckpt/step-1", tmp_path / "dst")
    assert fetched == manifest
    for rel, data in files.items():
        assert (tmp_path / "dst" / rel).read_bytes() == data

    spans = [s for s in memory_exporter().get_finished_spans() if s.name == "storage.upload_dir"]
    assert spans and spans[-1].attributes["storage.files"] == len(files)


def test_interrupted_upload_is_invisible(store: ArtifactStore, tmp_path: Path) -> None:
    make_tree(tmp_path / "src")
    with pytest.raises(KeyboardInterrupt):
        upload_dir(
            RecordingStore(store, fail_after_files=2),
            "ckpt/step-2",  # type: ignore[arg-type]
            tmp_path / "src",
            file_workers=1,
        )
    assert store.list("ckpt/step-2/")  # some files did land...
    assert read_manifest(store, "ckpt/step-2") is None  # ...but nothing was committed
    with pytest.raises(ArtifactNotFoundError, match=r"no manifest\.json"):
        download_dir(store, "ckpt/step-2", tmp_path / "dst")


def test_reupload_uncommits_first_and_removes_stale_files(
    store: ArtifactStore, tmp_path: Path
) -> None:
    make_tree(tmp_path / "src")
    upload_dir(store, "w/v1", tmp_path / "src")
    (tmp_path / "src" / "optimizer" / "state-0.bin").unlink()
    spy = RecordingStore(store)
    upload_dir(spy, "w/v1", tmp_path / "src")  # type: ignore[arg-type]
    assert spy.writes[-1] == "w/v1/manifest.json"
    assert "w/v1/optimizer/state-0.bin" not in store.list("w/v1/")
    assert delete_dir(store, "w/v1") >= 4
    assert store.list("w/") == []


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        ("flip", r"model\.safetensors fails its checksum"),
        ("truncate", r"model\.safetensors is truncated or padded: \d+ bytes, manifest says \d+"),
        ("delete", r"model\.safetensors is listed in the manifest but missing"),
        ("manifest", r"manifest .*manifest\.json is unreadable"),
    ],
)
def test_damaged_directory_is_refused_naming_the_file(
    store: ArtifactStore, tmp_path: Path, damage: str, expected: str
) -> None:
    files = make_tree(tmp_path / "src")
    upload_dir(store, "ckpt/step-3", tmp_path / "src")
    key = "ckpt/step-3/model.safetensors"
    original = files["model.safetensors"]
    if damage == "flip":
        store.put_bytes(key, original[:1000] + bytes([original[1000] ^ 0xFF]) + original[1001:])
    elif damage == "truncate":
        store.put_bytes(key, original[: len(original) // 2])
    elif damage == "delete":
        store.delete(key)
    else:
        store.put_bytes(f"ckpt/step-3/{MANIFEST_NAME}", b'{"format": "posttrain.manifest/v1", "fi')
    with pytest.raises(CorruptArtifactError, match=expected):
        download_dir(store, "ckpt/step-3", tmp_path / "dst")
    # The bad file is not left behind looking like a good one.
    if damage in ("flip", "truncate"):
        assert not (tmp_path / "dst" / "model.safetensors").exists()


def test_bad_input_is_refused_before_any_upload(store: ArtifactStore, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "weights.bin").write_bytes(b"w")
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        upload_dir(store, "x", tmp_path / "src", metadata={"lr": object()})
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        upload_dir(store, "x", tmp_path / "src", algorithm="md5")
    (tmp_path / "src" / MANIFEST_NAME).write_text("{}")
    with pytest.raises(ValueError, match="reserved"):
        upload_dir(store, "x", tmp_path / "src")
    assert store.list("x/") == []


@pytest.mark.parametrize("damage", ["none", "flip", "truncate"])
def test_v1_sha256_directory_still_loads_and_is_verified(
    store: ArtifactStore,
    tmp_path: Path,
    damage: str,
    write_v1_directory: Callable[[ArtifactStore, str, dict[str, bytes]], None],
) -> None:
    files = make_tree(tmp_path / "src")
    write_v1_directory(store, "old/step-7", files)
    key = "old/step-7/model.safetensors"
    original = files["model.safetensors"]
    if damage == "flip":
        store.put_bytes(key, original[:-1] + bytes([original[-1] ^ 0x01]))
    elif damage == "truncate":
        store.put_bytes(key, original[:-1])
    if damage == "none":
        manifest = download_dir(store, "old/step-7", tmp_path / "dst")
        assert manifest.format == "posttrain.manifest/v1" and manifest.metadata == {"step": 7}
        assert {f.algorithm for f in manifest.files} == {"sha256"}
        for rel, data in files.items():
            assert (tmp_path / "dst" / rel).read_bytes() == data
        # Re-serialised, a v1 manifest is byte-identical (the pointer's digest still matches).
        assert manifest.to_json() == store.get_bytes(f"old/step-7/{MANIFEST_NAME}")
        return
    expected = (
        r"model\.safetensors fails its checksum: sha256"
        if damage == "flip"
        else r"model\.safetensors is truncated or padded"
    )
    with pytest.raises(CorruptArtifactError, match=expected):
        download_dir(store, "old/step-7", tmp_path / "dst")


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"format": "posttrain.manifest/v9"}, r"format is 'posttrain\.manifest/v9', expected"),
        ({"digest": "md5:" + "0" * 32}, r"unknown checksum algorithm 'md5'"),
        ({"digest": "xxh3-128:abc"}, r"'abc' is not a xxh3-128 digest \(32 hex digits\)"),
        ({"digest": "0" * 32}, r"unknown checksum algorithm"),  # no algorithm prefix
    ],
)
def test_malformed_manifest_v2_is_refused(entry: dict[str, str], expected: str) -> None:
    good = Manifest((ManifestFile("a.bin", 3, "ab" * 16),), {}, "2026-12-02T00:00:00Z")
    body = json.loads(good.to_json())
    if "format" in entry:
        body["format"] = entry["format"]
    else:
        body["files"][0]["digest"] = entry["digest"]
    with pytest.raises(CorruptArtifactError, match=r"manifest mem is unreadable \(.*" + expected):
        Manifest.from_json(json.dumps(body).encode(), "mem")
    assert Manifest.from_json(good.to_json(), "mem") == good
