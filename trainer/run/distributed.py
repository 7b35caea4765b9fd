"""Several trainer ranks: torch's elastic launcher (torchrun) starts them, FSDP2 syncs them.

Design (see docs/trainer.md, "Multi-rank and multi-node"):

* **World.** ``spec.resources.nodes`` nodes x ranks per node, where ranks per node is
  ``gpusPerNode`` (one process per GPU) or ``engine.cpuRanks`` on CPU nodes.
* **Launch.** ``posttrain run`` on each node is torchrun's agent
  (:func:`torch.distributed.launcher.api.elastic_launch`): it starts the node's ranks with
  ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, and a static rendezvous at ``MASTER_ADDR:
  MASTER_PORT`` (rank 0's node; the operator's head Service) with this node's rank from
  ``$POSTTRAIN_NODE_RANK`` orders the nodes. On a laptop (one node) the rendezvous is on
  loopback. ``posttrain run`` started by an external ``torchrun`` trains as that rank.
* **Gradients.** Each rank runs the same loop (:func:`posttrain.trainer.run.loop.train`) on its
  own share of prompts; FSDP2 reduce-scatters and averages gradients in the backward pass
  (:mod:`posttrain.trainer.model.training_engine`), so there is no gradient code here.
* **Failure.** ``max_restarts=0``: when a rank fails, the agent stops the node's other ranks
  and ``posttrain run`` exits non-zero; the other nodes' ranks fail in their next collective
  (or at the rendezvous), so the pod gang fails and the operator restarts it from the last
  checkpoint (``spec.backoffLimit``).
* **Roles.** Rank 0 publishes weights, evaluates, checkpoints and reports status; every rank
  writes its own trajectories and sharded checkpoint files. Rank N's step metrics go to
  ``--out/rank<N>/``.
* **Ray** (``$RAY_ADDRESS``, the operator's RayCluster path): Ray Train's ``TorchTrainer``
  with one worker per rank (``ScalingConfig``; label selectors pin ``ranks_per_node`` workers
  to each node, node 0 the driver's). Ray Train joins the process group and sets the same
  environment torchrun would; each worker runs the very same rank entry point. No retries
  (``FailureConfig(max_failures=0)``): a failed rank stops the others and fails ``fit()``.

Tested (tests/trainer/test_distributed.py): two CPU ranks launched by ``posttrain run`` on
one node and as two "nodes" (two agents, static rendezvous), a failing rank failing the gang,
and the sharded step against a single process. Not tested here: NCCL and GPUs.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.api import env
from posttrain.api.env import TrainerEnv
from posttrain.errors import UsageError
from posttrain.processes import free_port
from posttrain.telemetry import get_tracer
from posttrain.trainer.model.dist_context import DistContext

if TYPE_CHECKING:
    from posttrain.api import TrainingRun, TrainingRunSpec
    from posttrain.trainer.run.loop import RunResult

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

NODE_WAIT_ENV = env.RAY_NODE_WAIT_S  # how long the Ray driver waits for worker nodes
DEFAULT_NODE_WAIT_S = 600.0
DEFAULT_RENDEZVOUS_TIMEOUT_S = 900


@dataclass(frozen=True)
class WorldPlan:
    """How many processes, where: ``nodes`` x ``ranks_per_node``."""

    nodes: int
    ranks_per_node: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def wanted_nodes(run: TrainingRun, contract: TrainerEnv) -> int:
    """Nodes requested by the environment (operator) or the spec's resources."""
    return run.spec.resources.nodes if contract.nodes is None else contract.nodes


def ranks_per_node(spec: TrainingRunSpec) -> int:
    """One rank per GPU, or ``engine.cpuRanks`` CPU ranks.

    >>> from types import SimpleNamespace as S
    >>> ranks_per_node(S(resources=S(gpus_per_node=8), engine=S(cpu_ranks=1)))
    8
    >>> ranks_per_node(S(resources=S(gpus_per_node=0), engine=S(cpu_ranks=2)))
    2
    """
    gpus = spec.resources.gpus_per_node
    return gpus if gpus > 0 else spec.engine.cpu_ranks


def world_plan(run: TrainingRun, contract: TrainerEnv) -> WorldPlan:
    """The world of this run from the spec and what the operator handed the pod.

    >>> from types import SimpleNamespace as S
    >>> run = S(spec=S(resources=S(nodes=2, gpus_per_node=4), engine=S(cpu_ranks=1)))
    >>> world_plan(run, TrainerEnv(node_rank=1, master_addr="head", master_port=29500))
    WorldPlan(nodes=2, ranks_per_node=4, node_rank=1, master_addr='head', master_port=29500)
    """
    nodes = wanted_nodes(run, contract)
    node_rank = contract.node_rank
    if not 0 <= node_rank < nodes:
        raise UsageError(
            f"${env.NODE_RANK}={node_rank} is outside 0..{nodes - 1} ({nodes} nodes requested)"
        )
    if nodes > 1 and contract.master_addr is None:
        raise UsageError(
            f"{nodes} nodes requested but ${env.MASTER_ADDR} is not set; the operator sets it "
            f"to rank 0's Service (set {env.MASTER_ADDR}, {env.MASTER_PORT} and "
            f"{env.NODE_RANK} by hand when starting the nodes yourself)"
        )
    port = contract.master_port or free_port()
    master_addr = contract.master_addr or "127.0.0.1"
    return WorldPlan(nodes, ranks_per_node(run.spec), node_rank, master_addr, port)


def rendezvous_timeout_s(contract: TrainerEnv) -> int:
    """How long a rendezvous waits for every node (``$POSTTRAIN_RENDEZVOUS_TIMEOUT_S``)."""
    timeout = contract.rendezvous_timeout_s
    return DEFAULT_RENDEZVOUS_TIMEOUT_S if timeout is None else timeout


def gang_run_id(run: TrainingRun, contract: TrainerEnv) -> str:
    """The rendezvous id of this gang incarnation: a restarted gang never joins the old one.

    >>> from types import SimpleNamespace as S
    >>> gang_run_id(S(metadata=S(name="r1")), TrainerEnv(gang=3))
    'r1-3'
    """
    return f"{run.metadata.name}-{contract.gang}"


def rank_out_dir(out_dir: Path, rank: int) -> Path:
    """Rank 0 writes the run's outputs where a single-node run would; rank N under rankN/.

    >>> rank_out_dir(Path("/w"), 0), rank_out_dir(Path("/w"), 2)
    (PosixPath('/w'), PosixPath('/w/rank2'))
    """
    return out_dir if rank == 0 else out_dir / f"rank{rank}"


def under_external_launcher() -> bool:
    """True inside a rank started by someone else's torchrun (it sets these variables)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_RANK" in os.environ


def launch_if_distributed(
    run: TrainingRun, out_dir: Path, contract: TrainerEnv, endpoints: list[str] | None = None
) -> RunResult | None:
    """Train with several ranks when the world has more than one; None otherwise.

    Returns rank 0's :class:`posttrain.trainer.run.loop.RunResult` on the node that ran rank 0;
    on other nodes a result without evaluations. ``endpoints`` defaults to the spec's.
    """
    if under_external_launcher():
        return run_rank(
            run.spec.model_dump(mode="json"),
            str(out_dir.resolve()),
            endpoints or _resolve_endpoints(run.spec, contract),
            contract,
        )
    if contract.ray_address:
        return _launch_on_ray(run, out_dir, endpoints, contract)
    plan = world_plan(run, contract)
    if plan.world_size <= 1:
        return None
    endpoints = endpoints or _resolve_endpoints(run.spec, contract)
    return launch_node(run, out_dir, plan, endpoints, contract)


def _resolve_endpoints(spec: TrainingRunSpec, contract: TrainerEnv) -> list[str]:
    from posttrain.trainer.run.endpoints import rollout_endpoints

    return rollout_endpoints(spec, contract)


def launch_node(
    run: TrainingRun, out_dir: Path, plan: WorldPlan, endpoints: list[str], contract: TrainerEnv
) -> RunResult:
    """Start this node's ranks under torch's elastic agent and wait for them."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    timeout = rendezvous_timeout_s(contract)
    config = LaunchConfig(
        min_nodes=plan.nodes,
        max_nodes=plan.nodes,
        nproc_per_node=plan.ranks_per_node,
        run_id=gang_run_id(run, contract),
        rdzv_backend="static",
        rdzv_endpoint=f"{plan.master_addr}:{plan.master_port}",
        rdzv_configs={"rank": plan.node_rank, "timeout": timeout},
        max_restarts=0,  # a failed rank fails the gang; the operator restarts from a checkpoint
        start_method="spawn",
        monitor_interval=1.0,
    )
    log.info(
        "starting %d rank(s) on node %d of %d (world %d, rendezvous %s:%d)",
        plan.ranks_per_node,
        plan.node_rank,
        plan.nodes,
        plan.world_size,
        plan.master_addr,
        plan.master_port,
    )
    with tracer.start_as_current_span("trainer.distributed_run") as span:
        span.set_attribute("nodes", plan.nodes)
        span.set_attribute("world_size", plan.world_size)
        results = elastic_launch(config, run_rank)(
            run.spec.model_dump(mode="json"), str(out_dir.resolve()), endpoints
        )
    return results[0]


def run_rank(
    spec_json: dict[str, Any],
    out_dir: str,
    endpoints: list[str],
    contract: TrainerEnv | None = None,
) -> RunResult:
    """One rank: join the process group on its device, train, leave. The launcher calls it
    with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment (torch's, not the operator's); the operator's contract
    is parsed here, at the rank process's entry, unless the caller passes it."""
    import torch
    import torch.distributed as dist

    from posttrain.api import TrainingRunSpec
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.model.training_engine import plan_device
    from posttrain.trainer.observe.status import status_reporter
    from posttrain.trainer.run.loop import train

    contract = TrainerEnv.from_env() if contract is None else contract
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    logging.basicConfig(
        level=logging.INFO, format=f"rank{rank} %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = TrainingRunSpec.model_validate(spec_json)
    plan = plan_device(spec.resources.gpus_per_node, local_rank)
    if plan.is_cuda:
        torch.cuda.set_device(plan.device)
    else:  # CPU ranks share the node's cores; more threads than cores spin at barriers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # torchrun leaves joining the group to the rank; Ray Train's TorchConfig has joined it.
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(plan.backend, device_id=plan.device if plan.is_cuda else None)
    elif dist.get_backend() != plan.backend:
        raise RuntimeError(
            f"the launcher's process group uses {dist.get_backend()!r} but this rank computes "
            f"on {plan.device}, which needs {plan.backend!r}"
        )
    context = DistContext(rank, world, local_rank, local_world)
    client = RolloutClient(
        endpoints,
        timeout_s=spec.rollout.timeout_seconds,
        max_in_flight=max(spec.rollout.max_in_flight, spec.algorithm.prompts_per_step),
    )
    out = rank_out_dir(Path(out_dir), rank)
    reporter = status_reporter(out, contract) if context.is_main else None
    try:
        return train(spec, out, client, reporter=reporter, dist=context, contract=contract)
    finally:
        client.close()
        if owns_group:
            dist.destroy_process_group()


# ---------------------------------------------------------------- Ray (RayCluster path)


def assign_nodes(driver_node: str, alive_nodes: list[str], nodes: int) -> list[str]:
    """Node id of each node rank: node 0 is the driver's, the others in a stable order.

    >>> assign_nodes("b", ["c", "a", "b"], 2)
    ['b', 'a']
    >>> assign_nodes("x", ["c", "a"], 2)  # driver outside the cluster (e.g. a laptop)
    ['a', 'c']
    """
    others = sorted(n for n in alive_nodes if n != driver_node)
    order = [driver_node, *others] if driver_node in alive_nodes else others
    return order[:nodes]


def _wait_for_nodes(ray: Any, nodes: int, gpus: int, timeout_s: float) -> list[str]:
    """Ids of alive nodes able to host a node's ranks, once at least ``nodes`` exist."""
    deadline = time.monotonic() + timeout_s
    next_log = 0.0
    while True:
        usable = [
            n["NodeID"]
            for n in ray.nodes()
            if n.get("Alive")
            and n.get("Resources", {}).get("CPU", 0) >= 1
            and n.get("Resources", {}).get("GPU", 0) >= gpus
        ]
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


def ray_placement(placement: list[str], per_node: int) -> list[dict[str, str]]:
    """One Ray label selector per rank: ``per_node`` ranks on each node of ``placement``, in
    node-rank order (Ray Train numbers ranks node by node in this order, so rank 0 is on
    node 0, the driver's).

    >>> ray_placement(["a", "b"], 2)  # doctest: +NORMALIZE_WHITESPACE
    [{'ray.io/node-id': 'a'}, {'ray.io/node-id': 'a'},
     {'ray.io/node-id': 'b'}, {'ray.io/node-id': 'b'}]
    """
    return [{NODE_ID_LABEL: node_id} for node_id in placement for _ in range(per_node)]


NODE_ID_LABEL = "ray.io/node-id"  # the label every Ray node carries with its own id


def ray_rank(config: dict[str, Any]) -> RunResult:
    """One rank under Ray Train: the same entry point torchrun's ranks run.

    Ray Train has already joined the process group (``TorchConfig``) and set ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
    like torchrun; it shows each worker all of its node's GPUs, in GPU id order, so
    ``cuda:<LOCAL_RANK>`` is this worker's own GPU. Rank 0's return value is the
    ``Result.return_value`` the driver gets.
    """
    import ray

    node = ray.get_runtime_context().get_node_id()
    expected = config["placement"][int(os.environ["RANK"]) // config["per_node"]]
    if node != expected:  # Ray Train's rank order changed: rank 0 would not be on node 0
        log.warning(
            "rank %s runs on Ray node %s, planned on %s", os.environ["RANK"], node, expected
        )
    log.info("rank %s on Ray node %s", os.environ["RANK"], node)
    return run_rank(config["spec"], config["out_dir"], config["endpoints"])


def _launch_on_ray(
    run: TrainingRun, out_dir: Path, endpoints: list[str] | None, contract: TrainerEnv
) -> RunResult:
    """Train through Ray Train: a ``TorchTrainer`` with one worker per rank, ``ranks_per_node``
    of them on each of ``nodes`` Ray nodes (node 0 the driver's), no retries."""
    try:
        import ray
        from ray.train.torch import TorchConfig

        # Ray Train V2 (the default since Ray 2.5x; ray.train re-exports it unless
        # RAY_TRAIN_V2_ENABLED=0): label selectors and Result.return_value exist only there,
        # so they are imported from V2 by name.
        from ray.train.v2.api.config import FailureConfig, RunConfig, ScalingConfig
        from ray.train.v2.api.result import Result
        from ray.train.v2.torch.torch_trainer import TorchTrainer

        from posttrain.trainer.run.loop import RunResult
    except ImportError:
        raise UsageError(
            "$RAY_ADDRESS is set but Ray Train is not installed; install posttrain[ray] "
            "(ray[train]) in the trainer image or unset RAY_ADDRESS"
        ) from None

    nodes, per_node = wanted_nodes(run, contract), ranks_per_node(run.spec)
    # Resolved here, on the driver: the workers' environment is the Ray node's, not ours.
    endpoints = endpoints or _resolve_endpoints(run.spec, contract)
    gpus = run.spec.resources.gpus_per_node
    world = nodes * per_node
    ray.init(address=contract.ray_address, log_to_driver=True)
    try:
        with tracer.start_as_current_span("trainer.distributed_run") as span:
            span.set_attribute("nodes", nodes)
            span.set_attribute("world_size", world)
            wait_s = contract.ray_node_wait_s
            wait_s = DEFAULT_NODE_WAIT_S if wait_s is None else wait_s
            alive = _wait_for_nodes(ray, nodes, gpus, wait_s)
            placement = assign_nodes(ray.get_runtime_context().get_node_id(), alive, nodes)
            log.info("starting %d trainer ranks on Ray nodes %s (Ray Train)", world, placement)
            timeout = rendezvous_timeout_s(contract)
            trainer = TorchTrainer(
                ray_rank,
                train_loop_config={
                    "spec": run.spec.model_dump(mode="json"),
                    "out_dir": str(out_dir.resolve()),
                    "endpoints": endpoints,
                    "placement": placement,
                    "per_node": per_node,
                },
                torch_config=TorchConfig(backend="nccl" if gpus else "gloo", timeout_s=timeout),
                scaling_config=ScalingConfig(
                    num_workers=world,
                    use_gpu=gpus > 0,
                    resources_per_worker={"CPU": 1, **({"GPU": 1} if gpus else {})},
                    label_selector=ray_placement(placement, per_node),
                ),
                run_config=RunConfig(
                    name=gang_run_id(run, contract),
                    storage_path=str(out_dir.resolve() / "ray-train"),
                    # A failed rank fails the gang; the operator restarts it from a checkpoint.
                    failure_config=FailureConfig(max_failures=0),
                ),
            )
            result = trainer.fit()
        assert isinstance(result, Result)  # V2's, which fit() returns
        rank0 = result.return_value
        if not isinstance(rank0, RunResult):
            raise RuntimeError(f"Ray Train's rank 0 returned {rank0!r}, not the run's result")
        log.info(
            "distributed run finished on %d nodes; rank 0 did %d steps", nodes, rank0.steps_done
        )
        return rank0
    finally:
        ray.shutdown()
