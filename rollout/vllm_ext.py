"""vLLM worker extension that reloads policy weights from a local safetensors directory.

Loaded into every vLLM worker process with
``vllm serve ... --worker-extension-cls posttrain.rollout.vllm_ext.WeightSyncExtension``
and invoked through vLLM's dev-mode ``POST /collective_rpc`` endpoint
(``VLLM_SERVER_DEV_MODE=1``) as
``{"method": "reload_weights_from_path", "args": ["/weights/v00000007"]}``.

Why this path rather than the alternatives vLLM documents:

* LoRA hot-loading (``/v1/load_lora_adapter``) only covers adapter training; we train
  full weights.
* NCCL broadcast from the trainer (the ``update_weights_from_distributed`` pattern) needs the
  trainer and every replica in one process group -- impossible across an elastic pool whose
  replicas come and go, and it couples trainer and pool lifecycles.
* ``collective_rpc`` runs our method on *every* tensor-parallel worker; each calls
  ``model.load_weights``, vLLM's own loader, which shards checkpoint tensors for its TP rank
  and fuses q/k/v and gate/up exactly as at start-up. Weights travel through object storage,
  which the trainer writes anyway for checkpoints.

This module imports nothing from vLLM at import time (vLLM mixes the class into its Worker).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def iter_safetensors(weights_dir: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` from every ``*.safetensors`` file, one tensor at a time
    (streaming keeps host memory flat for large models)."""
    from safetensors import safe_open

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {weights_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                yield name, handle.get_tensor(name)


class WeightSyncExtension:
    """Methods added to vLLM's GPU worker (``self.model_runner`` is the worker's)."""

    def reload_weights_from_path(self, weights_dir: str) -> int:
        """Load every tensor in ``weights_dir`` into the running model; returns the count.

        vLLM's own in-place reload (``Worker.reload_weights``, vLLM >= 0.2x) is used where it
        exists: after start-up vLLM post-processes weights into kernel layouts (the CPU
        build repacks every linear layer and leaves the checkpoint-shaped parameter empty),
        so a bare ``model.load_weights`` would fail or write into dead tensors. Its layerwise
        reload restores checkpoint shapes, loads, and re-runs the post-processing.
        """
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in iter_safetensors(weights_dir):
                count += 1
                yield item

        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=counted(), is_checkpoint_format=True)
        else:  # older vLLM: no kernel-format post-processing to undo
            self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        log.info("reloaded %d tensors from %s", count, weights_dir)
        return count

    def weights_checksum(self) -> float:
        """Sum of all parameters (float64): lets tests check that a reload took effect."""
        import torch

        model = self.model_runner.model  # type: ignore[attr-defined]
        with torch.no_grad():
            return float(sum(p.double().sum() for p in model.parameters()))
