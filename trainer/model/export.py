"""Hugging Face directories written from a stream of ``(name, tensor)``, shard by shard.

The trainer never holds the full model twice: tensors arrive gathered one at a time
(:meth:`posttrain.trainer.model.policy.Policy.full_weights`) and go to safetensors files of at
most ``max_shard_bytes``; only the current shard's tensors are in memory. Several files get
a ``model.safetensors.index.json`` (the layout ``save_pretrained`` writes, which
``from_pretrained``, vLLM and the rollout engine read); a model that fits one shard is a
single ``model.safetensors``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_safetensors_shards(
    tensors: Iterable[tuple[str, torch.Tensor]],
    dest: Path | None,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``tensors`` under ``dest`` in shards; ``dest=None`` consumes without writing.

    Consuming matters on ranks > 0: each tensor is a collective gather all ranks join, and
    only rank 0 keeps the result.
    """
    from safetensors.torch import save_file

    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    files: list[Path] = []
    weight_map: dict[str, str] = {}

    def flush() -> None:
        nonlocal pending, pending_bytes
        if dest is None or not pending:
            pending, pending_bytes = {}, 0
            return
        path = dest / f"model-{len(files) + 1:05d}.safetensors"
        save_file(pending, str(path), metadata={"format": "pt"})
        files.append(path)
        weight_map.update(dict.fromkeys(pending, path.name))
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        if dest is not None:
            pending[name] = tensor
            pending_bytes += size
    flush()
    if dest is None:
        return []
    if len(files) == 1:
        single = dest / SINGLE_FILE
        files[0].rename(single)
        return [single]
    total = sum(f.stat().st_size for f in files)
    (dest / INDEX_FILE).write_text(
        json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
            indent=2,
        )
    )
    return files


def write_hf_directory(
    policy: Any,
    dest: Path,
    *,
    weights_only: bool = False,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path | None:
    """Config, generation config, tokenizer and streamed weights of ``policy`` in ``dest``
    (only the safetensors with ``weights_only``: what a rollout server reloads each step).

    Collective: every rank calls it; rank 0 writes and returns ``dest``, the others None.
    """
    main = policy.is_main
    if main:
        dest.mkdir(parents=True, exist_ok=True)
        for stale in [*dest.glob("*.safetensors"), dest / INDEX_FILE]:
            stale.unlink(missing_ok=True)
    write_safetensors_shards(
        policy.full_weights(dtype), dest if main else None, max_shard_bytes=max_shard_bytes
    )
    if not main or weights_only:
        return dest if main else None
    config = _plain_model(policy.model).config
    config.save_pretrained(dest)
    generation = getattr(policy.model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(dest)
    policy.tokenizer.save_pretrained(dest)
    return dest


def _plain_model(model: Any) -> Any:
    """The HF model under a PEFT wrapper (its config is the servable architecture)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model
