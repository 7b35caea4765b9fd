"""Per-rank sharded loading: no rank ever holds the full model.

Loading a 70B model the plain way (``from_pretrained`` on every rank, then ``fully_shard``)
puts one full fp32 copy (280 GB) in host memory *per rank* before sharding frees it: eight
ranks on a node would need 2.2 TB of RAM. Instead, as torchtitan does:

1. :func:`build_empty` builds the model from its config with parameters on the ``meta``
   device (shapes only, no memory); buffers (rotary frequencies) are computed for real.
2. The caller adds LoRA adapters and applies ``fully_shard``: parameters become DTensors
   whose local shard is still ``meta``.
3. :func:`materialize` allocates each rank's local shards on its device (``to_empty``) and
   fills them from the safetensors files, reading **only this rank's slice** of each tensor
   (``safe_open(...).get_slice``: the rows of its ``Shard(0)`` piece), so a rank reads and
   holds ~1/world of the weights and no collective is needed. Adapters are initialised by
   :func:`init_adapters` from a seed and the parameter's name, so every rank (and a single
   process) derives the same full adapter and keeps its own slice.

Tested (tests/trainer/test_training_engine.py): two Gloo ranks load exactly the parameters one
process loads. Measured (bench/trainer_scale.py): peak host RSS per rank, this way and the old way.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def build_empty(model_dir: Path | str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The causal LM of ``model_dir``'s config: parameters on ``meta``, buffers computed.

    Tied input/output embeddings stay one parameter (as ``from_pretrained`` leaves them).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def checkpoint_name(parameter_name: str) -> str:
    """The safetensors key of a model parameter: wrappers (activation checkpointing, PEFT's
    ``base_layer``) removed.

    >>> checkpoint_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.base_layer.weight")
    'model.layers.0.mlp.up_proj.weight'
    """
    return parameter_name.replace("._checkpoint_wrapped_module", "").replace(".base_layer.", ".")


def local_slice(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The index of this rank's piece of a (possibly DTensor) parameter in the full tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class SafetensorsReader:
    """Slices of the tensors of an HF directory (one ``model.safetensors`` or an index of
    shards); each file is opened once, memory-mapped, and only the slices asked for are read."""

    def __init__(self, model_dir: Path | str) -> None:
        self.dir = Path(model_dir)
        index = self.dir / SAFETENSORS_INDEX
        if index.exists():
            self.files: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SAFETENSORS).exists():
            from safetensors import safe_open

            with safe_open(str(self.dir / SAFETENSORS), framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), SAFETENSORS)
        else:
            raise FileNotFoundError(
                f"{self.dir} has neither {SAFETENSORS} nor {SAFETENSORS_INDEX}; the trainer "
                "loads Hugging Face safetensors checkpoints"
            )
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``full_tensor[index]`` of ``name``, reading only that slice from disk."""
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(str(self.dir / file), framework="pt", device="cpu")
            )
        piece = self._handles[file].get_slice(name)
        return piece[index] if index else piece[:]


def _unique_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Named parameters, a tied one once (under its first name, the input embedding's)."""
    yield from model.named_parameters(remove_duplicate=True)


def adapter_seed(seed: int, name: str) -> int:
    """A per-adapter seed: the same on every rank and every world size.

    >>> adapter_seed(0, "a") == adapter_seed(0, "a") != adapter_seed(1, "a")
    True
    """
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """LoRA ``A`` as PEFT does (Kaiming-uniform, a=sqrt(5)) and ``B`` zero, from
    :func:`adapter_seed`; each rank keeps its slice of the same full tensor."""
    with torch.no_grad():
        for name, parameter in _unique_parameters(model):
            if ".lora_A." in name:
                full = torch.empty(parameter.shape, dtype=torch.float32)  # (r, in)
                generator = torch.Generator().manual_seed(adapter_seed(seed, checkpoint_name(name)))
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
                _local(parameter).copy_(full[local_slice(parameter)])
            elif ".lora_B." in name:
                _local(parameter).zero_()


def materialize(
    model: torch.nn.Module,
    model_dir: Path | str,
    device: torch.device,
    *,
    seed: int,
    root: torch.nn.Module | None = None,
    read_weights: bool = True,
) -> None:
    """Allocate ``model``'s (sharded) parameters on ``device`` and fill this rank's slices
    from ``model_dir``'s safetensors; adapters from :func:`init_adapters`.

    ``read_weights=False`` only allocates (values undefined) and sets the buffers: for a
    resume, whose DCP load fills every parameter next (DCP refuses a checkpoint that lacks
    one), so a rank need not download the HF weights at all.

    ``model`` is the already ``fully_shard``-ed module built by :func:`build_empty`; ``root``
    the outermost FSDP module around it, if another: ``to_empty`` must run from there, so
    every FSDP module's own ``_apply`` re-points its shards at the new storage (from ``model``
    alone, the root's parameters would be replaced behind FSDP's back). Raises ``KeyError``
    naming the parameters the checkpoint lacks.
    """
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    (root if root is not None else model).to_empty(device=device)
    if not read_weights:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        return
    with torch.no_grad(), SafetensorsReader(model_dir) as reader:
        missing = []
        for name, parameter in _unique_parameters(model):
            if ".lora_" in name:
                continue
            key = checkpoint_name(name)
            if key not in reader:
                missing.append(key)
                continue
            _local(parameter).copy_(reader.read(key, local_slice(parameter)))
        if missing:
            raise KeyError(
                f"{model_dir} lacks {len(missing)} weight(s) of its config's model: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            )
        for name, buffer in model.named_buffers():
            key = checkpoint_name(name)
            value = reader.read(key, ()) if key in reader else buffers[name]
            buffer.copy_(value)
    init_adapters(model, seed)
