"""vLLM's IPC weight-transfer engine for CPU replicas: a staging file in shared memory
instead of a CUDA IPC handle.

Registered with vLLM's ``WeightTransferEngineFactory`` as ``posttrain_shm`` when the
worker extension is imported (:func:`register`), and chosen with
``--weight-transfer-config '{"backend": "posttrain_shm"}'``. Everything but the one call
that turns a handle into a tensor is vLLM's ``IPCWeightTransferEngine``: the session
(``start_weight_update`` opens vLLM's layerwise reload, ``finish_weight_update`` re-runs
the kernel-format post-processing), the packed wire format and the unpacking. A CUDA
replica runs vLLM's stock ``ipc`` backend on the same messages
(:mod:`posttrain.rollout.weight_transfer`).

Imports vLLM at import time: only the worker (in the rollout environment) imports it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCWeightTransferEngine,
    IPCWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from posttrain.rollout.weight_transfer import CPU_DEVICE_KEY, map_shared_buffer

log = logging.getLogger(__name__)

BACKEND = "posttrain_shm"


class SharedMemoryWeightTransferEngine(IPCWeightTransferEngine):
    """vLLM's packed IPC engine reading ``{"cpu": ["shm", path, nbytes]}`` handles."""

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo) -> None:
        handles = update_info.ipc_handles
        if not isinstance(handles, dict) or CPU_DEVICE_KEY not in handles:
            raise ValueError(
                f"{BACKEND} takes packed updates with an ipc_handles entry {CPU_DEVICE_KEY!r} "
                f"(a shared-memory staging file); got {type(handles).__name__}"
            )
        if update_info.tensor_sizes is None:
            raise ValueError("tensor_sizes is required (packed updates only)")
        started = time.perf_counter()
        buffer = map_shared_buffer(handles[CPU_DEVICE_KEY])
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        # Clones, as vLLM's packed consumer makes: the trainer reuses the staging buffer for
        # a later bucket, and the layerwise reload keeps tensors until a layer is complete.
        weights = [
            (name, tensor.clone())
            for name, tensor in unpack_tensor(
                buffer[: sum(update_info.tensor_sizes)],
                update_info.names,
                update_info.shapes,
                dtypes,
                update_info.tensor_sizes,
            )
        ]
        self.model.load_weights(weights)
        log.debug("loaded %d tensors from shared memory in %.3fs", len(weights),
                  time.perf_counter() - started)  # fmt: skip


def register() -> None:
    """Make ``posttrain_shm`` a vLLM weight-transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry: dict[str, Any] = getattr(WeightTransferEngineFactory, "_registry", {})
    if BACKEND not in registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, __name__, SharedMemoryWeightTransferEngine.__name__
        )
