"""Rollout wait under a demand change: an autoscaled RolloutPool against fixed pools of its
minimum and maximum size (#33).

The same short RL run three times, one after the other in one invocation: on a fixed pool
of ``--min`` replicas, on a fixed pool of ``--max`` replicas, and on a pool the operator's
autoscaler sizes between the two. Half way (after step ``--change-at``) every completion
gets longer (``--tokens-before`` -> ``--tokens-after``), as when a longer-output domain
starts: the min pool falls behind, the max pool keeps up at its full cost.

The parts are the real ones:

* **replicas**: ``posttrain serve`` processes (the CPU engine), each in its own cgroup-v1
  CPU group with a CFS quota of ``--cpu-per-replica`` cores, which is what
  ``resources.limits.cpu`` gives a pod's container. With a quota the replicas' capacities
  add up (four eighth-core replicas are half a core, whatever the machine has), which an
  unlimited process on a small machine does not give: each added replica would take cores
  from the others. A replica started for a scale-up starts under its quota too (imports,
  model load, pull on join from ``--weights-uri``), as a pod does; one removed by a
  scale-down gets SIGTERM and drains what it is generating, as from the kubelet;
* **the trainer**: :func:`posttrain.trainer.run.loop.train`, the loop ``posttrain run``
  runs, with its own rollout producer (``--max-policy-lag``, default 1: the next batch
  samples while the current one trains), its weight publisher (shared memory, every replica on this
  host) and :class:`~posttrain.trainer.observe.rollout_wait.RolloutWaitWindow`, which
  measures the wait and reports ``status.rolloutWait``. It follows the pool as in a cluster
  (``follow_pool`` over the ready replicas, ``catch_up`` before a joiner is sampled from)
  and runs in a CPU group of ``--trainer-cpu`` cores with as many torch threads. The one
  thing the bench adds is the demand change: its client asks for more tokens per
  completion from batch ``--change-at + 1`` on (a randomly initialised model never emits
  EOS, so every completion is exactly that long);
* **the autoscaler**: the operator's own
  :func:`posttrain.operator.rolloutpool.autoscaler.autoscale_pool` (the decision of
  ``autoscale.py`` with the state the reconciler carries in ``status.autoscaling``:
  lastScaleTime, the pending scale-down window), called every ``--period`` seconds, as a
  resync calls it, on the pool's and the run's bodies kept here instead of in an apiserver:
  the run's body carries the trainer's latest ``status.rolloutWait``, ``ready`` is the
  replicas answering ``/health``, and the ``/scale`` patch starts or drains processes.

The controller period (5 s instead of the HPA's 15 s) and the scale-down window (30 s
instead of 300 s) are shortened so that a run of a few minutes can show a decision and its
effect; in a cluster a scale-up also waits for scheduling and an image pull, and a vLLM
replica on a GPU loads for longer than a tiny model on an eighth of a core. Results and
what they show: docs/benchmarks.md, "Autoscaling under a demand change".

    PYTHONPATH=$PWD .venv/bin/python bench/rollout_autoscale.py            # ~9 min
    PYTHONPATH=$PWD .venv/bin/python bench/rollout_autoscale.py --quick    # ~3 min

It needs root and cgroup v1's cpu controller (``/sys/fs/cgroup/cpu``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx

from posttrain.api import RolloutPool, TrainingRunSpec
from posttrain.devenv.process import free_port
from posttrain.models import make_tiny_model
from posttrain.operator.rolloutpool.autoscaler import autoscale_pool
from posttrain.operator.shared.state import Store
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.discovery import follow_pool
from posttrain.trainer.observe.status import LocalStatusReporter, RunStatus
from posttrain.trainer.observe.step_metrics import load_metrics
from posttrain.trainer.run.loop import train

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's cpu controller (this machine's; cgroup v2 would be cpu.max in one tree)."""
CFS_PERIOD_US = 100_000  # the kernel's default, and the kubelet's
NAMESPACE, POOL, RUN = "bench", "bench-pool", "bench-run"


class CpuLimit:
    """A cgroup with a CFS quota of ``cores`` CPUs: a container's ``resources.limits.cpu``.

    Its processes together run at most ``cores * period`` microseconds each period, on any
    core, and are throttled for the rest of it; ``close`` moves what is left to the root
    group and removes the group.
    """

    def __init__(self, name: str, cores: float) -> None:
        self.path = CGROUP_CPU / name
        self.path.mkdir()
        (self.path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(int(cores * CFS_PERIOD_US)))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if not self.path.exists():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):  # it exited meanwhile
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        self.path.rmdir()


@dataclass
class Replica:
    """One ``posttrain serve`` process in its own CPU group (a pod of the pool)."""

    index: int
    url: str
    process: subprocess.Popen[bytes]
    limit: CpuLimit | None  # None: no CPU limit (tests)
    started: float  # time.time()
    ready_at: float | None = None
    draining_at: float | None = None
    exited_at: float | None = None

    def seconds_within(self, start: float, end: float) -> float:
        """Seconds this replica existed (started, not yet exited) within [start, end]."""
        lived_until = min(self.exited_at or end, end)
        return max(0.0, lived_until - max(self.started, start))


class ReplicaProcesses:
    """The pool's replicas: started and drained by :meth:`scale_to` (the Deployment's job),
    probed for readiness every ``probe_s`` (the kubelet's), listed when ready and not
    leaving (the operator's ``status.replicaEndpoints``)."""

    def __init__(
        self, model: Path, weights_uri: str, cores: float, log_dir: Path, probe_s: float = 0.5
    ) -> None:
        self.model, self.weights_uri, self.cores, self.log_dir = model, weights_uri, cores, log_dir
        self.replicas: list[Replica] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._probe_s = probe_s
        self._http = httpx.Client(timeout=2.0)
        self._prober = threading.Thread(target=self._probe, name="readiness", daemon=True)
        self._prober.start()

    def _start(self) -> Replica:
        index = len(self.replicas)
        limit = (
            CpuLimit(f"posttrain-asbench-{os.getpid()}-{index}", self.cores) if self.cores else None
        )
        port = free_port()
        with (self.log_dir / f"replica-{index}.log").open("wb") as log:  # the child keeps it
            process = subprocess.Popen(
                [sys.executable, "-m", "posttrain", "serve", "--model", str(self.model),
                 "--weights-uri", self.weights_uri, "--host", "127.0.0.1", "--port", str(port),
                 "--threads", "1"],
                env=dict(os.environ, POSTTRAIN_NUM_THREADS="1"), stdout=log, stderr=log,
            )  # fmt: skip
        if limit is not None:
            limit.add(process.pid)  # within milliseconds of its start, before its imports
        replica = Replica(index, f"http://127.0.0.1:{port}", process, limit, time.time())
        self.replicas.append(replica)
        return replica

    def scale_to(self, count: int) -> None:
        """Start replicas up to ``count``, or drain the surplus: not-ready ones first, then
        the newest (a ReplicaSet's order)."""
        with self._lock:
            live = [r for r in self.replicas if r.draining_at is None]
            for _ in range(count - len(live)):
                self._start()
            surplus = sorted(live, key=lambda r: (r.ready_at is not None, -r.started))
            for replica in surplus[: max(0, len(live) - count)]:
                replica.draining_at = time.time()
                replica.process.send_signal(signal.SIGTERM)

    def endpoints(self) -> list[str]:
        """The ready replicas that are not leaving (``status.replicaEndpoints``)."""
        with self._lock:
            return [r.url for r in self.replicas if r.ready_at and r.draining_at is None]

    def ready(self) -> int:
        """The Deployment's ``readyReplicas``: ready and not terminating."""
        return len(self.endpoints())

    def wait_ready(self, count: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready() < count:
            for replica in self.replicas:
                if replica.process.poll() is not None and replica.draining_at is None:
                    raise RuntimeError(f"replica {replica.index} exited; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} replica(s) not ready after {timeout_s:.0f}s")
            time.sleep(0.2)

    def _probe(self) -> None:
        while not self._stop.wait(self._probe_s):
            with self._lock:
                replicas = list(self.replicas)
            for replica in replicas:
                if replica.exited_at is None and replica.process.poll() is not None:
                    replica.exited_at = time.time()
                if replica.ready_at is not None or replica.exited_at is not None:
                    continue
                try:
                    if self._http.get(f"{replica.url}/health").status_code == 200:
                        replica.ready_at = time.time()
                except httpx.HTTPError:
                    pass

    def replica_seconds(self, start: float, end: float) -> float:
        with self._lock:
            return sum(r.seconds_within(start, end) for r in self.replicas)

    def close(self) -> None:
        self._stop.set()
        self._prober.join(timeout=5)
        for replica in self.replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                replica.process.kill()
                replica.process.wait(timeout=10)
            if replica.limit is not None:
                replica.limit.close()
        self._http.close()


class DemandShift(RolloutClient):
    """The trainer's client, asking for ``tokens_after`` tokens per completion from batch
    ``change_at + 1`` on: the demand change. The batch is read from the sampling seed the
    trainer gives it (``RolloutFeed.submit_ahead``: ``seed * 1_000_003 + batch``).

    It also times each weight load (the publish's wait for every replica to serve the new
    version): a replica swaps weights only once its running batch is done, so with
    ``maxPolicyLag >= 1`` a publish waits there for the next batch's sampling.
    """

    def __init__(
        self, urls: list[str], *, run_seed: int, change_at: int, tokens: tuple[int, int],
        **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(urls, **kwargs)
        self.run_seed, self.change_at, self.tokens = run_seed, change_at, tokens
        self.load_seconds: dict[int, float] = {}  # weight version (= step) -> seconds

    def generate(self, prompt_token_ids: list[list[int]], params: Any) -> Any:
        batch = params.seed - self.run_seed * 1_000_003
        tokens = self.tokens[0] if batch <= self.change_at else self.tokens[1]
        return super().generate(prompt_token_ids, replace(params, max_tokens=tokens))

    def load_weights(self, uri: str, version: int) -> None:
        started = time.monotonic()
        super().load_weights(uri, version)
        self.load_seconds[version] = time.monotonic() - started


class SignalTap(LocalStatusReporter):
    """``status.json`` as a local run writes it, keeping the last ``status.rolloutWait`` (what
    the operator reads from the TrainingRun) and when each step was reported."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(out_dir)
        self.rollout_wait: dict[str, Any] | None = None
        self.reported_at: dict[int, float] = {}  # step -> time.time()

    def report(self, status: RunStatus) -> None:
        super().report(status)
        self.rollout_wait = dict(status.rollout_wait) if status.rollout_wait else None
        self.reported_at.setdefault(status.step, time.time())


@dataclass
class ScaleEvent:
    at: float  # time.time()
    reason: str
    message: str


class PoolScaleWriter:
    """What :func:`autoscale_pool` calls on the apiserver: ``path_of`` and the ``/scale``
    patch, which here sets the body's ``spec.replicas`` and resizes the processes."""

    def __init__(self, body: dict[str, Any], processes: ReplicaProcesses) -> None:
        self.body, self.processes = body, processes

    def path_of(self, manifest: dict[str, Any], with_name: bool = False) -> str:
        meta = manifest["metadata"]
        return f"rolloutpools/{meta['namespace']}/{meta['name'] if with_name else ''}"

    def patch(self, path: str, patch: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        assert subresource == "scale", f"only /scale is patched, not {path}/{subresource}"
        replicas = int(patch["spec"]["replicas"])
        self.body["spec"]["replicas"] = replicas
        self.processes.scale_to(replicas)
        return self.body


class BenchReconciler:
    """The pool reconcile's autoscaling step every ``period`` seconds (a resync's), with the
    operator's own :func:`autoscale_pool` on the pool's and the run's bodies."""

    def __init__(
        self, pool_body: dict[str, Any], run_spec: TrainingRunSpec, tap: SignalTap,
        processes: ReplicaProcesses, period: float,
    ) -> None:  # fmt: skip
        self.pool_body, self.tap, self.processes, self.period = (
            pool_body, tap, processes, period)  # fmt: skip
        self.run_spec = run_spec.to_wire()
        self.state = SimpleNamespace(runs=Store(), kube=PoolScaleWriter(pool_body, processes))
        self.events: list[ScaleEvent] = []
        self._version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.reconcile()

    def reconcile(self) -> None:
        self._version += 1
        wait = self.tap.rollout_wait
        self.state.runs.put({
            "apiVersion": "posttrain.io/v1alpha1", "kind": "TrainingRun",
            "metadata": {"name": RUN, "namespace": NAMESPACE, "uid": "run",
                         "resourceVersion": str(self._version)},
            "spec": self.run_spec,
            "status": {"phase": "Running", **({"rolloutWait": wait} if wait else {})},
        })  # fmt: skip
        pool = RolloutPool.model_validate(self.pool_body)
        result = autoscale_pool(self.state, pool, self.pool_body, self.processes.ready())
        if result.status_patch is not None:  # merge patch: null deletes
            status = self.pool_body.setdefault("status", {})
            wire = result.status_patch["autoscaling"]
            status["autoscaling"] = (
                {k: v for k, v in wire.items() if v is not None} if wire else None
            )
        for event in result.events:
            self.events.append(ScaleEvent(time.time(), event.reason, event.message))
            print(f"    step {max(self.tap.reported_at, default=0)}: {event.reason}: "
                  f"{event.message}", flush=True)  # fmt: skip


@dataclass
class Outcome:
    name: str
    steps: int
    seconds: float
    wait: tuple[float, float, float]  # fraction overall, before, after the change
    publish: tuple[float, float, float]  # the weight loads' share of step time, the same
    phase_seconds: tuple[float, float]
    mean_replicas: tuple[float, float, float]  # overall, before, after
    start: float = 0.0  # time.time() of the first step's start
    events: list[ScaleEvent] = field(default_factory=list)
    joins: list[float] = field(default_factory=list)  # start -> ready, of replicas added

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds


def trainer_spec(model: Path, args: argparse.Namespace) -> TrainingRunSpec:
    return TrainingRunSpec.model_validate({
        "model": str(model),
        "algorithm": {
            "groupSize": args.group_size, "promptsPerStep": args.prompts, "maxSteps": args.steps,
            "learningRate": 1e-5, "maxNewTokens": max(args.tokens_before, args.tokens_after),
            "microBatchSize": args.micro_batch, "dynamicSampling": False,
            "maxPolicyLag": args.max_policy_lag,
            "seed": 0,
        },
        "domains": [{"name": "arithmetic", "dataset": "builtin:arithmetic",
                     "verifier": {"kind": "numeric"}}],
        "rollout": {"pool": POOL, "timeoutSeconds": 300, "maxInFlight": args.prompts},
        "evaluation": {"inline": False},
        "checkpoint": {"everySteps": 1_000_000, "keepLast": 1},
    })  # fmt: skip


def pool_body(model: Path, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "apiVersion": "posttrain.io/v1alpha1", "kind": "RolloutPool",
        "metadata": {"name": POOL, "namespace": NAMESPACE, "uid": "pool"},
        "spec": {
            "model": str(model), "engine": "cpu", "replicas": replicas,
            "autoscaling": {
                "minReplicas": args.min, "maxReplicas": args.max,
                "targetRolloutWaitFraction": args.target,
                "scaleDownStabilizationSeconds": args.scale_down_window,
            },
        },
        "status": {},
    }  # fmt: skip


def wait_fraction(metrics: list[dict[str, Any]]) -> float:
    """Seconds blocked on rollouts over step seconds, as the trainer's window sums them."""
    total = sum(m["step_seconds"] for m in metrics)
    return sum(m["rollout_wait_seconds"] for m in metrics) / total if total else 0.0


def load_fraction(metrics: list[dict[str, Any]], load_seconds: dict[int, float]) -> float:
    """Seconds the steps' publishes waited for the replicas to load, over step seconds."""
    total = sum(m["step_seconds"] for m in metrics)
    loads = sum(load_seconds.get(m["weight_version"], 0.0) for m in metrics)
    return loads / total if total else 0.0


def run_configuration(
    name: str, replicas: int, autoscaled: bool, model: Path, args: argparse.Namespace, work: Path
) -> Outcome:
    out = work / name
    out.mkdir(parents=True)
    spec = trainer_spec(model, args)
    processes = ReplicaProcesses(model, str(out / "weights"), args.cpu_per_replica, out)
    following = None
    client = None
    reconciler = None
    try:
        started = time.monotonic()
        processes.scale_to(replicas)
        processes.wait_ready(replicas)
        print(f"  {name}: {replicas} replica(s) ready in {time.monotonic() - started:.0f}s",
              flush=True)  # fmt: skip
        client = DemandShift(
            processes.endpoints(), run_seed=spec.algorithm.seed, change_at=args.change_at,
            tokens=(args.tokens_before, args.tokens_after), timeout_s=300,
            max_in_flight=args.prompts, discover=processes.endpoints,
        )  # fmt: skip
        tap = SignalTap(out)
        following = follow_pool(client, processes.endpoints)  # the trainer's, 5 s
        if autoscaled:
            reconciler = BenchReconciler(
                pool_body(model, replicas, args), spec, tap, processes, args.period
            )
            reconciler.start()
        result = train(spec, out, client, reporter=tap)
        assert result.steps_done == args.steps, result
    finally:
        if reconciler is not None:
            reconciler.stop()
        if following is not None:
            following.set()
        if client is not None:
            client.close()
        processes.close()
    return summarize(name, load_metrics(out), tap, processes, reconciler, client, args)


def summarize(
    name: str, metrics: list[dict[str, Any]], tap: SignalTap, processes: ReplicaProcesses,
    reconciler: BenchReconciler | None, client: DemandShift, args: argparse.Namespace,
) -> Outcome:  # fmt: skip
    """The run's window: from its first step's start to its last step's report."""
    end = tap.reported_at[args.steps]
    start = tap.reported_at[1] - metrics[0]["step_seconds"]
    change = tap.reported_at[args.change_at]
    before = [m for m in metrics if m["step"] <= args.change_at]
    after = [m for m in metrics if m["step"] > args.change_at]

    def mean_replicas(a: float, b: float) -> float:
        return processes.replica_seconds(a, b) / (b - a)

    initial = {r.index for r in processes.replicas if r.started <= start}
    return Outcome(
        name, len(metrics), end - start,
        (wait_fraction(metrics), wait_fraction(before), wait_fraction(after)),
        tuple(load_fraction(part, client.load_seconds) for part in (metrics, before, after)),
        (change - start, end - change),
        (mean_replicas(start, end), mean_replicas(start, change), mean_replicas(change, end)),
        start,
        reconciler.events if reconciler is not None else [],
        [r.ready_at - r.started for r in processes.replicas
         if r.index not in initial and r.ready_at is not None],
    )  # fmt: skip


def print_outcome(outcome: Outcome) -> None:
    wait, before, after = outcome.wait
    load, load_before, load_after = outcome.publish
    mean, mean_before, mean_after = outcome.mean_replicas
    print(f"  {outcome.name}: rollout wait {wait:.3f} of step time ({before:.3f} before the "
          f"change, {after:.3f} after); weight loads {load:.3f} ({load_before:.3f}, "
          f"{load_after:.3f}); mean replicas {mean:.2f} ({mean_before:.2f} before, "
          f"{mean_after:.2f} after); {outcome.steps_per_second:.3f} steps/s ({outcome.steps} "
          f"steps in {outcome.seconds:.0f}s: {outcome.phase_seconds[0]:.0f}s before, "
          f"{outcome.phase_seconds[1]:.0f}s after)")  # fmt: skip
    for event in outcome.events:
        print(f"    t={event.at - outcome.start:6.1f}s {event.reason}: {event.message}")
    if outcome.joins:
        print(f"    replicas added: ready {', '.join(f'{s:.1f}s' for s in outcome.joins)} "
              "after their start")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--change-at", type=int, default=None, help="default: steps / 2")
    parser.add_argument("--tokens-before", type=int, default=8)
    parser.add_argument("--tokens-after", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-policy-lag", type=int, default=1, help="algorithm.maxPolicyLag")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--min", type=int, default=1, help="autoscaling.minReplicas")
    parser.add_argument("--max", type=int, default=4, help="autoscaling.maxReplicas")
    parser.add_argument("--target", type=float, default=0.1, help="targetRolloutWaitFraction")
    parser.add_argument("--period", type=float, default=5.0, help="autoscaler period, s")
    parser.add_argument("--scale-down-window", type=int, default=30, help="seconds")
    parser.add_argument(
        "--cpu-per-replica", type=float, default=0.125, help="CFS quota, cores (0: none)"
    )
    parser.add_argument("--trainer-cpu", type=float, default=1.0, help="CFS quota, cores")
    parser.add_argument("--layers", type=int, default=2, help="of the tiny model")
    parser.add_argument("--hidden", type=int, default=64, help="of the tiny model")
    parser.add_argument("--only", choices=["min", "max", "autoscaled"], action="append")
    parser.add_argument("--keep", action="store_true", help="keep the runs' outputs")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.tokens_after, args.period, args.scale_down_window = 10, 32, 2.0, 10
    args.change_at = args.change_at or args.steps // 2
    return args


def main() -> int:
    args = parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    print(f"command: {' '.join(sys.orig_argv)}")
    print(f"date: {datetime.now().astimezone().isoformat(timespec='seconds')}  commit: {commit}")
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}  cores: {os.cpu_count()}")

    import torch

    torch.set_num_threads(max(1, round(args.trainer_cpu)))
    trainer_limit = CpuLimit(f"posttrain-asbench-{os.getpid()}-trainer", args.trainer_cpu)
    trainer_limit.add(os.getpid())
    work = Path(tempfile.mkdtemp(prefix="rollout-autoscale-"))
    try:
        model = make_tiny_model(work / "model", seed=0, num_layers=args.layers,
                                hidden_size=args.hidden)  # fmt: skip
        print(f"model: randomly initialised Llama (SmolLM2's architecture and tokenizer), "
              f"{args.layers} layers, hidden {args.hidden}; CPU engine (posttrain serve), "
              f"{args.cpu_per_replica:g} core per replica (CFS quota), trainer "
              f"{args.trainer_cpu:g} core, {torch.get_num_threads()} torch thread(s)")  # fmt: skip
        print(f"run: {args.steps} RL steps of {args.prompts} prompts x {args.group_size}, "
              f"maxPolicyLag {args.max_policy_lag}; completions {args.tokens_before} tokens, from step "
              f"{args.change_at + 1} on {args.tokens_after}")  # fmt: skip
        print(
            f"autoscaling: minReplicas {args.min}, maxReplicas {args.max}, "
            f"targetRolloutWaitFraction {args.target:g}, tolerance 0.1, every "
            f"{args.period:g}s, scaleDownStabilizationSeconds {args.scale_down_window}"
        )
        configurations = [("min", args.min, False), ("max", args.max, False),
                          ("autoscaled", args.min, True)]  # fmt: skip
        outcomes: dict[str, Outcome] = {}
        for name, replicas, autoscaled in configurations:
            if args.only and name not in args.only:
                continue
            print(f"{name}: {'autoscaled from ' if autoscaled else 'fixed, '}{replicas} "
                  "replica(s)", flush=True)  # fmt: skip
            outcomes[name] = run_configuration(name, replicas, autoscaled, model, args, work)
            print_outcome(outcomes[name])
    finally:
        trainer_limit.close()
        if args.keep:
            print(f"outputs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print("summary:")
    for outcome in outcomes.values():
        print_outcome(outcome)
    if {"min", "max", "autoscaled"} <= outcomes.keys():
        auto, low, high = outcomes["autoscaled"], outcomes["min"], outcomes["max"]
        print(f"autoscaled vs min: rollout wait after the change {auto.wait[2]:.3f} vs "
              f"{low.wait[2]:.3f}, overall {auto.wait[0]:.3f} vs {low.wait[0]:.3f}; steps/s "
              f"x{auto.steps_per_second / low.steps_per_second:.2f}")  # fmt: skip
        print(f"autoscaled vs max: replica-seconds x"
              f"{auto.mean_replicas[0] * auto.seconds / (high.mean_replicas[0] * high.seconds):.2f}"
              f", mean replicas {auto.mean_replicas[0]:.2f} vs {high.mean_replicas[0]:.2f}; "
              f"steps/s x{auto.steps_per_second / high.steps_per_second:.2f}")  # fmt: skip
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
