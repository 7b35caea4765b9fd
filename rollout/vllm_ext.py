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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _register_transfer_backend() -> None:
    """Make the CPU shared-memory weight-transfer backend known to vLLM in this (worker)
    process: vLLM resolves the worker extension before it creates its transfer engine."""
    try:
        from posttrain.rollout import vllm_transfer
    except ImportError:  # no vLLM here (the trainer's environment, unit tests)
        return
    vllm_transfer.register()


_register_transfer_backend()


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

    def reload_weights_from_path(self, weights_dir: str) -> dict[str, float]:
        """Load every tensor in ``weights_dir`` into the running model.

        Returns ``{"tensors": count, "seconds": time in this worker}`` (the front door logs
        it as the load's ``reload`` phase). vLLM's own in-place reload (``Worker.reload_weights``,
        vLLM >= 0.2x) is used where it exists: after start-up vLLM post-processes weights
        into kernel layouts (the CPU build repacks every linear layer and leaves the
        checkpoint-shaped parameter empty), so a bare ``model.load_weights`` would fail or
        write into dead tensors. Its layerwise reload restores checkpoint shapes, loads, and
        re-runs the post-processing.
        """
        started = time.perf_counter()
        count = self._reload(iter_safetensors(weights_dir))
        seconds = time.perf_counter() - started
        log.info("reloaded %d tensors from %s in %.2fs", count, weights_dir, seconds)
        return {"tensors": count, "seconds": seconds}

    def reload_weights_from_store(
        self, uri: str, version: int, hold_dir: str, rollback_dir: str
    ) -> dict[str, Any]:
        """Stream registry version ``version`` under ``uri`` (``s3://``) into the running
        model, tensor by tensor as the bytes arrive (rollout/weight_stream.py), writing them
        to ``hold_dir`` as they pass.

        On success ``{"tensors", "seconds", "bytes", "wait"}`` (``wait``: seconds vLLM's
        reload waited for bytes). When the stream fails part-way (a digest, a truncated
        object, storage gone) the model holds part of a version nobody published: vLLM's
        interrupted reload is finished, the weights in ``rollback_dir`` (the version this
        replica served, verified when it was loaded) are reloaded in full, and the answer is
        ``{"error", "kind", "rolled_back": true, "seconds"}``. If that reload fails too, this
        raises: the front door then exits rather than serve weights it cannot vouch for.
        """
        from posttrain.rollout.weight_stream import StreamStats, stream_version

        started = time.perf_counter()
        stats = StreamStats()
        try:
            count = self._reload(stream_version(uri, version, Path(hold_dir), stats))
        except Exception as exc:
            self._finish_interrupted_reload()
            log.error("streaming weights v%d from %s failed after %d tensors (%s); reloading "
                      "%s", version, uri, stats.tensors, exc, rollback_dir)  # fmt: skip
            self._reload(iter_safetensors(rollback_dir))
            return {
                "error": str(exc),
                "kind": type(exc).__name__,
                "rolled_back": True,
                "seconds": time.perf_counter() - started,
            }
        seconds = time.perf_counter() - started
        log.info("streamed %d tensors (%d bytes) of v%d from %s in %.2fs (%.2fs waiting for "
                 "bytes)", count, stats.bytes, version, uri, seconds, stats.wait_s)  # fmt: skip
        return {"tensors": count, "seconds": seconds, "bytes": stats.bytes, "wait": stats.wait_s}

    def _finish_interrupted_reload(self) -> None:
        """Bring vLLM's layerwise reload back to a steady state after its weights iterator
        raised: the layers it never reached get their kernel tensors back, the others are
        processed with what they had (overwritten by the reload that follows)."""
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import (
                finalize_layerwise_reload,
            )
        except ImportError:  # older vLLM: load_weights wrote straight into the parameters
            return
        runner = self.model_runner  # type: ignore[attr-defined]
        with set_current_vllm_config(runner.vllm_config):  # as Worker.reload_weights runs
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)

    def stage_weights_in_memory(self, weights_dir: str) -> int:
        """Read ``weights_dir`` into this worker's memory (for :meth:`reload_staged_weights`);
        returns the tensor count. Benchmarks only: the reference a publish is measured
        against is vLLM reloading bytes it already holds."""
        # Copies in this process's memory, touched once: safetensors' tensors are views of
        # the file's mapping (page cache), which a reload would fault in as it reads.
        self._staged = {name: tensor.clone() for name, tensor in iter_safetensors(weights_dir)}
        return len(self._staged)

    def reload_staged_weights(self) -> dict[str, float]:
        """vLLM's own in-place reload from tensors already in this worker's memory (staged
        by :meth:`stage_weights_in_memory`), timed here: no file, no HTTP, no digest -- the
        floor a publish can approach. ``{"tensors", "seconds"}`` as for a path."""
        staged: dict[str, Any] = getattr(self, "_staged", {})
        if not staged:
            raise RuntimeError("no staged weights: call stage_weights_in_memory first")
        started = time.perf_counter()
        count = self._reload(iter(staged.items()))
        return {"tensors": count, "seconds": time.perf_counter() - started}

    def drop_staged_weights(self) -> None:
        self._staged = {}

    def _reload(self, tensors: Iterator[tuple[str, Any]]) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            reload(weights_iterator=counted(), is_checkpoint_format=True)
        else:  # older vLLM: no kernel-format post-processing to undo
            self.model_runner.model.load_weights(weights=counted())  # type: ignore[attr-defined]
        return count

    def weights_checksum(self) -> float:
        """Sum of all parameters (float64): lets tests check that a reload took effect."""
        import torch

        model = self.model_runner.model  # type: ignore[attr-defined]
        with torch.no_grad():
            return float(sum(p.double().sum() for p in model.parameters()))
