"""Multi-node training with Ray: one trainer actor per node, gradients all-reduced.

Design (see docs/trainer.md, "Multi-node"):

* ``posttrain run`` on the head pod sees ``POSTTRAIN_NODES > 1`` or ``RAY_ADDRESS`` and,
  instead of training in process, connects to the Ray cluster and starts one
  :class:`TrainerWorker` actor per node (``num_gpus = resources.gpusPerNode``).
* Rank 0 picks a free port; every actor calls ``torch.distributed.init_process_group``
  (NCCL on GPUs, Gloo on CPU) with ``world_size = nodes``.
* Every rank runs the same loop (:func:`posttrain.trainer.loop.train`) on its own shard
  of prompts (``prompts_per_step / world_size``, curriculum seeded per rank) and sampling
  from the shared rollout pool. After backward, :func:`all_reduce_gradients` averages
  gradients across ranks, so every rank applies the identical AdamW update and the
  replicas never diverge (what DDP does, without its bucketing optimisation).
* Only rank 0 publishes weights to the rollout pool, evaluates, checkpoints and reports
  status; the others train silently.

What is tested: :func:`all_reduce_gradients` with a real Gloo process group on CPU
(tests/trainer/test_distributed.py). What is NOT tested here: the Ray launch itself (Ray
is not installed in this environment) and NCCL; treat multi-node as experimental.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.errors import UsageError

log = logging.getLogger(__name__)

NODES_ENV = "POSTTRAIN_NODES"


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def wanted_nodes(run: Any) -> int:
    """Nodes requested by the environment (operator) or the spec's resources."""
    return int(os.environ.get(NODES_ENV, run.spec.resources.nodes))


def all_reduce_gradients(parameters: Any, world_size: int) -> None:
    """Average ``.grad`` of every parameter across the process group (in place).

    Gradients are flattened into one buffer so a step costs one collective, not one per
    tensor; parameters without a gradient contribute zeros so every rank sends the same
    shape.
    """
    if world_size <= 1:
        return
    import torch.distributed as dist

    params = [p for p in parameters if p.requires_grad]
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    )  # (total_params,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def init_process_group(rank: int, world_size: int, master: str, use_gpu: bool) -> None:
    import torch.distributed as dist

    backend = "nccl" if use_gpu else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank,
                            world_size=world_size)
    log.info("rank %d/%d joined %s process group at %s", rank, world_size, backend, master)


def _free_address() -> str:
    host = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return f"{host}:{sock.getsockname()[1]}"


def launch_if_distributed(run: Any, out_dir: Path) -> bool:
    """Train on a Ray cluster when more than one node is wanted; False means single node."""
    nodes = wanted_nodes(run)
    if nodes <= 1 and not os.environ.get("RAY_ADDRESS"):
        return False
    try:
        import ray
    except ImportError:
        raise UsageError(
            f"{nodes} nodes requested (spec.resources.nodes / ${NODES_ENV}) but Ray is not "
            "installed; install posttrain[ray] in the trainer image or set nodes: 1"
        ) from None
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    gpus = run.spec.resources.gpus_per_node
    worker_cls = ray.remote(num_gpus=gpus)(TrainerWorker)
    master = ray.get(worker_cls.remote(0, nodes).address.remote())
    workers = [worker_cls.remote(rank, nodes) for rank in range(nodes)]
    spec_json = run.spec.model_dump(mode="json")
    results = ray.get(
        [w.train.remote(spec_json, str(out_dir), master, gpus > 0) for w in workers]
    )
    log.info("distributed run finished on %d nodes: %s", nodes, results[0])
    return True


class TrainerWorker:
    """One node's trainer (wrapped by ``ray.remote`` at launch time)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.context = DistContext(rank, world_size)

    def address(self) -> str:
        return _free_address()

    def train(self, spec_json: dict[str, Any], out_dir: str, master: str, use_gpu: bool) -> int:
        from posttrain.api import TrainingRunSpec
        from posttrain.rollout.client import RolloutClient
        from posttrain.trainer.cli import _endpoints
        from posttrain.trainer.loop import train
        from posttrain.trainer.status import status_reporter_from_env

        init_process_group(self.context.rank, self.context.world_size, master, use_gpu)
        spec = TrainingRunSpec.model_validate(spec_json)
        endpoints = _endpoints(spec)
        client = RolloutClient(endpoints, timeout_s=spec.rollout.timeout_seconds,
                               max_in_flight=spec.rollout.max_in_flight)
        out = Path(out_dir) / f"rank{self.context.rank}"
        reporter = status_reporter_from_env(out) if self.context.is_main else None
        result = train(spec, out, client, reporter=reporter, dist=self.context)
        return result.steps_done
