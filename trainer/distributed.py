"""Multi-node training with Ray: one trainer actor per node, gradients all-reduced.

Design (see docs/trainer.md, "Multi-node"):

* ``posttrain run`` on the head pod sees ``spec.resources.nodes > 1`` (or
  ``$POSTTRAIN_NODES``, or ``$RAY_ADDRESS``) and, instead of training in process, connects
  to the Ray cluster, waits until ``nodes`` Ray nodes have joined (worker pods start after
  the head), and starts one :class:`TrainerWorker` actor pinned to each node; rank 0 goes
  to the driver's own node so its outputs (``--out``) land where ``posttrain run`` was
  started.
* Rank 0's actor picks a free port on its node; every actor calls
  ``torch.distributed.init_process_group`` (NCCL on GPUs, Gloo on CPU) at that address.
* Every rank runs the same loop (:func:`posttrain.trainer.loop.train`) on its own shard
  of prompts (``prompts_per_step / world_size``, curriculum seeded per rank), sampling
  from the shared rollout pool. After backward, :func:`all_reduce_gradients` averages
  gradients across ranks, so every rank applies the identical AdamW update and the
  replicas never diverge (what DDP does, without its bucketing optimisation). Before
  averaging it checks that the replicas still hold identical parameters: averaging the
  gradients of different models is silently meaningless, so a divergence fails the step.
* Only rank 0 publishes weights to the rollout pool, evaluates, checkpoints and reports
  status; the others train silently (their step metrics go to ``--out/rank<N>/``).
* If one rank fails, the driver kills the others (they would otherwise block in the next
  collective until Gloo's 30-minute timeout) and ``posttrain run`` fails with that error.

Tested (tests/trainer/test_distributed.py): the all-reduce and the divergence check with a
real 2-process Gloo group; ``posttrain run`` on a real two-node local Ray cluster (lockstep
ranks, equality with a single-process step, checkpoint, a failing rank). Not tested here:
NCCL and GPUs.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import REGISTRY, Counter

from posttrain.errors import UsageError
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

NODES_ENV = "POSTTRAIN_NODES"
NODE_WAIT_ENV = "POSTTRAIN_RAY_NODE_WAIT_S"  # how long the driver waits for worker nodes
DEFAULT_NODE_WAIT_S = 600.0

REPLICA_CHECKS = Counter(
    "posttrain_trainer_replica_checks_total",
    "Steps on which all ranks were verified to hold identical parameters",
)


class ReplicaDivergenceError(RuntimeError):
    """The ranks' parameters differ, so their averaged gradient means nothing."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every rank gets here (no-op in a single process).

        The loop calls this after rank 0 published a step's weights, so that no rank
        samples its next batch before the rollout pool serves those weights.
        """
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()


def wanted_nodes(run: Any) -> int:
    """Nodes requested by the environment (operator) or the spec's resources."""
    return int(os.environ.get(NODES_ENV, run.spec.resources.nodes))


def parameter_fingerprint(parameters: Any) -> torch.Tensor:
    """Per-tensor float64 (sum, sum of squares, position-weighted sum): cheap and exact.

    Equal replicas give bitwise-equal fingerprints (same values, same reduction order on
    the same hardware); a diverged replica changes at least one entry. Not a hash: it
    exists to catch bugs (a rank resumed from another checkpoint, a non-deterministic
    update), not adversaries.

    >>> a = torch.nn.Linear(2, 1, bias=False).requires_grad_(True)
    >>> with torch.no_grad():
    ...     _ = a.weight.copy_(torch.tensor([[1.0, 2.0]]))
    >>> parameter_fingerprint(a.parameters()).tolist()
    [3.0, 5.0, 5.0]
    """
    rows = []
    for p in parameters:
        flat = p.detach().reshape(-1).double()  # (n,)
        positions = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
        rows.append(torch.stack([flat.sum(), (flat * flat).sum(), (flat * positions).sum()]))
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.float64)  # (3 * tensors,)


def check_replicas_identical(parameters: Any, world_size: int) -> None:
    """Raise :class:`ReplicaDivergenceError` unless every rank holds the same parameters."""
    import torch.distributed as dist

    mine = parameter_fingerprint(parameters)  # (3 * tensors,)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    differing = [rank for rank, theirs in enumerate(everyone) if not torch.equal(theirs, mine)]
    if differing:
        raise ReplicaDivergenceError(
            f"rank {dist.get_rank()}: parameters differ from rank(s) {differing}; the replicas "
            "no longer train one model (did a rank resume from a different checkpoint? use a "
            "shared checkpoint.storageUri for multi-node runs)"
        )
    REPLICA_CHECKS.inc()


def all_reduce_gradients(parameters: Any, world_size: int) -> None:
    """Average ``.grad`` of every parameter across the process group (in place).

    First checks that the replicas hold identical parameters (see
    :func:`check_replicas_identical`). Gradients are flattened into one buffer so a step
    costs one collective, not one per tensor; parameters without a gradient contribute
    zeros so every rank sends the same shape.
    """
    if world_size <= 1:
        return
    import torch.distributed as dist

    params = [p for p in parameters if p.requires_grad]
    check_replicas_identical(params, world_size)
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def assign_nodes(driver_node: str, alive_nodes: list[str], nodes: int) -> list[str]:
    """Node id of each rank: rank 0 on the driver's node, the others in a stable order.

    >>> assign_nodes("b", ["c", "a", "b"], 2)
    ['b', 'a']
    >>> assign_nodes("x", ["c", "a"], 2)  # driver outside the cluster (e.g. a laptop)
    ['a', 'c']
    """
    others = sorted(n for n in alive_nodes if n != driver_node)
    order = [driver_node, *others] if driver_node in alive_nodes else others
    return order[:nodes]


def _wait_for_nodes(ray: Any, nodes: int, gpus: int, timeout_s: float) -> list[str]:
    """Ids of alive nodes able to host a rank, once at least ``nodes`` of them exist."""
    deadline = time.monotonic() + timeout_s
    next_log = 0.0
    while True:
        usable = [n["NodeID"] for n in ray.nodes() if n.get("Alive")
                  and n.get("Resources", {}).get("CPU", 0) >= 1
                  and n.get("Resources", {}).get("GPU", 0) >= gpus]
        if len(usable) >= nodes:
            return usable
        now = time.monotonic()
        if now >= deadline:
            raise RuntimeError(
                f"{nodes} trainer nodes requested but only {len(usable)} Ray node(s) with >= 1 "
                f"CPU and >= {gpus} GPU joined within {timeout_s:.0f}s; check that the worker "
                f"pods are running (kubectl get pods) or raise ${NODE_WAIT_ENV}"
            )
        if now >= next_log:
            log.info("waiting for Ray nodes: %d of %d joined", len(usable), nodes)
            next_log = now + 30
        time.sleep(1.0)


def _gather_or_kill(ray: Any, refs: list[Any], workers: list[Any]) -> list[Any]:
    """Results of every rank; on the first failure kill all ranks and re-raise it.

    Without this, one crashed rank leaves the others blocked in their next collective.
    """
    remaining = list(refs)
    try:
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=1)
            ray.get(done[0])  # raises the rank's exception
    except BaseException:
        for worker in workers:
            ray.kill(worker)
        raise
    return [ray.get(ref) for ref in refs]


def launch_if_distributed(run: Any, out_dir: Path) -> Any | None:
    """Train on a Ray cluster when more than one node is wanted.

    Returns rank 0's :class:`posttrain.trainer.loop.RunResult`, or None for a
    single-node run (the caller trains in process).
    """
    nodes = wanted_nodes(run)
    if nodes <= 1 and not os.environ.get("RAY_ADDRESS"):
        return None
    try:
        import ray
    except ImportError:
        raise UsageError(
            f"{nodes} nodes requested (spec.resources.nodes / ${NODES_ENV}) but Ray is not "
            "installed; install posttrain[ray] in the trainer image or set nodes: 1"
        ) from None
    from posttrain.trainer.cli import _endpoints

    # Resolved here, on the driver: the actors' environment is the Ray node's, not ours.
    endpoints = _endpoints(run.spec)
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    with tracer.start_as_current_span("trainer.distributed_run") as span:
        span.set_attribute("nodes", nodes)
        span.set_attribute("gpus_per_node", run.spec.resources.gpus_per_node)
        results = _run_on_ray(ray, run, out_dir, nodes, endpoints)
    log.info("distributed run finished on %d nodes; (rank, steps, replica checks): %s", nodes,
             [(r["rank"], r["steps_done"], r["replica_checks"]) for r in results])
    return results[0]["result"]


def _run_on_ray(ray: Any, run: Any, out_dir: Path, nodes: int,
                endpoints: list[str]) -> list[dict[str, Any]]:
    """Place one rank per node, train, and return every rank's summary (rank order)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        gpus = run.spec.resources.gpus_per_node
        wait_s = float(os.environ.get(NODE_WAIT_ENV, DEFAULT_NODE_WAIT_S))
        alive = _wait_for_nodes(ray, nodes, gpus, wait_s)
        placement = assign_nodes(ray.get_runtime_context().get_node_id(), alive, nodes)
        log.info("starting %d trainer ranks on Ray nodes %s", nodes, placement)
        workers = [
            ray.remote(TrainerWorker).options(
                num_cpus=1, num_gpus=gpus, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(rank, nodes)
            for rank, node_id in enumerate(placement)
        ]
        master = ray.get(workers[0].master_address.remote())
        spec_json = run.spec.model_dump(mode="json")
        # Absolute: an actor's working directory is Ray's, not the driver's.
        refs = [w.train.remote(spec_json, str(out_dir.resolve()), master, gpus > 0, endpoints)
                for w in workers]
        return _gather_or_kill(ray, refs, workers)
    finally:
        ray.shutdown()


def rank_out_dir(out_dir: Path, rank: int) -> Path:
    """Rank 0 writes the run's outputs where a single-node run would; rank N under rankN/.

    >>> rank_out_dir(Path("/w"), 0), rank_out_dir(Path("/w"), 2)
    (PosixPath('/w'), PosixPath('/w/rank2'))
    """
    return out_dir if rank == 0 else out_dir / f"rank{rank}"


class TrainerWorker:
    """One node's trainer (wrapped by ``ray.remote`` at launch time)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.context = DistContext(rank, world_size)

    def master_address(self) -> str:
        """``host:port`` for the process group's rendezvous, on this (rank 0's) node."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{_free_port()}"

    def train(self, spec_json: dict[str, Any], out_dir: str, master: str, use_gpu: bool,
              endpoints: list[str]) -> dict[str, Any]:
        """Run the training loop as this rank; rank 0's summary carries the RunResult."""
        from posttrain.api import TrainingRunSpec
        from posttrain.rollout.client import RolloutClient
        from posttrain.trainer.loop import train
        from posttrain.trainer.status import status_reporter_from_env

        logging.basicConfig(level=logging.INFO,
                            format=f"rank{self.context.rank} %(levelname)s %(name)s: %(message)s")
        init_process_group(self.context.rank, self.context.world_size, master, use_gpu)
        spec = TrainingRunSpec.model_validate(spec_json)
        client = RolloutClient(endpoints, timeout_s=spec.rollout.timeout_seconds,
                               max_in_flight=max(spec.rollout.max_in_flight,
                                                 spec.algorithm.prompts_per_step))
        out = rank_out_dir(Path(out_dir), self.context.rank)
        reporter = status_reporter_from_env(out) if self.context.is_main else None
        try:
            result = train(spec, out, client, reporter=reporter, dist=self.context)
        finally:
            client.close()
            import torch.distributed as dist

            dist.destroy_process_group()
        checks = REGISTRY.get_sample_value("posttrain_trainer_replica_checks_total") or 0.0
        return {
            "rank": self.context.rank,
            "steps_done": result.steps_done,
            "replica_checks": int(checks),
            "result": result if self.context.is_main else None,
        }
