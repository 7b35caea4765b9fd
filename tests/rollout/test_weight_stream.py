"""Streaming a weight version out of storage tensor by tensor (rollout/weight_stream.py):
what the vLLM worker hands its reload while the bytes arrive. The vLLM side (the reload,
and the rollback when a stream fails) is tested against real vLLM in test_vllm_cpu.py."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from posttrain.devenv.minio import MinioServer
from posttrain.rollout.weight_stream import StreamStats, stream_safetensors, stream_version
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.checksums import checksum
from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.store import LocalStore, S3Store


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.weight": torch.randn(64, 48, generator=generator).bfloat16(),
        "model.layers.0.norm.weight": torch.randn(48, generator=generator),
        "model.embed.weight": torch.randn(100, 16, generator=generator).half(),
        "counter": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset : offset + size]


def _stream(data: bytes, chunk: int, **kw: object) -> list[tuple[str, torch.Tensor]]:
    args = {"size": len(data), "digest": checksum(data), "algorithm": "xxh3-128", "where": "f"}
    return list(stream_safetensors(_chunks(data, chunk), **{**args, **kw}))  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_every_tensor_arrives_bit_for_bit_whatever_the_chunking(chunk: int) -> None:
    tensors = _tensors()
    data = save(tensors, metadata={"format": "pt"})
    tee = io.BytesIO()
    stats = StreamStats()
    got = _stream(data, chunk, tee=tee, stats=stats)
    assert sorted(name for name, _ in got) == sorted(tensors)
    for name, tensor in got:
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape
        assert torch.equal(tensor, tensors[name]), name
    assert tee.getvalue() == data  # the held copy is the file as published
    assert (stats.bytes, stats.tensors) == (len(data), len(tensors))


def test_tensors_come_in_file_order_so_layers_complete_one_after_another() -> None:
    data = save(_tensors())
    offsets = [name for name, _ in _stream(data, 1 << 20)]
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    header.pop("__metadata__", None)
    assert offsets == sorted(header, key=lambda n: header[n]["data_offsets"][0])


def test_a_damaged_byte_is_caught_by_the_digest_after_the_last_tensor() -> None:
    data = bytearray(save(_tensors()))
    digest = checksum(bytes(data))
    data[-3] ^= 0xFF  # inside the last tensor's data: every tensor still parses
    stream = stream_safetensors(
        _chunks(bytes(data), 1000), size=len(data), digest=digest,
        algorithm="xxh3-128", where="s3://b/w/v00000002/model.safetensors",
    )  # fmt: skip
    handed = []
    with pytest.raises(CorruptArtifactError, match=r"v00000002/model.safetensors fails its"):
        for name, _ in stream:
            handed.append(name)
    assert len(handed) == len(_tensors())  # why a stream needs a way back (the caller's)


def test_a_truncated_object_fails_inside_its_data() -> None:
    data = save(_tensors())
    cut = data[: len(data) - 100]
    with pytest.raises(CorruptArtifactError, match="ends after"):
        list(stream_safetensors(_chunks(cut, 64), size=len(data), digest=checksum(data),
                                algorithm="xxh3-128", where="f"))  # fmt: skip


def test_a_padded_object_fails_on_its_size() -> None:
    data = save(_tensors())
    with pytest.raises(CorruptArtifactError, match="truncated or padded"):
        _stream(data + b"\0" * 10, 4096, size=len(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: (1 << 60).to_bytes(8, "little") + d[8:],  # a length prefix from nowhere
        lambda d: d[:8] + b"[" + d[9:],  # not a JSON object
        lambda d: d.replace(b'"BF16"', b'"Q99"', 1),  # an unknown dtype
        lambda d: d.replace(b'"shape":[64,48]', b'"shape":[64,49]', 1),  # offsets do not fit
    ],
    ids=["length", "json", "dtype", "shape"],
)
def test_a_damaged_header_fails_before_any_tensor(damage: object) -> None:
    data = damage(save(_tensors()))  # type: ignore[operator]
    stream = stream_safetensors(_chunks(data, 4096), size=len(data), digest="x",
                                algorithm="xxh3-128", where="f")  # fmt: skip
    with pytest.raises(CorruptArtifactError, match=r"damaged safetensors header|does not fit"):
        next(stream)


def _publish(registry: WeightRegistry, tmp_path: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    staging = tmp_path / f"staging-{version}"
    staging.mkdir()
    tensors = {k: v + version if v.is_floating_point() else v for k, v in _tensors().items()}
    save_file(tensors, str(staging / "model.safetensors"))
    registry.publish(version, staging, {"dtype": "bfloat16"})
    return tensors


def test_a_registry_version_streams_and_leaves_its_held_copy(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registry = WeightRegistry(store, "weights")
    expected = _publish(registry, tmp_path, 3)
    hold = tmp_path / "held"
    hold.mkdir()
    stats = StreamStats()
    got = dict(stream_version(store.uri("weights"), 3, hold, stats))
    assert all(torch.equal(got[k], expected[k]) for k in expected) and got.keys() == expected.keys()
    published = tmp_path / "store" / "weights" / "v00000003" / "model.safetensors"
    assert (hold / "model.safetensors").read_bytes() == published.read_bytes()
    assert stats.files == ["model.safetensors"] and not list(hold.glob("*.partial"))
    with pytest.raises(ArtifactNotFoundError, match="no committed weights v4"):
        list(stream_version(store.uri("weights"), 4, hold, StreamStats()))


def test_a_damaged_registry_file_leaves_only_a_partial_held_copy(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registry = WeightRegistry(store, "weights")
    _publish(registry, tmp_path, 1)
    published = tmp_path / "store" / "weights" / "v00000001" / "model.safetensors"
    data = bytearray(published.read_bytes())
    data[-1] ^= 0x01
    published.write_bytes(bytes(data))
    hold = tmp_path / "held"
    hold.mkdir()
    with pytest.raises(CorruptArtifactError, match="fails its checksum"):
        list(stream_version(store.uri("weights"), 1, hold, StreamStats()))
    assert [p.name for p in hold.iterdir()] == ["model.safetensors.partial"]


def test_a_delta_version_is_not_streamed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    registry = WeightRegistry(store, "weights")
    _publish(registry, tmp_path, 1)
    staging = tmp_path / "delta"
    staging.mkdir()
    (staging / "delta.safetensors").write_bytes(save({"x": torch.zeros(1)}))
    registry.publish(2, staging, {"delta": {"base": 1}})
    with pytest.raises(ValueError, match="delta version"):
        list(stream_version(store.uri("weights"), 2, None, StreamStats()))


def test_ranged_reads_from_minio_stream_in_order(minio_server: MinioServer) -> None:
    """Through a real MinIO with parallel ranged GETs (three streams of 64 KiB ranges): the
    store's bounded read-ahead hands the ranges back in order."""
    store = S3Store(
        minio_server.endpoint, "stream-test", "run", access_key=minio_server.access_key,
        secret_key=minio_server.secret_key, download_range_size=64 * 1024, download_streams=3,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    tensors = {f"layer.{i}": torch.randn(300, 100, generator=generator) for i in range(4)}
    data = save(tensors)  # ~480 KB: eight ranges
    store.put_bytes("weights/model.safetensors", data)
    stats = StreamStats()
    got = dict(stream_safetensors(store.stream("weights/model.safetensors"), size=len(data),
                                  digest=checksum(data), algorithm="xxh3-128", where="m",
                                  stats=stats))  # fmt: skip
    assert all(torch.equal(got[k], tensors[k]) for k in tensors) and stats.bytes == len(data)
    with pytest.raises(ArtifactNotFoundError):
        store.stream("weights/missing.safetensors")
