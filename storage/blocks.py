"""Block digests: fetch and verify *part* of a large committed file.

A manifest verifies whole files, so a reader that needs a few slices of a large file (one
rank's shards of a checkpoint written by many ranks) would still have to download all of it
to trust any of it. Next to such a file the writer stores ``<file>.blocks``: the checksum of
every fixed-size block. The index is an ordinary file of the committed directory (the
manifest verifies it), so a reader can fetch only the blocks that cover the byte ranges it
needs, with one ranged GET per run of consecutive blocks, and verify each block before any
byte of it is used. Bytes outside the fetched blocks are never read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from posttrain.storage.checksums import DEFAULT_CHECKSUM, checksum
from posttrain.storage.errors import CorruptArtifactError
from posttrain.storage.progress import TransferProgress
from posttrain.storage.store import ArtifactStore

INDEX_SUFFIX = ".blocks"
INDEX_FORMAT = "posttrain.blocks/v1"
DEFAULT_BLOCK_BYTES = 8 << 20  # 8 MiB: ~1,600 digests for a 13 GB shard, GETs of useful size
MAX_RUN_BLOCKS = 8  # one ranged GET holds at most this many blocks in memory


@dataclass(frozen=True)
class BlockIndex:
    """The checksums of a file's consecutive ``block_bytes`` blocks (the last may be short)."""

    size: int
    block_bytes: int
    algorithm: str
    digests: tuple[str, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": INDEX_FORMAT,
                "size": self.size,
                "block_bytes": self.block_bytes,
                "algorithm": self.algorithm,
                "digests": list(self.digests),
            }
        )

    @classmethod
    def read(cls, path: Path) -> BlockIndex:
        data = json.loads(path.read_text())
        if data.get("format") != INDEX_FORMAT:
            raise CorruptArtifactError(f"{path} is not a {INDEX_FORMAT} block index")
        index = cls(
            int(data["size"]), int(data["block_bytes"]), data["algorithm"], tuple(data["digests"])
        )
        if index.block_bytes < 1 or len(index.digests) != index.blocks_for(0, index.size).stop:
            raise CorruptArtifactError(f"{path} does not describe a file of {index.size} bytes")
        return index

    def blocks_for(self, offset: int, length: int) -> range:
        """Indices of the blocks that hold bytes ``[offset, offset + length)``.

        >>> BlockIndex(20, 8, "xxh3-128", ()).blocks_for(7, 2)
        range(0, 2)
        >>> BlockIndex(20, 8, "xxh3-128", ()).blocks_for(0, 20)
        range(0, 3)
        """
        if length <= 0:
            return range(0)
        return range(offset // self.block_bytes, (offset + length - 1) // self.block_bytes + 1)

    def span(self, block: int) -> tuple[int, int]:
        """(offset, length) of one block."""
        start = block * self.block_bytes
        return start, min(self.block_bytes, self.size - start)


def index_path(path: Path) -> Path:
    return path.with_name(path.name + INDEX_SUFFIX)


def write_block_index(
    path: Path, block_bytes: int = DEFAULT_BLOCK_BYTES, algorithm: str = DEFAULT_CHECKSUM
) -> Path:
    """Hash ``path`` block by block and write ``<path>.blocks`` beside it; returns that path."""
    digests = []
    with path.open("rb") as src:
        while chunk := src.read(block_bytes):
            digests.append(checksum(chunk, algorithm))
    size = path.stat().st_size
    target = index_path(path)
    target.write_text(BlockIndex(size, block_bytes, algorithm, tuple(digests)).to_json())
    return target


class PartialFile:
    """A local, sparse copy of one stored file that holds only the blocks fetched so far.

    Reads of the local file are valid inside :meth:`ensure`'d ranges only; everything else
    is zeros. Each block is verified against the index before it is written.
    """

    def __init__(self, store: ArtifactStore, key: str, local: Path, index: BlockIndex) -> None:
        self.store = store
        self.key = key
        self.local = local
        self.index = index
        self.have: set[int] = set()
        local.parent.mkdir(parents=True, exist_ok=True)
        with local.open("wb") as out:
            out.truncate(index.size)  # sparse: no disk used until blocks arrive

    def missing(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The blocks covering ``(offset, length)`` ranges that are not here yet, sorted."""
        wanted = {b for offset, length in ranges for b in self.index.blocks_for(offset, length)}
        return sorted(wanted - self.have)

    def missing_bytes(self, ranges: Iterable[tuple[int, int]]) -> int:
        return sum(self.index.span(block)[1] for block in self.missing(ranges))

    def ensure(
        self, ranges: Iterable[tuple[int, int]], progress: TransferProgress | None = None
    ) -> int:
        """Fetch and verify the blocks covering ``(offset, length)`` ranges; returns the
        number of bytes fetched by this call."""
        fetched = 0
        for first, last in _runs(self.missing(ranges)):
            start = self.index.span(first)[0]
            end_offset, end_length = self.index.span(last)
            data = self.store.get_range(self.key, start, end_offset + end_length - start)
            self._write_verified(first, last, start, data)
            fetched += len(data)
            if progress is not None:
                progress.update(len(data))
        return fetched

    def _write_verified(self, first: int, last: int, start: int, data: bytes) -> None:
        view = memoryview(data)
        fd = os.open(self.local, os.O_WRONLY)
        try:
            for block in range(first, last + 1):
                offset, length = self.index.span(block)
                piece = view[offset - start : offset - start + length]
                if (
                    len(piece) != length
                    or checksum(piece, self.index.algorithm) != self.index.digests[block]
                ):
                    raise CorruptArtifactError(
                        f"{self.store.uri(self.key)} block {block} (bytes {offset}+{length}) "
                        f"fails its {self.index.algorithm} checksum"
                        + ("" if len(piece) == length else f": got {len(piece)} bytes")
                    )
                os.pwrite(fd, piece, offset)
                self.have.add(block)
        finally:
            os.close(fd)


def _runs(blocks: list[int], longest: int = MAX_RUN_BLOCKS) -> list[tuple[int, int]]:
    """Sorted block indices as (first, last) runs of at most ``longest`` consecutive ones.

    >>> _runs([0, 1, 2, 5, 7, 8])
    [(0, 2), (5, 5), (7, 8)]
    >>> _runs([0, 1, 2, 3, 4], longest=2)
    [(0, 1), (2, 3), (4, 4)]
    """
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block - 1 and block - runs[-1][0] < longest:
            runs[-1] = (runs[-1][0], block)
        else:
            runs.append((block, block))
    return runs
