"""Weights straight from the trainer's memory into vLLM's, in bounded buckets.

The producer half of vLLM's own weight-transfer API (``vllm.distributed.weight_transfer``,
its "ipc" backend in packed mode), written against torch alone so that the trainer, which
never imports vLLM, can speak it. One code path for both devices; only how a staging
buffer is shared differs:

* **CUDA** (trainer and replica on one GPU node): the buffer is a CUDA tensor, shared by a
  CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``), keyed by the GPU's
  UUID; the replica runs vLLM's stock ``ipc`` engine, which rebuilds the tensor with
  ``rebuild_cuda_tensor``.
* **CPU** (trainer and replica on one host): the buffer is a file in ``/dev/shm`` mapped by
  both, keyed ``cpu``; the replica runs :class:`posttrain.rollout.vllm_transfer.
  SharedMemoryWeightTransferEngine`, vLLM's ipc engine with that one call swapped.

Everything else -- the bucket plan, packing, the wire format (``names``, ``dtype_names``,
``shapes``, ``tensor_sizes``, ``ipc_handles``), vLLM's start / update / finish session with
its layerwise reload, the front door's drain and version flip -- is the same code. Memory
is bounded: at most two buckets of ``bucket_bytes`` are staged at a time (one being read by
the replicas while the next is packed), whatever the model's size.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SHARED_MEMORY_ROOT = Path("/dev/shm")
# Staging files are created under this prefix, and a replica maps only files under it: the
# handle a trainer sends cannot make a replica read anything else.
STAGING_PREFIX = "posttrain-transfer-"
CPU_DEVICE_KEY = "cpu"
DEFAULT_BUCKET_BYTES = 64 << 20  # 64 MiB: ~5 buckets for a 135M model in bf16


@dataclass
class Bucket:
    """One packed chunk: tensors back to back in a uint8 buffer (vLLM's packed layout)."""

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensor_sizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
        """Append ``tensor`` (packed as ``dtype``, default its own); returns its offset."""
        dtype = dtype or tensor.dtype
        offset = self.nbytes
        self.names.append(name)
        self.dtype_names.append(str(dtype).removeprefix("torch."))
        self.shapes.append(list(tensor.shape))
        self.tensor_sizes.append(tensor.numel() * dtype.itemsize)
        return offset

    def full_for(
        self, tensor: torch.Tensor, bucket_bytes: int, dtype: torch.dtype | None = None
    ) -> bool:
        """Whether ``tensor`` (packed as ``dtype``) must open the next bucket: it would not
        fit in ``bucket_bytes``, or its offset would not be a multiple of its element size
        (every view the replica takes must be aligned). An empty bucket takes anything.

        >>> bucket = Bucket()
        >>> bucket.add("a", torch.zeros(3, dtype=torch.bfloat16))
        0
        >>> bucket.full_for(torch.zeros(2), 64), bucket.full_for(torch.zeros(2), 64, torch.int16)
        (True, False)
        """
        itemsize = (dtype or tensor.dtype).itemsize
        return bool(self.names) and (
            self.nbytes + tensor.numel() * itemsize > bucket_bytes or self.nbytes % itemsize != 0
        )


def pack(buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> int:
    """Copy ``tensors`` back to back into the uint8 ``buffer``; returns the bytes used."""
    offset = 0
    for tensor in tensors:
        offset += pack_at(buffer, offset, tensor, tensor.dtype)
    return offset


def pack_at(buffer: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Copy ``tensor`` into the uint8 ``buffer`` at ``offset`` as ``dtype`` -- the cast and
    the copy in one pass, across devices, with no temporary -- returning the bytes used.

    >>> buffer = torch.zeros(8, dtype=torch.uint8)
    >>> pack_at(buffer, 2, torch.tensor([1.5, -2.0]), torch.bfloat16)
    4
    >>> buffer[2:6].view(torch.bfloat16).tolist()
    [1.5, -2.0]
    """
    size = tensor.numel() * dtype.itemsize
    target = buffer[offset : offset + size].view(dtype).view(tensor.shape)
    target.copy_(tensor.detach(), non_blocking=True)
    return size


def unpack(buffer: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors as views of ``buffer`` (what vLLM's ``unpack_tensor`` does).

    >>> tensors = [("a", torch.arange(4, dtype=torch.bfloat16)), ("b", torch.ones(2, 2))]
    >>> bucket = Bucket()
    >>> [bucket.add(name, tensor) for name, tensor in tensors]  # their offsets
    [0, 8]
    >>> buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    >>> pack(buffer, [t for _, t in tensors])
    24
    >>> [(n, t.tolist()) for n, t in unpack(buffer, bucket)]
    [('a', [0.0, 1.0, 2.0, 3.0]), ('b', [[1.0, 1.0], [1.0, 1.0]])]
    """
    views = buffer[: bucket.nbytes].split(bucket.tensor_sizes)
    return [
        (name, view.view(getattr(torch, dtype)).view(shape))
        for name, dtype, shape, view in zip(
            bucket.names, bucket.dtype_names, bucket.shapes, views, strict=True
        )
    ]


class StagingBuffer:
    """A uint8 buffer of ``nbytes`` on ``device`` that another process can map.

    CPU: a file under ``/dev/shm`` (``posttrain-transfer-*``) mapped shared; its handle is
    ``{"cpu": ["shm", path, nbytes]}``. CUDA: a device tensor; its handle is vLLM's,
    ``{gpu_uuid: rebuild_cuda_tensor args}``. Close it to release the memory.
    """

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.nbytes = nbytes
        self.path: Path | None = None
        if self.device.type == "cpu":
            root = SHARED_MEMORY_ROOT if SHARED_MEMORY_ROOT.is_dir() else None
            fd, name = tempfile.mkstemp(prefix=STAGING_PREFIX, dir=root)
            os.close(fd)
            self.path = Path(name)
            self.tensor = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
        else:
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def handle(self) -> dict[str, Any]:
        """The ``ipc_handles`` entry of vLLM's packed update info for this buffer."""
        if self.path is not None:
            return {CPU_DEVICE_KEY: ["shm", str(self.path), self.nbytes]}
        return cuda_ipc_handle(self.tensor)  # pragma: no cover - needs a GPU

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        self.tensor = torch.empty(0, dtype=torch.uint8)


def cuda_ipc_handle(tensor: torch.Tensor) -> dict[str, Any]:  # pragma: no cover - needs a GPU
    """``{gpu_uuid: args}`` for vLLM's ``rebuild_cuda_tensor`` (its IPC engine's format)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
    return {uuid: reduce_tensor(tensor)[1]}


def update_info(bucket: Bucket, handle: dict[str, Any]) -> dict[str, Any]:
    """vLLM's packed IPC update info (``IPCWeightTransferUpdateInfo``) as JSON: a CPU
    handle is JSON already; CUDA IPC handles travel pickled (``ipc_handles_pickled``, which
    the replica accepts only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

    >>> b = Bucket()
    >>> b.add("w", torch.zeros(2))
    0
    >>> update_info(b, {"cpu": ["shm", "/dev/shm/posttrain-transfer-x", 8]})["ipc_handles"]
    {'cpu': ['shm', '/dev/shm/posttrain-transfer-x', 8]}
    """
    info: dict[str, Any] = {
        "names": bucket.names,
        "dtype_names": bucket.dtype_names,
        "shapes": bucket.shapes,
        "tensor_sizes": bucket.tensor_sizes,
    }
    if CPU_DEVICE_KEY in handle:
        info["ipc_handles"] = handle
    else:  # pragma: no cover - needs a GPU
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handle)).decode()
    return info


def map_shared_buffer(handle: list[Any]) -> torch.Tensor:
    """The replica's view of a CPU staging buffer: ``["shm", path, nbytes]`` mapped
    shared. Refuses any path that is not a staging file (ValueError), so a handle cannot
    make a replica read other files.

    >>> map_shared_buffer(["shm", "/etc/passwd", 8])
    Traceback (most recent call last):
    ...
    ValueError: refusing to map /etc/passwd: not a posttrain-transfer-* file in /dev/shm or the temporary directory
    """
    kind, path, nbytes = handle
    resolved = Path(path).resolve()
    roots = {SHARED_MEMORY_ROOT.resolve(), Path(tempfile.gettempdir()).resolve()}
    if (
        kind != "shm"
        or resolved.parent not in roots
        or not resolved.name.startswith(STAGING_PREFIX)
    ):
        raise ValueError(
            f"refusing to map {path}: not a {STAGING_PREFIX}* file in /dev/shm or the "
            "temporary directory"
        )
    return torch.from_file(str(resolved), shared=True, size=int(nbytes), dtype=torch.uint8)


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Run a CPU copy on one intra-op thread. The copy is memory-bound: a second thread adds
    little bandwidth and, where the replicas load the previous bucket on the same cores,
    waits for its slowest thread (269 MB cast into staging buffers in-process at load ~2:
    0.08 s on one thread, 0.22-0.29 s on two)."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class BucketStream:
    """The trainer's side of a transfer: tensors in, one update info per bucket out.

    Single pass over the (gathered) tensors: each is packed into the current staging
    buffer until the next would not fit (or would sit misaligned), then that bucket's
    update info is yielded and packing moves to the other buffer. The caller sends each
    update and waits for every replica before asking for the next, so a buffer is
    reused only after the bucket in it was consumed; with two buffers, memory stays at
    two buckets (a tensor bigger than ``bucket_bytes`` grows a buffer to its size). The
    buffers outlive a transfer: the next one reuses them, already mapped and faulted in
    (fresh shared memory costs a page fault per 4 KiB, ~1 s per 270 MB measured on this
    machine); :meth:`close` frees them. ``bytes``, ``buckets`` and ``pack_seconds`` count
    the latest transfer.

    >>> stream = BucketStream(bucket_bytes=64)
    >>> updates = list(stream.updates([("a", torch.zeros(8)), ("b", torch.ones(8)),
    ...                                ("c", torch.ones(40)), ("d", torch.ones(2))]))
    >>> [(u["names"], u["tensor_sizes"]) for u in updates]
    [(['a', 'b'], [32, 32]), (['c'], [160]), (['d'], [8])]
    >>> stream.bytes, stream.staged_bytes  # the second buffer grew to fit "c"
    (232, 224)
    >>> stream.close()
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str = "cpu",
        buffers: int = 2,
        dtype: torch.dtype | None = None,
    ) -> None:
        if bucket_bytes < 1 or buffers < 1:
            raise ValueError(f"need bucket_bytes >= 1 and buffers >= 1, got {bucket_bytes}, "
                             f"{buffers}")  # fmt: skip
        self.bucket_bytes = bucket_bytes
        self.device = torch.device(device)
        self.dtype = dtype  # floating-point tensors are cast to it while packed (None: kept)
        self.buffers: list[StagingBuffer | None] = [None] * buffers
        self.bytes = 0  # tensor bytes streamed
        self.buckets = 0
        self.pack_seconds = 0.0  # copying into the staging buffers
        self.gather_seconds = 0.0  # producing the tensors (gather, cast); the rest is waiting

    @property
    def staged_bytes(self) -> int:
        """Memory held in staging buffers (the bound: ``buffers`` x the bucket size)."""
        return sum(b.nbytes for b in self.buffers if b is not None)

    def _buffer(self, index: int, nbytes: int) -> StagingBuffer:
        slot = index % len(self.buffers)
        buffer = self.buffers[slot]
        if buffer is None or buffer.nbytes < nbytes:
            if buffer is not None:
                buffer.close()
            buffer = self.buffers[slot] = StagingBuffer(max(nbytes, self.bucket_bytes),
                                                        self.device)  # fmt: skip
        return buffer

    def updates(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, Any]]:
        """Pack ``tensors`` as they come, one update info per full bucket. Each tensor is
        cast and copied into the staging buffer on arrival and can be freed at once, so
        nothing but the two buffers is held (a producer that casts into temporaries, or
        holds a bucket's tensors, faults in fresh memory every publish)."""
        self.bytes, self.buckets, self.pack_seconds, self.gather_seconds = 0, 0, 0.0, 0.0
        bucket, buffer = Bucket(), None
        source = iter(tensors)
        while True:
            mark = time.perf_counter()
            item = next(source, None)
            self.gather_seconds += time.perf_counter() - mark
            if item is None:
                break
            name, tensor = item
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else None
            if buffer is not None and bucket.full_for(tensor, self.bucket_bytes, dtype):
                yield self._finish(bucket, buffer)
                bucket, buffer = Bucket(), None
            mark = time.perf_counter()
            offset = bucket.add(name, tensor, dtype)
            if buffer is None:  # a bucket's first tensor: its buffer, grown to fit it
                buffer = self._buffer(self.buckets, bucket.nbytes)
            with one_thread(buffer.device):
                pack_at(buffer.tensor, offset, tensor, dtype or tensor.dtype)
            self.pack_seconds += time.perf_counter() - mark
        if buffer is not None:
            yield self._finish(bucket, buffer)

    def _finish(self, bucket: Bucket, buffer: StagingBuffer) -> dict[str, Any]:
        if buffer.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(buffer.device)
        self.buckets += 1
        self.bytes += bucket.nbytes
        return update_info(bucket, buffer.handle())

    def close(self) -> None:
        for buffer in self.buffers:
            if buffer is not None:
                buffer.close()
        self.buffers = [None] * len(self.buffers)
