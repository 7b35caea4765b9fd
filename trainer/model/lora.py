"""LoRA through PEFT: only low-rank adapters train; servers always get merged plain weights.

With ``spec.engine.lora`` set, the base weights are frozen and each targeted projection
``W`` gains ``B @ A`` (rank ``r``, scaled by ``alpha / r``). Gradients and AdamW moments
exist only for ``A`` and ``B`` (well under 1% of a 7B model at r=16), which is what makes a
70B policy trainable on one 8-GPU node. The rollout servers and ``posttrain eval`` never
see adapters: :func:`servable_weights` streams ``W + (alpha / r) B @ A`` under the base
model's own names, one tensor at a time (sharded or not), exactly what ``peft``'s
``merge_and_unload`` would produce (tested).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.api.trainingrun import DEFAULT_LORA_TARGETS
from posttrain.trainer.model.training_engine import to_full

ADAPTER = "default"


@dataclass(frozen=True)
class LoraOptions:
    """Low-rank adapters (PEFT LoRA) on the attention and MLP projections."""

    rank: int = 16
    alpha: float = 32.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_TARGETS


def add_adapters(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
    """``model`` with LoRA adapters on ``options.target_modules``; base weights frozen."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        from posttrain.errors import UsageError

        raise UsageError(
            "spec.engine.lora needs the peft package: pip install 'posttrain[train]'"
        ) from None
    config = LoraConfig(
        r=options.rank,
        # peft annotates lora_alpha as int but only ever computes lora_alpha / r with it;
        # spec.engine.lora.alpha is a float (32.0, or 0.5 for a gentle scale) and stays one.
        lora_alpha=options.alpha,  # type: ignore[arg-type]
        lora_dropout=0.0,
        target_modules=list(options.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def estimate_adapter_parameters(model_dir: Path, options: LoraOptions) -> int:
    """Trainable parameters LoRA adds, from the config alone (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    total = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in options.target_modules and isinstance(
            module, torch.nn.Linear
        ):
            total += options.rank * (module.in_features + module.out_features)
    return total


def servable_weights(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype | None,
    skip: frozenset[str],
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor on device)`` for every weight a server loads, gathered one
    at a time (``device``: CPU for files; the GPU for a direct transfer to a replica on it).

    Each projection with an adapter is merged on the fly (fp32 arithmetic, then cast) and
    named as in the base model. Collective when sharded: every rank must consume the whole
    iterator.
    """
    state = model.state_dict()
    scaling = _scalings(model)
    for key, tensor in state.items():
        if ".lora_" in key:
            continue  # folded into their base weight below
        name = key.replace(".base_layer.", ".")
        if name in skip:
            continue
        owner = key.split(".base_layer.")[0] if ".base_layer." in key else None
        if owner in scaling and name.endswith(".weight"):
            full = to_full(tensor.detach()).float()  # (out, in)
            a = to_full(state[f"{owner}.lora_A.{ADAPTER}.weight"].detach()).float()  # (r, in)
            b = to_full(state[f"{owner}.lora_B.{ADAPTER}.weight"].detach()).float()  # (out, r)
            full = full + scaling[owner] * (b @ a)  # (out, in)
        else:
            full = to_full(tensor.detach())
        target = dtype if dtype is not None and full.is_floating_point() else full.dtype
        yield name, full.to(device, dtype=target).contiguous()


def _scalings(model: Any) -> dict[str, float]:
    """Each adapted module's state-dict prefix -> its LoRA scale (alpha / r)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft, so no adapters
        return {}

    # Activation checkpointing wraps blocks; the state dict hides the wrapper, so do we.
    return {
        name.replace("._checkpoint_wrapped_module", ""): float(module.scaling[ADAPTER])
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.scaling
    }
