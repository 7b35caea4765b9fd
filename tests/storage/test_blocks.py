"""Part of a committed file, fetched by ranges and verified by blocks (LocalStore and MinIO)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.storage.blocks import BlockIndex, PartialFile, index_path, write_block_index
from posttrain.storage.commit import download_dir, upload_dir
from posttrain.storage.errors import CorruptArtifactError
from posttrain.storage.progress import TransferProgress
from posttrain.storage.store import ArtifactStore

BLOCK = 64 * 1024


def commit_sharded(tmp_path: Path, store: ArtifactStore, prefix: str) -> bytes:
    """A committed directory with one 5.5-block data file, its block index and a small file."""
    local = tmp_path / "written"
    local.mkdir()
    data = os.urandom(5 * BLOCK + BLOCK // 2)
    (local / "shard.bin").write_bytes(data)
    write_block_index(local / "shard.bin", BLOCK)
    (local / "meta.json").write_text("{}")
    upload_dir(store, prefix, local)
    return data


def test_a_reader_fetches_and_verifies_only_the_blocks_it_reads(
    store: ArtifactStore, tmp_path: Path
) -> None:
    data = commit_sharded(tmp_path, store, "ckpt/step-1")
    dest = tmp_path / "read"
    download_dir(store, "ckpt/step-1", dest, include=lambda p: p != "shard.bin")
    assert not (dest / "shard.bin").exists()  # left in the store
    assert (dest / "meta.json").is_file() and index_path(dest / "shard.bin").is_file()

    index = BlockIndex.read(index_path(dest / "shard.bin"))
    assert index.size == len(data) and len(index.digests) == 6
    part = PartialFile(store, "ckpt/step-1/shard.bin", dest / "shard.bin", index)
    # bytes straddling blocks 1 and 2, and the short last block
    wanted = [(BLOCK + 10, BLOCK), (5 * BLOCK + 7, 100)]
    assert part.missing(wanted) == [1, 2, 5]
    assert part.missing_bytes(wanted) == 2 * BLOCK + BLOCK // 2
    progress = TransferProgress("test", part.missing_bytes(wanted))
    fetched = part.ensure(wanted, progress)
    assert fetched == progress.done_bytes == 2 * BLOCK + BLOCK // 2
    assert part.missing(wanted) == []
    local = (dest / "shard.bin").read_bytes()
    assert len(local) == len(data)
    for start, end in ((BLOCK, 3 * BLOCK), (5 * BLOCK, len(data))):
        assert local[start:end] == data[start:end]
    assert local[:BLOCK] == bytes(BLOCK)  # never fetched
    assert part.ensure([(BLOCK + 20, 5)]) == 0  # already here: no second GET


def test_a_damaged_block_is_refused_before_use(store: ArtifactStore, tmp_path: Path) -> None:
    data = commit_sharded(tmp_path, store, "ckpt/step-1")
    dest = tmp_path / "read"
    download_dir(store, "ckpt/step-1", dest, include=lambda p: p != "shard.bin")
    damaged = bytearray(data)
    damaged[3 * BLOCK + 5] ^= 0xFF  # one bit flip in block 3, same size
    store.put_bytes("ckpt/step-1/shard.bin", bytes(damaged))
    index = BlockIndex.read(index_path(dest / "shard.bin"))
    part = PartialFile(store, "ckpt/step-1/shard.bin", dest / "shard.bin", index)
    assert part.ensure([(0, 10)]) == BLOCK  # undamaged blocks still read
    with pytest.raises(CorruptArtifactError, match=r"block 3 .* fails its xxh3-128 checksum"):
        part.ensure([(2 * BLOCK, 2 * BLOCK)])
    assert 3 not in part.have


def test_a_truncated_file_is_refused(store: ArtifactStore, tmp_path: Path) -> None:
    data = commit_sharded(tmp_path, store, "ckpt/step-1")
    dest = tmp_path / "read"
    download_dir(store, "ckpt/step-1", dest, include=lambda p: p != "shard.bin")
    store.put_bytes("ckpt/step-1/shard.bin", data[: 4 * BLOCK])
    index = BlockIndex.read(index_path(dest / "shard.bin"))
    part = PartialFile(store, "ckpt/step-1/shard.bin", dest / "shard.bin", index)
    with pytest.raises(CorruptArtifactError, match=r"block 5 .* got 0 bytes"):
        part.ensure([(5 * BLOCK, 1)])


def test_a_file_left_in_the_store_must_still_exist(store: ArtifactStore, tmp_path: Path) -> None:
    commit_sharded(tmp_path, store, "ckpt/step-1")
    store.delete("ckpt/step-1/shard.bin")
    with pytest.raises(
        CorruptArtifactError, match=r"shard\.bin is listed in the manifest but missing"
    ):
        download_dir(store, "ckpt/step-1", tmp_path / "read", include=lambda p: p != "shard.bin")
