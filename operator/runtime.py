"""Run the operator: in the foreground (CLI) or in a background thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Callable

import kopf
import uvloop

from posttrain.api import API_VERSION
from posttrain.api.labels import COMPONENT_ROLLOUT, COMPONENT_TRAINER, LABEL_COMPONENT
from posttrain.telemetry import start_metrics_server

from .config import OperatorConfig
from .controllers import Controller
from .events import EventRecorder
from .health import start_health_server
from .informer import Body, Gate, Informer
from .kube import PLURALS, AsyncKube, KubeClient, load_credentials
from .leader import LeaseGate
from .settings import EVENT_COMPONENT, build_settings, quiet_per_request_logs
from .trainingrun.kueue import KUEUE_API_VERSION
from .trainingrun.raycluster import RAY_API_VERSION

log = logging.getLogger(__name__)


def build_memo(config: OperatorConfig) -> kopf.Memo:
    """Credentials, the shared REST clients, the Event recorder and the controller, handed to
    every handler."""
    creds = load_credentials(config.kubeconfig)
    kube = KubeClient(
        creds,
        pool_size=config.max_workers + 8,
        timeout=config.request_timeout,
        reload=lambda: load_credentials(config.kubeconfig),
    )
    akube = AsyncKube(
        creds,
        pool_size=config.max_workers + 8,
        timeout=config.request_timeout,
        reload=lambda: load_credentials(config.kubeconfig),
    )
    events = EventRecorder(kube, EVENT_COMPONENT)
    controller = Controller(config, kube, events.post)
    return kopf.Memo(
        config=config, credentials=creds, controller=controller, akube=akube, events=events
    )


async def run_async(
    config: OperatorConfig,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    memo: kopf.Memo | None = None,
) -> None:
    """Run until ``stop_flag`` is set (or forever)."""
    from .handlers import REGISTRY

    memo = memo if memo is not None else build_memo(config)
    if config.log_level != "DEBUG":
        quiet_per_request_logs()
    settings = build_settings(config)
    # The async handlers run their blocking reconciles on kopf's own pool (max_workers).
    memo.executor = settings.execution.executor
    memo.inflight = set()
    memo.task_queue = {}  # SandboxTasks being reconciled -> asked again meanwhile
    gate = Gate() if config.standalone else build_lease_gate(memo, config)
    memo.gate = gate
    bind_requeue(memo, gate)
    # Before kopf's tasks: its start-up may report ready before spawn_tasks returns.
    bind_optional_informers(memo, config, gate)
    # Ours, not Kopf's (health.py); first, so a taken port fails before anything started.
    health = await start_health_server(config.liveness_port, gate)
    try:
        # kopf.operator() is spawn_tasks + run_tasks; split here to add the informers (and
        # the leader election, which they follow) as one more root task.
        existing = asyncio.all_tasks()
        tasks = await kopf.spawn_tasks(
            registry=REGISTRY,
            settings=settings,
            clusterwide=config.all_namespaces,
            namespaces=list(config.watched_namespaces),
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            memo=memo,
        )
        informers = asyncio.create_task(
            run_informers(memo, config, gate), name="posttrain informers"
        )
        await kopf.run_tasks([*tasks, informers], ignored=existing)
    finally:
        memo.controller.state.requeue.unbind()
        if health is not None:
            await health.cleanup()


def build_lease_gate(memo: kopf.Memo, config: OperatorConfig) -> LeaseGate:
    """The leader election of this replica, on the Lease ``config.lease_name`` in the
    operator's namespace (run by :func:`run_informers`)."""
    return LeaseGate(
        memo.akube,
        config.lease_namespace,
        config.lease_name,
        config.lease_identity,
        lease_duration_s=config.lease_duration_seconds,
        renew_deadline_s=config.lease_renew_deadline_seconds,
        retry_period_s=config.lease_retry_period_seconds,
    )


def bind_requeue(memo: kopf.Memo, gate: Gate) -> None:
    """Failed reconciles retry on this loop: a due retry runs its kind's reconcile on the
    reconciler threads (a failure there requeues it again, with a longer delay). A replica
    that is not the leader drops its due retries: the leader lists everything."""
    loop = asyncio.get_running_loop()
    controller: Controller = memo.controller

    def retry(kind: str, namespace: str, name: str) -> None:
        if not gate.is_open():
            log.info("%s %s/%s: retry dropped (not the leader)", kind, namespace, name)
            return
        future = loop.run_in_executor(
            memo.executor, controller.reconciler_of(kind), namespace, name
        )
        # Its failure was logged and requeued inside the reconcile; only consume it here.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())

    controller.state.requeue.bind(loop, retry)


def bind_optional_informers(memo: kopf.Memo, config: OperatorConfig, gate: Gate) -> None:
    """KubeRay's and Kueue's informers follow API discovery of their CRDs (started by
    :func:`run_informers`' first discovery, a reconcile's or a resync's)."""
    optional = OptionalInformers(build_optional_informers(memo, config), gate)
    memo.optional_informers = optional
    controller: Controller = memo.controller
    controller.training_runs.kuberay.watch(optional.follow("RayCluster"))
    controller.training_runs.kueue.discovery.watch(optional.follow("Workload"))


def _namespaces(config: OperatorConfig) -> list[str | None]:
    return [None] if config.all_namespaces else list(config.watched_namespaces)


def _informer(
    memo: kopf.Memo,
    config: OperatorConfig,
    api_version: str,
    kind: str,
    on_event: Callable[[kopf.Memo, str, Body], None],
    namespace: str | None,
    label_selector: str = "",
) -> Informer:
    return Informer(
        memo.akube,
        api_version,
        kind,
        PLURALS[kind],
        namespace,
        on_event=lambda event, body: on_event(memo, event, body),
        label_selector=label_selector,
        server_timeout=config.watch_server_timeout,
        client_timeout=config.watch_client_timeout,
    )


def build_informers(memo: kopf.Memo, config: OperatorConfig) -> list[Informer]:
    """The watches of our kinds and their children: TrainingRuns, SandboxTasks, RolloutPools,
    SandboxWarmPools, labelled pods and rollout Deployments, per watched namespace or
    cluster-wide (KubeRay's and Kueue's kinds: :func:`build_optional_informers`)."""
    from . import handlers

    rollout = f"{LABEL_COMPONENT}={COMPONENT_ROLLOUT}"
    informers = []
    for ns in _namespaces(config):
        informers += [
            _informer(memo, config, API_VERSION, "TrainingRun", handlers.on_training_run, ns),
            _informer(memo, config, API_VERSION, "SandboxTask", handlers.on_sandbox_task, ns),
            _informer(memo, config, "v1", "Pod", handlers.on_pod, ns, LABEL_COMPONENT),
            _informer(memo, config, API_VERSION, "RolloutPool", handlers.on_rollout_pool, ns),
            _informer(memo, config, API_VERSION, "SandboxWarmPool", handlers.on_warm_pool, ns),
            _informer(memo, config, "apps/v1", "Deployment", handlers.on_deployment, ns, rollout),
        ]
    return informers


def build_optional_informers(memo: kopf.Memo, config: OperatorConfig) -> dict[str, list[Informer]]:
    """The watches of kinds whose CRD may be missing, by kind: KubeRay's RayClusters and
    Kueue's Workloads labelled as a trainer's (run by :class:`OptionalInformers`)."""
    from . import handlers

    trainer = f"{LABEL_COMPONENT}={COMPONENT_TRAINER}"
    namespaces = _namespaces(config)
    return {
        "RayCluster": [
            _informer(
                memo, config, RAY_API_VERSION, "RayCluster", handlers.on_ray_cluster, ns, trainer
            )
            for ns in namespaces
        ],
        "Workload": [
            _informer(
                memo, config, KUEUE_API_VERSION, "Workload", handlers.on_workload, ns, trainer
            )
            for ns in namespaces
        ],
    }


class OptionalInformers:
    """Informers of a kind whose CRD may be installed after the operator started, or removed:
    KubeRay's RayClusters and Kueue's Workloads. API discovery (shared/discovery.py) tells
    :meth:`follow`'s callback when it finds or loses the CRD; the kind's informers are
    started or stopped then, on the loop, behind the same gate as every other informer.
    Stopped and started again, an informer lists again and reports what vanished meanwhile."""

    def __init__(self, informers: dict[str, list[Informer]], gate: Gate) -> None:
        self.informers = informers
        self.gate = gate
        self._loop = asyncio.get_running_loop()
        self._running: dict[str, list[asyncio.Task[None]]] = {}

    def follow(self, kind: str) -> Callable[[bool], None]:
        """The discovery callback for ``kind`` (any thread; it never blocks)."""

        def changed(installed: bool) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: shutting down
                self._loop.call_soon_threadsafe(self._set, kind, installed)

        return changed

    def running(self, kind: str) -> bool:
        return kind in self._running

    def _set(self, kind: str, installed: bool) -> None:
        if installed and kind not in self._running:
            log.info("watching %s (API discovery found its CRD)", kind)
            self._running[kind] = [
                asyncio.create_task(informer.run(self.gate), name=informer.name)
                for informer in self.informers[kind]
            ]
        elif not installed and kind in self._running:
            log.info("no longer watching %s (its CRD is gone)", kind)
            for task in self._running.pop(kind):
                task.cancel()

    async def close(self) -> None:
        """Stop every informer (shutdown)."""
        tasks = [task for kind in list(self._running) for task in self._running.pop(kind)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_informers(memo: kopf.Memo, config: OperatorConfig, gate: Gate) -> None:
    """The informers until cancelled (at shutdown), then close their HTTP session. KubeRay's
    and Kueue's start when API discovery finds their CRDs: asked once now, then by
    reconciles that need the answer and at each resync (each answer cached for its period)."""
    memo.informers = build_informers(memo, config)
    optional: OptionalInformers = memo.optional_informers
    discovered = asyncio.get_running_loop().run_in_executor(memo.executor, memo.controller.discover)
    # The election runs beside the informers and stops after them, so the Lease is released
    # (a successor need not wait it out) only once this replica no longer watches.
    leading = (
        asyncio.create_task(gate.run(), name="leader election")
        if isinstance(gate, LeaseGate)
        else None
    )
    try:
        await asyncio.gather(*(informer.run(gate) for informer in memo.informers))
    finally:
        await optional.close()
        for task in [*memo.inflight, discovered]:
            task.cancel()
        await asyncio.gather(*memo.inflight, discovered, return_exceptions=True)
        if leading is not None:
            leading.cancel()
            await asyncio.gather(leading, return_exceptions=True)
        await memo.akube.close()


def run_forever(config: OperatorConfig) -> None:
    """The CLI's entry: metrics server, then kopf until SIGINT/SIGTERM."""
    logging.getLogger().setLevel(config.log_level)
    start_metrics_server(config.metrics_port)
    where = "all namespaces" if config.all_namespaces else ", ".join(config.watched_namespaces)
    log.info(
        "posttrain operator watching %s (%s)",
        where,
        "standalone"
        if config.standalone
        else f"leader election on Lease {config.lease_namespace}/{config.lease_name} "
        f"as {config.lease_identity}",
    )

    # What exists now (every module, the config, the clients) lives as long as the process:
    # frozen, the cyclic GC's full passes skip it (a 500-task burst triggers a few, 0.1 s each
    # over ~110k objects otherwise).
    gc.freeze()
    uvloop.run(run_async(config))


class OperatorThread:
    """The real operator in a background thread: ``with OperatorThread(config) as op: ...``.

    Used by the tests (the operator in-process against the real apiserver) and the
    benchmark; ``stop()`` then ``start()`` again simulates an operator restart.
    """

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.memo: kopf.Memo | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def controller(self) -> Controller:
        assert self.memo is not None, "start() the operator first"
        return self.memo.controller  # type: ignore[no-any-return]

    def start(self, timeout_s: float = 30.0) -> OperatorThread:
        self._stop, self._ready, self._error = threading.Event(), threading.Event(), None
        self.memo = build_memo(self.config)

        def target() -> None:
            try:
                uvloop.run(run_async(self.config, self._stop, self._ready, self.memo))
            except BaseException as exc:  # surfaced by start()/stop()
                self._error = exc

        self._thread = threading.Thread(target=target, name="posttrain-operator", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"operator not ready after {timeout_s} s: {self._error!r}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"operator thread still running after {timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"operator stopped with an error: {self._error!r}")

    def __enter__(self) -> OperatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
