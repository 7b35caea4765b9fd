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


def test_cuda_buckets_travel_as_vllms_own_ipc_update_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path up to CUDA itself: the same stream on a device buffer ("meta" stands in
    for "cuda"; only the CUDA IPC export is replaced, and the CUDA synchronize skipped)
    yields update infos that vLLM's own ``IPCWeightTransferUpdateInfo`` parses -- pickled
    handles keyed by GPU UUID, which its stock "ipc" engine rebuilds with
    ``rebuild_cuda_tensor`` -- and the CPU form parses the same way (posttrain_shm)."""
    import posttrain.rollout.weight_transfer as transfer
    from posttrain.rollout.vllm_local import vllm_python

    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM environment (make venv-vllm)")
    exported: list[tuple[str, int]] = []

    def fake_cuda_ipc_handle(tensor: torch.Tensor) -> dict[str, object]:
        exported.append((tensor.device.type, tensor.numel()))
        return {"GPU-00000000-test": ("rebuild", "args", tensor.numel())}

    monkeypatch.setattr(transfer, "cuda_ipc_handle", fake_cuda_ipc_handle)
    tensors = _state_dict()
    on_device = BucketStream(bucket_bytes=20_000, device="meta")
    device_infos = list(on_device.updates(tensors))
    on_cpu = BucketStream(bucket_bytes=20_000)
    cpu_infos = list(on_cpu.updates(tensors))
    on_cpu.close()
    on_device.close()
    assert exported and all(kind == "meta" for kind, _ in exported)
    assert [i["names"] for i in device_infos] == [i["names"] for i in cpu_infos]
    assert all("ipc_handles_pickled" in i and "ipc_handles" not in i for i in device_infos)

    (tmp_path / "infos.json").write_text(json.dumps(device_infos + cpu_infos))
    code = (
        "import json, os, sys\n"
        "os.environ['VLLM_ALLOW_INSECURE_SERIALIZATION'] = '1'\n"
        "from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo\n"
        "out = []\n"
        "for raw in json.load(open(sys.argv[1])):\n"
        "    info = IPCWeightTransferUpdateInfo(**raw)\n"
        "    out.append([info.names, sorted(info.ipc_handles), info.tensor_sizes])\n"
        "print(json.dumps(out))\n"
    )
    parsed = subprocess.run([str(python), "-c", code, str(tmp_path / "infos.json")],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert parsed.returncode == 0, parsed.stderr[-2000:]
    rows = json.loads(parsed.stdout.strip().splitlines()[-1])
    n = len(device_infos)
    assert [r[1] for r in rows[:n]] == [["GPU-00000000-test"]] * n
    assert [r[1] for r in rows[n:]] == [["cpu"]] * n
    assert [r[0] for r in rows[:n]] == [i["names"] for i in device_infos]
    assert [r[2] for r in rows[:n]] == [i["tensor_sizes"] for i in device_infos]


def test_the_stream_casts_floating_tensors_to_the_serving_dtype_while_packing() -> None:
    """What a replica reads is bit for bit ``tensor.to(serving dtype)``; integer tensors
    keep their dtype."""
    tensors = _state_dict()
    stream = BucketStream(bucket_bytes=20_000, dtype=torch.bfloat16)
    received: dict[str, torch.Tensor] = {}
    try:
        for info in stream.updates(tensors):
            mapped = map_shared_buffer(info["ipc_handles"]["cpu"])
            received.update((n, v.clone()) for n, v in unpack(mapped, _bucket(info)))
    finally:
        stream.close()
    for name, tensor in tensors:
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert received[name].dtype == expected.dtype, name
        assert torch.equal(received[name], expected), name
    assert stream.bytes == sum(
        t.numel() * (2 if t.is_floating_point() else t.element_size()) for _, t in tensors
    )
