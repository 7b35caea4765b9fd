"""The informer callbacks and the periodic resync: log, delegate. No
decisions here (see controllers.py for where each event goes, each kind's package for what
it does).

The operator runs on its own event loop and thread pool (runtime.py); which replica works is
the Lease's (leader.py). Our informers (informer.py) feed the controller's caches:
SandboxTasks and labelled pods, the burst path; TrainingRuns, RolloutPools, SandboxWarmPools
and rollout Deployments; KubeRay's RayClusters and Kueue's Workloads once API discovery
finds their CRDs. Every event triggers a level-triggered reconcile of the affected object
(pod and Deployment events reconcile their owner), through the controller's one work queue
(shared/workqueue.py): on its thread pool, or on the loop for a SandboxTask while its pass
is a plain pod create (the burst). A failed reconcile is retried for its object with
exponential backoff (shared/requeue.py), and a periodic resync handles time-based
transitions (sandbox TTL, activeDeadlineSeconds) and anything a missed event left behind.
Only TrainingRuns with spec.checkpoint.deleteOnRunDeletion get a finalizer, added and
removed by their reconciler (trainingrun/finalizer.py): it is the one case where deletion
needs cleanup (the artifacts in S3).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

from .controllers import Controller
from .informer import Gate

log = logging.getLogger(__name__)


def _controller(memo: Any) -> Controller:
    controller: Controller = memo.controller
    return controller


async def resync_forever(
    controller: Controller, gate: Gate, period: float, executor: Executor
) -> None:
    """Resync every ``period`` while this replica works (a standby's caches are stale): the
    time-based transitions and the safety net for missed events (started by
    runtime.run_async, cancelled at shutdown)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period)
        if not gate.is_open():
            continue
        try:
            await loop.run_in_executor(executor, controller.resync)
        except Exception:
            log.exception("resync failed; retrying in %.1f s", period)


async def _in_thread(memo: Any, work: Callable[[], None]) -> None:
    """Run blocking reconcile work on the operator's thread pool (runtime.run_async).

    The informer callbacks cache an event, and drop the echo of our own write, on the event
    loop: in a burst half of all events are such echoes, and a thread hop each cost more
    than the work.
    """
    await asyncio.get_running_loop().run_in_executor(memo.executor, work)


# ------------------------------------------------------------ informers (informer.py)
# Every watched kind: lean informers feed these callbacks on the operator's event loop, in stream
# order (see runtime.build_informers, runtime.OptionalInformers and docs/operator.md, "Burst
# path" and "One event path").


def on_training_run(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A TrainingRun event: cached here; queued for a reconcile unless it is our own echo (a
    deleting run's reconcile is its storage finalizer, trainingrun/finalizer.py)."""
    controller = _controller(memo)
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    changed = controller.observe(controller.state.runs, event_type, body)
    if event_type == "DELETED":
        controller.forget("TrainingRun", namespace, name)
    elif changed:
        controller.queue.add("TrainingRun", namespace, name)


def on_rollout_pool(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A RolloutPool event: cached here; queued for a reconcile unless it is our own echo."""
    controller = _controller(memo)
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    changed = controller.observe(controller.state.pools, event_type, body)
    if event_type == "DELETED":
        controller.forget("RolloutPool", namespace, name)
    elif changed:
        controller.queue.add("RolloutPool", namespace, name)


def on_warm_pool(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A SandboxWarmPool event: cached here; its idle pods deleted with it (on a thread),
    else queued for a reconcile."""
    controller = _controller(memo)
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    changed = controller.observe(controller.state.warm_pools, event_type, body)
    if event_type == "DELETED":
        _spawn(memo, _in_thread(memo, lambda: controller.warm_pools.deleted(namespace, name)))
    elif changed:
        controller.queue.add("SandboxWarmPool", namespace, name)


def on_deployment(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A rollout pool's Deployment event: cached here and its pool queued."""
    _controller(memo).on_deployment(event_type, body)


def on_ray_cluster(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A labelled RayCluster event (KubeRay wrote its status): cached here and its run
    queued. Watched once API discovery finds KubeRay's CRD (runtime.OptionalInformers)."""
    _controller(memo).on_ray_cluster(event_type, body)


def on_workload(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A labelled Kueue Workload event (Kueue admitted or evicted it): cached here and its
    run queued. Watched once API discovery finds Kueue's CRD."""
    _controller(memo).on_workload(event_type, body)


def on_sandbox_task(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A SandboxTask event: cache it; reconcile unless it is the echo of our own write."""
    controller = _controller(memo)
    meta = body.get("metadata") or {}
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    changed = controller.observe(controller.state.tasks, event_type, body)
    if event_type == "DELETED":
        controller.forget("SandboxTask", namespace, name)
    elif changed:
        _reconcile_task(memo, namespace, name)


def _reconcile_task(memo: Any, namespace: str, name: str) -> None:
    """Reconcile a SandboxTask through the work queue, on the loop when it can.

    The task's key is claimed here (an event for a task already queued or being reconciled
    asks the queue for one more pass instead, without a coroutine of its own); the claimed
    key's passes run on the loop while they are a plain pod create (the burst), and go to
    the pool the first time one is not (shared/workqueue.py, ``reconcile_claimed``).
    """
    controller = _controller(memo)
    if not controller.queue.claim("SandboxTask", namespace, name):
        return
    reconciler, create = controller.sandbox_tasks, memo.akube.create_or_adopt
    _spawn(
        memo,
        controller.queue.reconcile_claimed(
            "SandboxTask",
            namespace,
            name,
            lambda: reconciler.reconcile_on_loop(namespace, name, create),
        ),
    )


def on_pod(memo: Any, event_type: str, body: dict[str, Any]) -> None:
    """A labelled pod event: cached here; its task reconciled as a SandboxTask event's is,
    other owners queued."""
    task = _controller(memo).route_pod(event_type, body)
    if task is not None:
        _reconcile_task(memo, *task)


def _spawn(memo: Any, work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` as a task of its own; its failure is logged (the failed reconcile has
    requeued its object with backoff)."""
    task = asyncio.create_task(work)
    memo.inflight.add(task)
    task.add_done_callback(lambda done: _finished(memo, done))


def _finished(memo: Any, task: asyncio.Task[None]) -> None:
    memo.inflight.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("reconcile failed (requeued): %r", task.exception(), exc_info=task.exception())
