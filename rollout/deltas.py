"""Delta weight versions: only the bits that changed since a base version.

At RL learning rates most published (bf16) weights are bit-identical from one step to the
next, and the ones that moved usually changed only low mantissa bits. Version ``N`` ships
as, per tensor that changed, ``base_bits XOR new_bits`` split into byte planes (all high
bytes, then all low bytes: the zeros line up) and zstd-compressed, one ``uint8`` tensor
``<name>::xor`` in ``delta.safetensors``. On the packaged SmolLM2-135M at the demo's learning
rate this is ~20x smaller than the full bf16 version, about twice what flat indices plus
values give (docs/benchmarks.md, "Weight deltas").

The version's manifest metadata (``delta``, see :func:`diff_state_dicts`) names the base
version and, for every tensor of the *result*, its dtype, shape and the sha256 of its bytes.
A replica applies the delta to the base it holds and checks every digest
(:func:`apply_delta`): it then holds exactly the bytes of the full version, or it refuses
the version (``CorruptArtifactError`` naming the tensor) and keeps serving what it had.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DELTA_FILE = "delta.safetensors"
DELTA_FORMAT = "xor-zstd-v1"
XOR_SUFFIX = "::xor"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ZSTD_LEVEL = 1  # level 3 compresses these planes no better, and 10% slower


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, its own dtype).

    >>> tensor_digest(torch.zeros(2, dtype=torch.bfloat16)) == hashlib.sha256(bytes(4)).hexdigest()
    True
    """
    flat = tensor.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def xor_bits(base: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``base``'s bits XOR ``new``'s, flat, as an integer tensor of the same width: zero
    where the element is bit-identical (so ``-0.0`` vs ``0.0`` counts as a change).

    >>> xor_bits(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([1.0, -0.0, 2.0])).ne(0).tolist()
    [False, True, False]
    """
    bits = _BITS[base.element_size()]
    return base.contiguous().reshape(-1).view(bits) ^ new.contiguous().reshape(-1).view(bits)


def pack_xor(xor: torch.Tensor) -> torch.Tensor:
    """``xor`` as zstd-compressed byte planes, a flat uint8 tensor (:func:`unpack_xor`)."""
    import zstandard

    planes = xor.view(torch.uint8).reshape(-1, xor.element_size()).t().contiguous()
    packed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(planes.numpy().tobytes())
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def unpack_xor(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The flat XOR tensor for ``like`` (a tensor of the base) from :func:`pack_xor`'s bytes;
    ValueError when they do not decompress to exactly its size.

    >>> t = torch.arange(6, dtype=torch.bfloat16)
    >>> torch.equal(unpack_xor(pack_xor(xor_bits(t, t + 1)), t), xor_bits(t, t + 1))
    True
    """
    import zstandard

    size = like.numel() * like.element_size()
    try:
        raw = zstandard.ZstdDecompressor().decompress(
            packed.numpy().tobytes(), max_output_size=size
        )
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta does not decompress: {exc}") from None
    if len(raw) != size:
        raise ValueError(f"delta decompresses to {len(raw)} bytes, the tensor has {size}")
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(like.element_size(), -1)
    return planes.t().contiguous().reshape(-1).view(_BITS[like.element_size()])


@dataclass(frozen=True)
class DeltaPlan:
    """The delta of ``new`` over ``base``, with what it weighs against a full version."""

    tensors: dict[str, torch.Tensor]  # what delta.safetensors holds: <name>::xor
    metadata: dict[str, Any]  # the manifest's "delta" entry
    changed: int  # elements whose bits changed
    elements: int  # elements in the version
    delta_bytes: int  # bytes of the delta's tensors (compressed)
    full_bytes: int  # bytes of the full version's tensors

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)


class SafetensorsDir(Mapping[str, torch.Tensor]):
    """The tensors of a directory's ``*.safetensors`` files, each read when asked for: a
    diff holds one tensor pair at a time, not two copies of the model."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Path] = {}
        self.elements = 0  # across all tensors, from the headers
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (not a dict)
                    self._files[name] = file
                    self.elements += math.prod(handle.get_slice(name).get_shape())
        if not self._files:
            raise FileNotFoundError(f"no *.safetensors files in {directory}")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def diff_state_dicts(
    base_version: int,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    max_changed_fraction: float = 1.0,
) -> DeltaPlan | None:
    """The delta taking ``base`` to ``new``; None when none can express it (tensors added,
    removed, reshaped or recast) or more than ``max_changed_fraction`` of the elements
    changed (fp32 weights under Adam: nearly all), found without compressing the rest:
    publish a full version.

    >>> base = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    >>> new = {"w": torch.tensor([0, 1, 0, 0], dtype=torch.bfloat16)}
    >>> plan = diff_state_dicts(3, base, new)
    >>> plan.changed, plan.metadata["base"], sorted(plan.tensors)
    (1, 3, ['w::xor'])
    >>> diff_state_dicts(3, base, {"w": torch.ones(4, dtype=torch.bfloat16)}, 0.5) is None
    True
    """
    if set(base) != set(new):
        return None
    total = getattr(new, "elements", None) or sum(t.numel() for t in new.values())
    budget = max_changed_fraction * total
    tensors: dict[str, torch.Tensor] = {}
    described: dict[str, dict[str, Any]] = {}
    changed = elements = delta_bytes = full_bytes = 0
    for name in sorted(new):
        old, now = base[name], new[name]
        if old.dtype != now.dtype or old.shape != now.shape:
            return None
        xor = xor_bits(old, now)
        moved = int(xor.count_nonzero())
        if moved:
            tensors[name + XOR_SUFFIX] = pack_xor(xor)
            delta_bytes += tensors[name + XOR_SUFFIX].numel()
        changed += moved
        if changed > budget:
            return None
        elements += now.numel()
        full_bytes += now.numel() * now.element_size()
        described[name] = {
            "dtype": str(now.dtype).removeprefix("torch."),
            "shape": list(now.shape),
            "sha256": tensor_digest(now),
        }
    metadata = {"base": base_version, "format": DELTA_FORMAT, "tensors": described}
    return DeltaPlan(tensors, metadata, changed, elements, delta_bytes, full_bytes)


def write_delta(plan: DeltaPlan, directory: Path) -> Path:
    """Write ``plan``'s tensors as ``directory/delta.safetensors`` (the directory the
    registry then commits with ``plan.metadata`` as the manifest's ``delta`` entry)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / DELTA_FILE
    save_file({k: v.contiguous() for k, v in plan.tensors.items()}, str(path))
    return path


def apply_delta(
    base: dict[str, torch.Tensor], delta_path: Path, metadata: dict[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """``base`` with the delta at ``delta_path`` applied, every tensor checked against the
    sha256 of the full version's bytes in ``metadata`` (the manifest's ``delta`` entry).

    Raises ``CorruptArtifactError`` naming ``where`` and the tensor on any mismatch: a
    base that is not the one the delta was made from, a damaged delta, a wrong digest.
    ``base`` is not modified.
    """
    from safetensors import safe_open

    from posttrain.storage.errors import CorruptArtifactError

    described = metadata.get("tensors")
    if not isinstance(described, dict) or set(described) != set(base):
        raise CorruptArtifactError(
            f"{where}: the delta describes tensors {sorted(described or {})[:3]}..., the "
            f"base holds {sorted(base)[:3]}...; it was not made from this base"
        )
    if metadata.get("format") != DELTA_FORMAT:
        raise CorruptArtifactError(
            f"{where}: delta format {metadata.get('format')!r} is not {DELTA_FORMAT!r} "
            "(written by a newer posttrain? upgrade this replica)"
        )
    result: dict[str, torch.Tensor] = {}
    with safe_open(str(delta_path), framework="pt") as handle:
        keys = set(handle.keys())
        if not keys <= {name + XOR_SUFFIX for name in described}:
            raise CorruptArtifactError(
                f"{where}: {DELTA_FILE} holds tensors its manifest does not describe: "
                f"{sorted(keys - {n + XOR_SUFFIX for n in described})[:3]}"
            )
        for name, tensor in base.items():  # the base's order: the full version's layout
            info = described[name]
            if str(tensor.dtype).removeprefix("torch.") != info.get("dtype") or list(
                tensor.shape
            ) != info.get("shape"):
                raise CorruptArtifactError(
                    f"{where}: tensor {name} is {tensor.dtype}{list(tensor.shape)} in the base, "
                    f"{info.get('dtype')}{info.get('shape')} in the delta"
                )
            if name + XOR_SUFFIX in keys:
                try:
                    xor = unpack_xor(handle.get_tensor(name + XOR_SUFFIX), tensor)
                except ValueError as exc:
                    raise CorruptArtifactError(f"{where}: tensor {name}: {exc}") from None
                bits = tensor.contiguous().reshape(-1).view(xor.dtype) ^ xor
                tensor = bits.view(tensor.dtype).reshape(tensor.shape)
            if tensor_digest(tensor) != info.get("sha256"):
                raise CorruptArtifactError(
                    f"{where}: tensor {name} after applying the delta does not match the "
                    "sha256 of the full version; refusing this version"
                )
            result[name] = tensor
    return result
