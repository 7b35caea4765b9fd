"""The trainer's side of a direct weight transfer (rollout/weight_transfer.py) on CPU: the
buckets a replica maps in another process hold exactly the trainer's tensors, in bounded
memory, and a handle cannot make a replica map anything but a staging file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.rollout.weight_transfer import (
    STAGING_PREFIX,
    Bucket,
    BucketStream,
    StagingBuffer,
    map_shared_buffer,
    unpack,
)


def _state_dict() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes and odd sizes, so buckets break on alignment as well as on size."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(300, 64, generator=generator)),  # 76.8 kB fp32
        ("norm.weight", torch.randn(7, generator=generator).to(torch.bfloat16)),  # 14 B
        ("layers.0.q.weight", torch.randn(64, 64, generator=generator)),  # misaligned after 14 B
        ("layers.0.k.weight", torch.randn(64, 64, generator=generator).to(torch.bfloat16)),
        ("layers.0.bias", torch.arange(5, dtype=torch.int64)),
        ("lm.scale", torch.tensor(1.5, dtype=torch.float16)),  # 0-d
    ]


def _staging_files() -> set[str]:
    roots = [Path("/dev/shm"), Path(os.environ.get("TMPDIR", "/tmp"))]
    return {str(p) for r in roots if r.is_dir() for p in r.glob(STAGING_PREFIX + "*")}


def _bucket(info: dict[str, object]) -> Bucket:
    return Bucket(*(info[k] for k in ("names", "dtype_names", "shapes", "tensor_sizes")))  # type: ignore[arg-type]


def test_every_bucket_read_back_through_its_handle_holds_the_trainers_bytes() -> None:
    tensors = _state_dict()
    before = _staging_files()
    stream = BucketStream(bucket_bytes=20_000)
    received: dict[str, torch.Tensor] = {}
    in_use: set[str] = set()
    for info in stream.updates(tensors):
        json.dumps(info)  # the update travels as JSON
        (handle,) = info["ipc_handles"].values()
        in_use.add(handle[1])
        # What the replica does: map the file by its handle, take views, copy them out
        # before the trainer reuses the buffer.
        mapped = map_shared_buffer(handle)
        for name, view in unpack(mapped, _bucket(info)):
            received[name] = view.clone()
    assert stream.buckets >= 4  # size and alignment both split
    assert list(received) == [name for name, _ in tensors]
    for name, tensor in tensors:
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        got = received[name].reshape(-1).view(torch.uint8)
        assert torch.equal(got, tensor.reshape(-1).view(torch.uint8)), name  # bit for bit
    # Bounded memory: two staging files, reused; the biggest tensor (76.8 kB > 20 kB) grew one.
    assert len(in_use) == 2
    largest = max(t.numel() * t.element_size() for _, t in tensors)
    assert stream.staged_bytes <= 20_000 + largest
    assert stream.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    stream.close()
    assert _staging_files() == before  # nothing left in /dev/shm


def test_a_bucket_is_visible_to_another_process_through_its_handle(tmp_path: Path) -> None:
    """The replica is another process: it maps the trainer's file, not a copy."""
    tensor = torch.arange(1000, dtype=torch.float32)
    stream = BucketStream(bucket_bytes=1 << 20)
    (info,) = list(stream.updates([("w", tensor)]))
    try:
        (tmp_path / "info.json").write_text(json.dumps(info))
        code = (
            "import json, sys, torch\n"
            "from posttrain.rollout.weight_transfer import map_shared_buffer, unpack, Bucket\n"
            "info = json.load(open(sys.argv[1]))\n"
            "bucket = Bucket(info['names'], info['dtype_names'], info['shapes'], info['tensor_sizes'])\n"
            "(name, t), = unpack(map_shared_buffer(info['ipc_handles']['cpu']), bucket)\n"
            "print(name, float(t.double().sum()))\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "info.json")],
                             capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
        assert out.stdout.split() == ["w", str(float(tensor.double().sum()))]
    finally:
        stream.close()


def test_a_handle_cannot_make_a_replica_map_another_file(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 64)
    with pytest.raises(ValueError, match="refusing to map"):
        map_shared_buffer(["shm", str(secret), 64])
    buffer = StagingBuffer(64)
    assert buffer.path is not None
    staged = buffer.path
    # A staging-looking name that links elsewhere resolves to the real file: refused.
    link = staged.with_name(f"{STAGING_PREFIX}link-test-{os.getpid()}")
    link.symlink_to(secret)
    try:
        with pytest.raises(ValueError, match="refusing to map"):
            map_shared_buffer(["shm", str(link), 64])
        with pytest.raises(ValueError, match="refusing to map"):
            map_shared_buffer(["nccl", str(staged), 64])
        assert map_shared_buffer(["shm", str(staged), 64]).numel() == 64
    finally:
        link.unlink()
        buffer.close()
    assert not staged.exists()
