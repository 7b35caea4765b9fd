"""The training engine every model size runs on: device, precision, FSDP2 sharding, LR schedule.

One code path from a 135M model on one CPU process to 70B on GPU nodes; only the device and
the world size differ:

* **Device and backend come from one place** (:func:`plan_device`): CUDA ``cuda:<local rank>``
  with NCCL when the run asks for GPUs, otherwise the CPU with Gloo. A run that asks for GPUs
  where none is visible fails before any model is loaded, and :func:`check_placement` refuses
  a module whose tensors are not on the device the backend serves (NCCL with CPU tensors
  would otherwise fail at the first collective, or hang).
* **Sharding** (:func:`shard`) is torch's FSDP2: ``fully_shard`` on every decoder block, then
  on the root module (embeddings, final norm, LM head). Parameters, gradients and AdamW
  moments are split across ranks (each holds 1/world); a block's full weights exist only
  while it computes. Gradients are reduce-scattered and averaged by FSDP itself.
* **Mixed precision**: bf16 compute copies with fp32 sharded master weights and fp32
  gradient reduction on GPUs (``MixedPrecisionPolicy``); fp32 throughout on the CPU unless
  ``precision: bf16`` is asked for.
* **Memory is checked before loading** (:func:`check_fits`): the model's parameter count
  comes from its config on the meta device (no weights read), and a run whose per-rank
  training state cannot fit is refused with the estimate.

A single CPU process in fp32 skips FSDP (nothing to shard, and the plain module keeps the
fused AdamW kernel); everything else goes through the same ``fully_shard`` path.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.errors import UsageError

log = logging.getLogger(__name__)

GIB = 1024**3
# Share of a rank's memory the estimated training state may take; the rest is left for
# activations, the log-prob chunks, the allocator's fragmentation and the CUDA context.
MEMORY_HEADROOM = 0.9


@dataclass(frozen=True)
class DevicePlan:
    """Where this rank computes and which collective backend serves that device."""

    device: torch.device
    backend: str  # "nccl" for CUDA devices, "gloo" for the CPU

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def backend_for(device: torch.device) -> str:
    """The process-group backend for tensors on ``device``.

    >>> backend_for(torch.device("cpu")), backend_for(torch.device("cuda", 3))
    ('gloo', 'nccl')
    """
    return "nccl" if device.type == "cuda" else "gloo"


def plan_device(gpus_per_node: int, local_rank: int = 0) -> DevicePlan:
    """The device of local rank ``local_rank``: its own GPU when GPUs are asked for, else the CPU.

    Raises :class:`UsageError` when GPUs are asked for and none (or too few) are visible, so a
    misconfigured pod fails at once instead of training on the CPU for days.
    """
    if gpus_per_node <= 0:
        return DevicePlan(torch.device("cpu"), "gloo")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise UsageError(
            f"spec.resources.gpusPerNode is {gpus_per_node} but no CUDA GPU is visible to this "
            f"process (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}); schedule the trainer on a "
            "GPU node (nvidia.com/gpu resources, the NVIDIA device plugin) or set gpusPerNode: 0"
        )
    if local_rank >= visible:
        raise UsageError(
            f"local rank {local_rank} needs its own GPU but only {visible} are visible; "
            f"gpusPerNode ({gpus_per_node}) must not exceed the GPUs the pod gets"
        )
    device = torch.device("cuda", local_rank)
    return DevicePlan(device, backend_for(device))


def check_placement(module: torch.nn.Module, plan: DevicePlan) -> None:
    """Refuse a module with tensors off ``plan.device`` or a backend that cannot serve it.

    NCCL only moves CUDA tensors and Gloo's CUDA support is partial: a mismatch would fail
    deep inside the first collective (or hang the gang), so it is checked once, up front.
    """
    if backend_for(plan.device) != plan.backend:
        raise RuntimeError(
            f"backend {plan.backend!r} cannot serve {plan.device} tensors; use "
            f"{backend_for(plan.device)!r}"
        )
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if local.device.type != plan.device.type:
            raise RuntimeError(
                f"{name} is on {local.device} but this rank computes on {plan.device} with "
                f"{plan.backend}; every parameter must be moved before sharding"
            )


def compute_dtype(precision: str, plan: DevicePlan) -> torch.dtype:
    """Compute dtype for ``precision`` (auto | bf16 | fp32): auto is bf16 on GPUs, fp32 on CPU.

    >>> compute_dtype("auto", DevicePlan(torch.device("cpu"), "gloo"))
    torch.float32
    >>> compute_dtype("bf16", DevicePlan(torch.device("cpu"), "gloo"))
    torch.bfloat16
    """
    if precision == "auto":
        return torch.bfloat16 if plan.is_cuda else torch.float32
    if precision in ("bf16", "fp32"):
        return torch.bfloat16 if precision == "bf16" else torch.float32
    raise ValueError(f"unknown precision {precision!r}; use auto, bf16 or fp32")


def needs_sharding(world_size: int, plan: DevicePlan, dtype: torch.dtype) -> bool:
    """FSDP2 unless this is one CPU process in fp32 (nothing to shard, no master weights).

    >>> cpu = DevicePlan(torch.device("cpu"), "gloo")
    >>> needs_sharding(1, cpu, torch.float32), needs_sharding(2, cpu, torch.float32)
    (False, True)
    >>> needs_sharding(1, cpu, torch.bfloat16)  # bf16 compute keeps fp32 master weights
    True
    """
    return world_size > 1 or plan.is_cuda or dtype != torch.float32


def ensure_process_group(plan: DevicePlan) -> None:
    """A one-rank group when none was set up by a launcher (FSDP2 needs a mesh even alone)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    dist.init_process_group(plan.backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "get_base_model", None)
    if inner is not None:  # a PEFT model: the blocks are the base model's
        return decoder_layers(inner())
    prefix = getattr(model, "base_model_prefix", "model")
    layers = getattr(getattr(model, prefix, None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no .{prefix}.layers block list; the trainer shards "
            "decoder-only causal LMs (Llama, Qwen, Mistral, SmolLM and the like)"
        )
    return layers


def apply_activation_checkpointing(layers: torch.nn.ModuleList) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Activation memory drops from every block's to about one block's for ~30% more compute.
    Blocks are wrapped in place before sharding, as torchtitan does.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, preserve_rng_state=False)


def shard(
    root: torch.nn.Module, layers: torch.nn.ModuleList, plan: DevicePlan, dtype: torch.dtype
) -> None:
    """FSDP2 over ``root``: one unit per decoder block, then the root for what is left.

    bf16 compute keeps fp32 sharded master weights and reduces gradients in fp32, so the
    update is as precise as fp32 training (the usual recipe for bf16 LLM training).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(plan.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
    )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)


def to_full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded parameter (a collective when it is a DTensor)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float
) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (1-based): linear warm-up, then
    constant or cosine decay to ``min_ratio`` at ``total_steps``.

    A pure function of the step, so a resumed run continues the same curve with no
    scheduler state to checkpoint.

    >>> [lr_factor(s, warmup_steps=2, total_steps=6, schedule="cosine", min_ratio=0.0)
    ...  for s in (1, 2, 4, 6)]
    [0.5, 1.0, 0.5, 0.0]
    >>> lr_factor(5, warmup_steps=0, total_steps=6, schedule="constant", min_ratio=0.1)
    1.0
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}; use constant or cosine")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LrSchedule:
    """The learning-rate curve of one stretch of steps (a stage): warm-up, then constant or
    cosine decay over ``total_steps``, counted from global step ``first_step``.

    Each stage of a pipeline has its own (its warm-up starts at its first step, its cosine
    ends at its last), so an RL stage after SFT does not start half-way down a curve.

    >>> s = LrSchedule("cosine", warmup_steps=2, total_steps=6, first_step=11)
    >>> [s.factor(step) for step in (11, 12, 14, 16)]
    [0.5, 1.0, 0.5, 0.0]
    """

    kind: str = "constant"  # constant | cosine
    warmup_steps: int = 0
    total_steps: int = 1
    min_ratio: float = 0.0
    first_step: int = 1  # the global step that is this schedule's step 1

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rate for global optimizer step ``step``."""
        return lr_factor(
            step - self.first_step + 1,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            schedule=self.kind,
            min_ratio=self.min_ratio,
        )


# ---------------------------------------------------------------- memory planning


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank training state in bytes (activations excluded: they depend on the batch)."""

    parameters: int  # total parameter count of the model
    trainable: int  # parameters with gradients and optimizer state
    world_size: int
    per_rank_bytes: int
    detail: str

    def describe(self) -> str:
        return (
            f"{self.parameters / 1e9:.2f}B parameters ({self.trainable / 1e9:.3f}B trained) "
            f"on {self.world_size} rank(s): ~{self.per_rank_bytes / GIB:.1f} GiB per rank "
            f"({self.detail})"
        )


def estimate_training_memory(
    parameters: int,
    trainable: int,
    largest_layer: int,
    unsharded_root: int,
    *,
    world_size: int,
    compute_bytes: int,
    reference: bool,
) -> MemoryEstimate:
    """Bytes one rank needs for weights, gradients and AdamW moments under FSDP2.

    Per parameter, sharded over ``world_size``: 4 (fp32 master weight); per *trained*
    parameter also 4 (fp32 gradient) + 8 (AdamW's two moments); a KL reference adds 4 more.
    Unsharded at any time: the root's weights and two blocks (the one computing and the one
    prefetched) in the compute dtype, and their gradients before the reduce-scatter (in the
    compute dtype, plus the fp32 copy FSDP reduces when that dtype is narrower), scaled by
    the trained fraction. The root's full gradient lives through the whole backward, which
    is why it is counted: measured on two CPU ranks at hidden 2048, weights + gradients of
    root and two blocks are 1.37 GiB of the 1.48 GiB transient (docs/benchmarks.md, "Where a
    rank's memory goes").

    >>> e = estimate_training_memory(7_000_000_000, 7_000_000_000, 200_000_000, 500_000_000,
    ...                              world_size=8, compute_bytes=2, reference=False)
    >>> round(e.per_rank_bytes / 1e9, 1)
    21.2
    >>> lora = estimate_training_memory(7_000_000_000, 40_000_000, 200_000_000, 500_000_000,
    ...                                 world_size=8, compute_bytes=2, reference=False)
    >>> round(lora.per_rank_bytes / 1e9, 1)
    5.4
    """
    sharded = 4 * parameters + 12 * trainable + (4 * parameters if reference else 0)
    per_rank_state = math.ceil(sharded / world_size)
    gathered = unsharded_root + 2 * largest_layer
    gradient_bytes = compute_bytes + (4 if compute_bytes < 4 else 0)
    weights = compute_bytes * gathered
    gradients = math.ceil(gradient_bytes * gathered * trainable / max(1, parameters))
    if world_size == 1 and compute_bytes == 4:
        weights = gradients = 0  # the plain module: its weights and gradients are counted above
    return MemoryEstimate(
        parameters,
        trainable,
        world_size,
        per_rank_state + weights + gradients,
        f"sharded fp32 state {per_rank_state / GIB:.1f} GiB + unsharded compute copies "
        f"{weights / GIB:.1f} GiB + their gradients {gradients / GIB:.1f} GiB; activations "
        "not included",
    )


def count_parameters(model_dir: Path) -> tuple[int, int, int]:
    """(total, largest decoder block, outside the blocks) from the config alone (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    layers = decoder_layers(model)
    largest = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    in_layers = sum(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return total, largest, total - in_layers


def available_bytes(plan: DevicePlan, ranks_on_node: int) -> int:
    """Memory one rank may use: its GPU's, or the pod's (cgroup limit, else RAM) shared by
    the node's ranks."""
    if plan.is_cuda:
        return int(torch.cuda.get_device_properties(plan.device).total_memory)
    limit = _cgroup_limit()
    total = limit if limit is not None else _mem_total()
    return total // max(1, ranks_on_node)


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < 1 << 60:  # cgroup v1 "unlimited" is ~2^63
            return int(raw)
    return None


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemTotal from /proc/meminfo")


def check_fits(estimate: MemoryEstimate, available: int, where: str) -> None:
    """Refuse a run whose training state alone exceeds what a rank has (before loading)."""
    if estimate.per_rank_bytes > MEMORY_HEADROOM * available:
        raise UsageError(
            f"the model does not fit: {estimate.describe()}, but a rank has "
            f"{available / GIB:.1f} GiB ({where}; at most {MEMORY_HEADROOM:.0%} may hold the "
            "training state). Use more GPUs or nodes (spec.resources), LoRA "
            "(spec.engine.lora), or a smaller model"
        )
    log.info(
        "memory plan: %s; a rank has %.1f GiB (%s)", estimate.describe(), available / GIB, where
    )
