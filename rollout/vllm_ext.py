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

Importing it (vLLM does, in every worker, before the worker sizes its KV cache) also makes
vLLM count reclaimable page cache as free memory in a container (see
:func:`count_page_cache_as_free`); otherwise it imports nothing from vLLM (vLLM mixes the
class into its Worker).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The memory.stat of the container's own cgroup: v2 (unified), else v1's memory controller.
CGROUP_MEMORY_STATS = (
    Path("/sys/fs/cgroup/memory.stat"),
    Path("/sys/fs/cgroup/memory/memory.stat"),
)


def reclaimable_page_cache(stat: str) -> int:
    r"""Bytes of a cgroup's page cache the kernel can drop under its limit: file pages that
    no process maps and that are not tmpfs or shared memory (``/dev/shm``), from the text
    of ``memory.stat`` (cgroup v2 names ``file``, v1 ``total_cache``).

    >>> reclaimable_page_cache("file 3000\nfile_mapped 500\nshmem 200\nanon 9")  # v2
    2300
    >>> reclaimable_page_cache("cache 10\ntotal_cache 3000\ntotal_mapped_file 500\n"
    ...                        "total_shmem 200\n")  # v1, hierarchical totals
    2300
    >>> reclaimable_page_cache("rss 5\n")
    0
    """
    values = {}
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            values[key] = int(value)
    if "file" in values:  # cgroup v2
        cache, mapped, shmem = values["file"], values.get("file_mapped", 0), values.get("shmem", 0)
    else:
        cache = values.get("total_cache", values.get("cache", 0))
        mapped = values.get("total_mapped_file", values.get("mapped_file", 0))
        shmem = values.get("total_shmem", values.get("shmem", 0))
    return max(0, cache - mapped - shmem)


def working_set(
    usage: Callable[[], int | None], stats: tuple[Path, ...]
) -> Callable[[], int | None]:
    """``usage`` (a cgroup's memory usage, page cache included) less the reclaimable page
    cache in the first readable of ``stats``."""

    def measure() -> int | None:
        used = usage()
        if used is None:
            return None
        for stat in stats:
            try:
                return max(0, used - reclaimable_page_cache(stat.read_text()))
            except OSError:
                continue
        return used

    return measure


def count_page_cache_as_free() -> bool:
    """Make vLLM's cgroup memory usage leave out reclaimable page cache; whether it did.

    vLLM's CPU worker refuses to start when its KV cache exceeds the cgroup's limit minus
    its usage (``memory.current`` / ``memory.usage_in_bytes``), and usage counts the page
    cache of every file the container read: the Python packages and the model. In a 3 GiB
    pod on a real kubelet that cache alone filled the limit, so vLLM saw 0.14 GiB free and
    exited ("Available memory on node 0 (0.14/3.0 GiB) on kv cache allocation is less than
    requested memory for kv (0.25 GiB)"), restarting forever, though the kernel drops that
    cache before it would OOM-kill anything. Counted as the kubelet counts a container's
    working set, less also the unmapped active cache.
    """
    try:
        from vllm.utils import cpu_resource_utils
    except ImportError:  # not in vLLM's environment (unit tests, the trainer)
        return False
    current = cpu_resource_utils.get_cgroup_memory_usage
    if getattr(current, "_posttrain_working_set", False):
        return True
    patched = working_set(current, CGROUP_MEMORY_STATS)
    patched._posttrain_working_set = True  # type: ignore[attr-defined]
    cpu_resource_utils.get_cgroup_memory_usage = patched
    return True


count_page_cache_as_free()


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
