"""A weight version streamed from object storage straight into the engine.

The registry path downloads a version to the replica's scratch disk, verifies it, then the
engine reads the file back: download and reload one after the other. Streamed, the bytes
of each ``*.safetensors`` file arrive in order (parallel ranged GETs, the store's bounded
read-ahead) and every tensor goes to the engine as soon as its bytes are in, so the
download and vLLM's reload overlap, and nothing is read back from disk.

What that gives up is *verify before touch*: the file's digest is known only after its
last byte, when the engine holds most of the version already. So a stream is only started
with a way back (docs/rollout.md, "Streamed loads"): the caller drains the replica first
and, when the stream fails (a digest, a truncated object, storage gone mid-way), reloads
the version it served from its own verified copy before anyone samples again. The bytes
are also written to the replica's held copy as they pass (the next delta version's base,
and the next stream's way back), renamed into place only once they verify.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO

import torch

log = logging.getLogger(__name__)

# safetensors' dtype names (the format's spec) as torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
# The safetensors reference implementation refuses headers above 100 MB; so do we, before
# allocating one from a damaged length prefix.
MAX_HEADER_BYTES = 100_000_000
PARTIAL_SUFFIX = ".partial"


@dataclass
class StreamStats:
    """What one streamed version cost: bytes read, tensors handed on, and the seconds the
    consumer spent waiting for bytes (the rest of a streamed load is the engine's own)."""

    bytes: int = 0
    tensors: int = 0
    wait_s: float = 0.0
    files: list[str] = field(default_factory=list)


class _Reader:
    """Exact-size reads over a chunk iterator, hashing and (optionally) copying every byte
    that passes, in order."""

    def __init__(
        self, chunks: Iterable[bytes], hasher: Any, tee: BinaryIO | None, stats: StreamStats
    ) -> None:
        self._chunks = iter(chunks)
        self._hasher = hasher
        self._tee = tee
        self._stats = stats
        self._current = memoryview(b"")
        self.position = 0

    def _next_chunk(self) -> bool:
        started = time.perf_counter()
        chunk = next(self._chunks, None)
        self._stats.wait_s += time.perf_counter() - started
        if chunk is None:
            return False
        self._hasher.update(chunk)
        if self._tee is not None:
            self._tee.write(chunk)
        self._stats.bytes += len(chunk)
        self._current = memoryview(chunk)
        return True

    def readinto(self, out: memoryview, where: str) -> None:
        """Fill ``out`` entirely; CorruptArtifactError when the object ends first."""
        from posttrain.storage.errors import CorruptArtifactError

        filled = 0
        while filled < len(out):
            if not self._current and not self._next_chunk():
                raise CorruptArtifactError(
                    f"{where} ends after {self.position + filled} bytes, inside its data"
                )
            n = min(len(self._current), len(out) - filled)
            out[filled : filled + n] = self._current[:n]
            self._current = self._current[n:]
            filled += n
        self.position += filled

    def skip(self, count: int, where: str) -> None:
        if count > 0:
            self.readinto(memoryview(bytearray(count)), where)

    def drain(self) -> None:
        """Read (and hash) whatever follows the last tensor."""
        self.position += len(self._current)
        self._current = memoryview(b"")
        while self._next_chunk():
            self.position += len(self._current)
            self._current = memoryview(b"")


def stream_safetensors(
    chunks: Iterable[bytes],
    *,
    size: int,
    digest: str,
    algorithm: str,
    where: str,
    tee: BinaryIO | None = None,
    stats: StreamStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of one safetensors file in the order its bytes arrive, each a
    fresh tensor as soon as its bytes are in; after the last one the file's ``size`` and
    ``digest`` are checked (CorruptArtifactError naming ``where`` if either differs, or if
    the header is damaged). Tensors already yielded then came from a damaged file: the
    caller must be able to undo what it did with them.
    """
    from posttrain.storage.checksums import new_hasher
    from posttrain.storage.errors import CorruptArtifactError

    stats = stats if stats is not None else StreamStats()
    hasher = new_hasher(algorithm)
    reader = _Reader(chunks, hasher, tee, stats)
    prefix = bytearray(8)
    reader.readinto(memoryview(prefix), where)
    header_len = int.from_bytes(prefix, "little")
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise CorruptArtifactError(f"{where} has a damaged safetensors header ({header_len} bytes)")
    raw = bytearray(header_len)
    reader.readinto(memoryview(raw), where)
    data_start = 8 + header_len
    for name, dtype, shape, begin, end in _layout(raw, where, size - data_start):
        reader.skip(data_start + begin - reader.position, where)
        tensor = torch.empty(end - begin, dtype=torch.uint8)
        reader.readinto(memoryview(tensor.numpy()).cast("B"), where)  # type: ignore[arg-type]
        stats.tensors += 1
        yield name, tensor.view(dtype).reshape(shape)
    reader.drain()
    if reader.position != size:
        raise CorruptArtifactError(
            f"{where} is truncated or padded: {reader.position} bytes, manifest says {size}"
        )
    if hasher.hexdigest() != digest:
        raise CorruptArtifactError(
            f"{where} fails its checksum: {algorithm} {hasher.hexdigest()[:16]}..., manifest "
            f"says {digest[:16]}...; the version is refused"
        )


def _layout(
    raw: bytearray, where: str, data_size: int
) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """The header's tensors in file order, each checked against its dtype and shape and
    against the data that follows, so a damaged header fails before any tensor is built.

    >>> header = b'{"b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},'
    >>> header += b' "a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}'
    >>> [(n, str(d), s, b, e) for n, d, s, b, e in _layout(bytearray(header), "f", 12)]
    [('a', 'torch.bfloat16', [2], 0, 4), ('b', 'torch.float32', [2], 4, 12)]
    """
    from posttrain.storage.errors import CorruptArtifactError

    try:
        header = json.loads(bytes(raw))
        entries = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
            numel = 1
            for n in shape:
                numel *= n
            if end - begin != numel * dtype.itemsize or begin < 0 or end > data_size:
                raise ValueError(f"tensor {name}: offsets {begin}..{end} do not fit {shape}")
            entries.append((name, dtype, shape, begin, end))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptArtifactError(f"{where} has a damaged safetensors header: {exc}") from None
    entries.sort(key=lambda entry: entry[3])
    for previous, current in pairwise(entries):
        if current[3] < previous[4]:
            raise CorruptArtifactError(f"{where}: tensors {previous[0]} and {current[0]} overlap")
    return entries


def stream_version(
    uri: str, version: int, hold_dir: Path | None, stats: StreamStats
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a *full* registry version under ``uri`` (``s3://``), streamed and
    verified file by file against the version's manifest (see :func:`stream_safetensors`).

    With ``hold_dir`` each file's bytes are also written there as they pass and renamed to
    the file's own name once it verifies: on success ``hold_dir`` holds the version as
    published (a replica's held copy); a file that failed leaves only its partial copy,
    which the caller removes with the directory.
    """
    from posttrain.rollout.weights import delta_base, registry_for
    from posttrain.storage.commit import read_manifest
    from posttrain.storage.errors import ArtifactNotFoundError
    from posttrain.storage.store import join_key

    registry = registry_for(uri)
    prefix = registry.version_key(version)
    manifest = read_manifest(registry.store, prefix)
    if manifest is None:
        raise ArtifactNotFoundError(f"{uri} has no committed weights v{version}")
    if delta_base(dict(manifest.metadata)) is not None:
        raise ValueError(f"{uri} v{version} is a delta version: it is rebuilt, not streamed")
    files = sorted(
        (e for e in manifest.files if e.path.endswith(".safetensors")), key=lambda e: e.path
    )
    if not files:
        raise ArtifactNotFoundError(f"{uri} v{version} holds no *.safetensors")
    for entry in files:
        where = f"{uri}/{prefix.rsplit('/', 1)[-1]}/{entry.path}"
        chunks = registry.store.stream(join_key(prefix, entry.path))
        partial = None if hold_dir is None else hold_dir / (entry.path + PARTIAL_SUFFIX)
        if partial is not None:
            partial.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") if partial is not None else nullcontext() as tee:
            try:
                yield from stream_safetensors(
                    chunks, size=entry.size, digest=entry.digest, algorithm=entry.algorithm,
                    where=where, tee=tee, stats=stats,
                )  # fmt: skip
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()  # stops the read-ahead when the consumer stopped early
        if partial is not None:
            os.replace(partial, partial.with_name(Path(entry.path).name))
        stats.files.append(entry.path)
