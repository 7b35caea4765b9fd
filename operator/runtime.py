"""Run the operator: in the foreground (CLI) or in a background thread (tests, benchmarks).

The operator is one asyncio loop of its own (uvloop) and one thread pool of its own (no
framework, docs/operator.md "One event path"): on the loop the informers, the Lease election
that gates them, the requeue's timers, the periodic resync, the /healthz server and the
SandboxTask burst's pod creates; on the pool (``max_workers`` threads) the blocking
reconciles. Both take their objects from one work queue (``Controller.queue``, bound to the
pool here), which keeps one object to one reconcile at a time. SIGTERM or SIGINT (or the
thread's stop flag) stops it in order: resync and informers, in-flight reconciles on the
loop, the Lease released, the pool drained for at most :data:`DRAIN_SECONDS`, then the Event
poster and the REST clients closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import uvloop

from posttrain.api import API_VERSION
from posttrain.api.labels import COMPONENT_ROLLOUT, COMPONENT_TRAINER, LABEL_COMPONENT
from posttrain.telemetry import start_metrics_server

from .config import OperatorConfig
from .controllers import Controller
from .events import EVENT_COMPONENT, EventRecorder
from .health import start_health_server
from .informer import Body, Gate, Informer
from .kube import PLURALS, AsyncKube, KubeClient, load_credentials
from .leader import LeaseGate
from .trainingrun.kueue import KUEUE_API_VERSION
from .trainingrun.raycluster import RAY_API_VERSION

log = logging.getLogger(__name__)

# How long shutdown waits for the reconciles already running on the pool (each bounded by
# the request timeout per API call); below the chart's terminationGracePeriodSeconds (60).
DRAIN_SECONDS = 30.0
# How often a thread's stop flag (OperatorThread) is looked at.
STOP_FLAG_POLL_SECONDS = 0.1


class Memo(SimpleNamespace):
    """What the informer callbacks, the resync and the requeue share: the config, the
    credentials, the REST clients, the controller (with the work queue), the Event
    recorder, the thread pool, the gate and the loop's in-flight passes (set by
    :func:`build_memo` and :func:`run_async`)."""


def quiet_per_request_logs() -> None:
    """No INFO line per API request (idempotent; DEBUG keeps them): httpx logs every
    request at INFO ("HTTP Request: POST ... 201 Created")."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def build_memo(config: OperatorConfig) -> Memo:
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
    return Memo(config=config, credentials=creds, controller=controller, akube=akube, events=events)


async def run_async(
    config: OperatorConfig,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
    memo: Memo | None = None,
) -> None:
    """Run until ``stop_flag`` is set, SIGTERM or SIGINT (main thread only), or forever."""
    from .handlers import resync_forever

    memo = memo if memo is not None else build_memo(config)
    if config.log_level != "DEBUG":
        quiet_per_request_logs()
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(config.max_workers, thread_name_prefix="posttrain-reconcile")
    memo.executor = executor
    memo.controller.queue.bind(executor)
    memo.inflight = set()  # the loop's own passes (the SandboxTask burst), cancelled at shutdown
    gate = Gate() if config.standalone else build_lease_gate(memo, config)
    memo.gate = gate
    stopping = asyncio.Event()
    signals = _stop_on_signals(loop, stopping)
    tasks: list[asyncio.Task[None]] = []
    health = None
    try:
        bind_requeue(memo, gate)
        bind_optional_informers(memo, config, gate)
        # First, so a taken port fails before anything started.
        health = await start_health_server(config.liveness_port, gate)
        tasks = [
            asyncio.create_task(run_informers(memo, config, gate), name="posttrain informers"),
            asyncio.create_task(
                resync_forever(memo.controller, gate, config.resync_seconds, executor),
                name="posttrain resync",
            ),
        ]
        if stop_flag is not None:
            tasks.append(asyncio.create_task(_watch_flag(stop_flag, stopping), name="stop flag"))
        log.info("posttrain operator started; resync every %.1f s", config.resync_seconds)
        if ready_flag is not None:
            ready_flag.set()
        waiting = asyncio.create_task(stopping.wait())
        done, _ = await asyncio.wait([*tasks, waiting], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        for task in done:  # a root task that ended on its own failed: stop, then re-raise
            if task is not waiting and not task.cancelled() and task.exception() is not None:
                log.error("%s failed; operator stopping", task.get_name())
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        # The informers' finally: optional informers, in-flight loop reconciles, the Lease
        # released, the async client closed.
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        memo.controller.state.requeue.unbind()  # no retry may reach the closing pool
        memo.controller.queue.unbind()
        await _drain(executor, DRAIN_SECONDS)
        memo.events.close()
        memo.controller.state.kube.close()
        if health is not None:
            await health.cleanup()
        log.info("posttrain operator stopped")
    for result in results:
        if isinstance(result, Exception):
            raise result


def _stop_on_signals(loop: asyncio.AbstractEventLoop, stopping: asyncio.Event) -> list[int]:
    """SIGTERM (the kubelet) and SIGINT (Ctrl-C) set ``stopping``; only the main thread can
    handle signals (an OperatorThread stops through its flag)."""
    if threading.current_thread() is not threading.main_thread():
        return []

    def received(sig: signal.Signals) -> None:
        log.info("signal %s received; operator stopping", sig.name)
        stopping.set()

    handled = [signal.SIGTERM, signal.SIGINT]
    for sig in handled:
        loop.add_signal_handler(sig, received, sig)
    return [int(sig) for sig in handled]


async def _watch_flag(flag: threading.Event, stopping: asyncio.Event) -> None:
    """Set ``stopping`` once another thread sets ``flag`` (polled: no thread waits on it)."""
    while not flag.is_set():
        await asyncio.sleep(STOP_FLAG_POLL_SECONDS)
    log.info("stop flag set; operator stopping")
    stopping.set()


async def _drain(executor: ThreadPoolExecutor, timeout_s: float) -> None:
    """Let the reconciles already running finish (queued ones are dropped: the next
    leader's first list reconciles everything), waiting at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    drained = loop.create_future()

    def finished() -> None:
        if not drained.done():
            drained.set_result(None)

    def shutdown() -> None:
        executor.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(RuntimeError):  # the loop gave up waiting and closed
            loop.call_soon_threadsafe(finished)

    threading.Thread(target=shutdown, name="posttrain-drain", daemon=True).start()
    try:
        await asyncio.wait_for(drained, timeout_s)
    except TimeoutError:
        log.warning("reconciles still running after %.0f s; stopping without them", timeout_s)


def build_lease_gate(memo: Memo, config: OperatorConfig) -> LeaseGate:
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


def bind_requeue(memo: Memo, gate: Gate) -> None:
    """Failed reconciles retry on this loop: a due retry queues the object on the work
    queue (a failure there requeues it again, with a longer delay). A replica
    that is not the leader drops its due retries: the leader lists everything."""
    loop = asyncio.get_running_loop()
    controller: Controller = memo.controller

    def retry(kind: str, namespace: str, name: str) -> None:
        if not gate.is_open():
            log.info("%s %s/%s: retry dropped (not the leader)", kind, namespace, name)
            return
        controller.queue.add(kind, namespace, name)

    controller.state.requeue.bind(loop, retry)


def bind_optional_informers(memo: Memo, config: OperatorConfig, gate: Gate) -> None:
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
    memo: Memo,
    config: OperatorConfig,
    api_version: str,
    kind: str,
    on_event: Callable[[Memo, str, Body], None],
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


def build_informers(memo: Memo, config: OperatorConfig) -> list[Informer]:
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


def build_optional_informers(memo: Memo, config: OperatorConfig) -> dict[str, list[Informer]]:
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


async def run_informers(memo: Memo, config: OperatorConfig, gate: Gate) -> None:
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
    """The CLI's entry: metrics server, then the operator until SIGTERM/SIGINT."""
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
        self.memo: Memo | None = None
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
