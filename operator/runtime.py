"""Run the operator: in the foreground (CLI) or in a background thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable

import kopf
import uvloop

from posttrain.api import API_VERSION
from posttrain.api.labels import COMPONENT_ROLLOUT, LABEL_COMPONENT
from posttrain.telemetry import start_metrics_server

from .config import OperatorConfig
from .controllers import Controller
from .events import EventRecorder
from .informer import Body, Gate, Informer, PeeringGate
from .kube import AsyncKube, KubeClient, load_credentials
from .settings import EVENT_COMPONENT, build_settings, quiet_per_request_logs

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
    liveness = f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port else None
    settings = build_settings(config)
    # The async handlers run their blocking reconciles on kopf's own pool (max_workers).
    memo.executor = settings.execution.executor
    memo.inflight = set()
    memo.task_queue = {}  # SandboxTasks being reconciled -> asked again meanwhile
    # kopf.operator() is spawn_tasks + run_tasks; split here to add the informers as one
    # more root task, gated by kopf's peering (read from the peering objects: PeeringGate).
    existing = asyncio.all_tasks()
    tasks = await kopf.spawn_tasks(
        registry=REGISTRY,
        # Peering is configured only through settings: passing peering_name here would make
        # peering mandatory even for --standalone.
        settings=settings,
        clusterwide=config.all_namespaces,
        namespaces=list(config.watched_namespaces),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=memo,
        liveness_endpoint=liveness,
    )
    gate = (
        Gate()
        if config.standalone
        else PeeringGate(
            config.peering_name,
            None if config.all_namespaces else config.watched_namespaces,
            config.priority,
        )
    )
    bind_requeue(memo, gate)
    informers = asyncio.create_task(run_informers(memo, config, gate), name="posttrain informers")
    try:
        await kopf.run_tasks([*tasks, informers], ignored=existing)
    finally:
        memo.controller.state.requeue.unbind()


def bind_requeue(memo: kopf.Memo, gate: Gate) -> None:
    """Failed reconciles retry on this loop: a due retry runs its kind's reconcile on the
    reconciler threads (a failure there requeues it again, with a longer delay). A replica
    that peering paused drops its due retries: the replica working now lists everything."""
    loop = asyncio.get_running_loop()
    controller: Controller = memo.controller

    def retry(kind: str, namespace: str, name: str) -> None:
        if not gate.is_open():
            log.info("%s %s/%s: retry dropped (paused by peering)", kind, namespace, name)
            return
        future = loop.run_in_executor(
            memo.executor, controller.reconciler_of(kind), namespace, name
        )
        # Its failure was logged and requeued inside the reconcile; only consume it here.
        future.add_done_callback(lambda done: done.cancelled() or done.exception())

    controller.state.requeue.bind(loop, retry)


def build_informers(memo: kopf.Memo, config: OperatorConfig) -> list[Informer]:
    """Every watch but kopf's (RayClusters, Workloads): TrainingRuns, SandboxTasks,
    RolloutPools, SandboxWarmPools, labelled pods and rollout Deployments, per watched
    namespace or cluster-wide."""
    namespaces: list[str | None] = (
        [None] if config.all_namespaces else list(config.watched_namespaces)
    )
    from . import handlers

    def watching(
        api_version: str,
        kind: str,
        plural: str,
        on_event: Callable[[kopf.Memo, str, Body], None],
        namespace: str | None,
        label_selector: str = "",
    ) -> Informer:
        return Informer(
            memo.akube,
            api_version,
            kind,
            plural,
            namespace,
            on_event=lambda event, body: on_event(memo, event, body),
            label_selector=label_selector,
            server_timeout=config.watch_server_timeout,
            client_timeout=config.watch_client_timeout,
        )

    informers = []
    for ns in namespaces:
        informers += [
            watching(API_VERSION, "TrainingRun", "trainingruns", handlers.on_training_run, ns),
            watching(API_VERSION, "SandboxTask", "sandboxtasks", handlers.on_sandbox_task, ns),
            watching("v1", "Pod", "pods", handlers.on_pod, ns, LABEL_COMPONENT),
            watching(API_VERSION, "RolloutPool", "rolloutpools", handlers.on_rollout_pool, ns),
            watching(API_VERSION, "SandboxWarmPool", "sandboxwarmpools", handlers.on_warm_pool, ns),
            watching(
                "apps/v1",
                "Deployment",
                "deployments",
                handlers.on_deployment,
                ns,
                f"{LABEL_COMPONENT}={COMPONENT_ROLLOUT}",
            ),
        ]
    return informers


async def run_informers(memo: kopf.Memo, config: OperatorConfig, gate: Gate) -> None:
    """The informers until cancelled (at shutdown), then close their HTTP session."""
    memo.informers = build_informers(memo, config)
    # The peering objects are watched whatever the gate says: they are how it opens.
    peering = (
        gate.informers(memo.akube, config.watch_server_timeout, config.watch_client_timeout)
        if isinstance(gate, PeeringGate)
        else []
    )
    try:
        await asyncio.gather(
            *(informer.run(gate) for informer in memo.informers),
            *(informer.run(Gate()) for informer in peering),
        )
    finally:
        for task in list(memo.inflight):
            task.cancel()
        await asyncio.gather(*memo.inflight, return_exceptions=True)
        await memo.akube.close()


def run_forever(config: OperatorConfig) -> None:
    """The CLI's entry: metrics server, then kopf until SIGINT/SIGTERM."""
    logging.getLogger().setLevel(config.log_level)
    start_metrics_server(config.metrics_port)
    where = "all namespaces" if config.all_namespaces else ", ".join(config.watched_namespaces)
    log.info(
        "posttrain operator watching %s (%s)",
        where,
        "standalone" if config.standalone else f"peering {config.peering_name}",
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
