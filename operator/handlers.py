"""Kopf handlers: register, log, delegate. No decisions here (see controllers/reconcile).

Watches feed the controller's caches; every event triggers a level-triggered reconcile of
the affected object (pod and Deployment events reconcile their owner). A periodic resync
handles time-based transitions (sandbox TTL, activeDeadlineSeconds) and anything a missed
event left behind. Only TrainingRuns with spec.checkpoint.deleteOnRunDeletion get a
finalizer: it is the one case where deletion needs cleanup (the artifacts in S3).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from typing import Any

import kopf

from posttrain.api import GROUP, VERSION

from .builders import COMPONENT_ROLLOUT, COMPONENT_TRAINER, LABEL_COMPONENT
from .controllers import Controller

log = logging.getLogger(__name__)

# A registry of our own (not kopf's global one), so embedding the operator in a process that
# also uses kopf for something else, or starting it twice in tests, registers nothing twice.
REGISTRY = kopf.OperatorRegistry()


def _controller(memo: Any) -> Controller:
    controller: Controller = memo.controller
    return controller


@kopf.on.login(registry=REGISTRY)
def login(memo: Any, **_: Any) -> kopf.ConnectionInfo:
    """Authenticate kopf with the same credentials the reconcilers use."""
    info: kopf.ConnectionInfo = memo.credentials.connection_info()
    return info


@kopf.on.startup(registry=REGISTRY)
async def start_resync(memo: Any, logger: logging.Logger, **_: Any) -> None:
    """Start the periodic resync (time-based transitions, safety net for missed events)."""
    period = memo.config.resync_seconds
    memo.resync_task = asyncio.create_task(_resync_forever(_controller(memo), period))
    logger.info("posttrain operator started; resync every %.1f s", period)


@kopf.on.cleanup(registry=REGISTRY)
async def stop_resync(memo: Any, **_: Any) -> None:
    task = getattr(memo, "resync_task", None)
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    _controller(memo).kube.close()


async def _resync_forever(controller: Controller, period: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(period)
        # copy_context: kopf's event poster lives in context variables the thread needs.
        context = contextvars.copy_context()
        try:
            await loop.run_in_executor(None, context.run, controller.resync)
        except Exception:
            log.exception("resync failed; retrying in %.1f s", period)


def _on_resource_event(
    kind: str, event: kopf.RawEvent, memo: Any, namespace: str, name: str
) -> None:
    """Cache the object; reconcile it unless the event is the echo of our own status patch."""
    controller = _controller(memo)
    store, reconcile = {
        "SandboxTask": (controller.tasks, controller.reconcile_task),
        "TrainingRun": (controller.runs, controller.reconcile_run),
        "RolloutPool": (controller.pools, controller.reconcile_pool),
    }[kind]
    changed = controller.observe(store, event.get("type"), event["object"])
    if event.get("type") == "DELETED":
        controller.forget(kind, namespace, name)
    elif changed:
        reconcile(namespace, name)


async def _in_thread(memo: Any, work: Callable[[], None]) -> None:
    """Run blocking reconcile work on kopf's thread pool (with kopf's context variables).

    The SandboxTask, SandboxWarmPool and sandbox-pod handlers are async so that caching an
    event, and dropping the echo of our own write, happens on the event loop: in a burst
    half of all events are such echoes, and a thread hop each cost more than the work.
    """
    context = contextvars.copy_context()
    await asyncio.get_running_loop().run_in_executor(
        getattr(memo, "executor", None), context.run, work)


@kopf.on.event(GROUP, VERSION, "sandboxtasks", registry=REGISTRY)
async def sandbox_task_event(event: kopf.RawEvent, memo: Any, namespace: str, name: str,
                             **_: Any) -> None:
    controller = _controller(memo)
    changed = controller.observe(controller.tasks, event.get("type"), event["object"])
    if event.get("type") == "DELETED":
        controller.forget("SandboxTask", namespace, name)
    elif changed:
        await _in_thread(memo, lambda: controller.reconcile_task(namespace, name))


@kopf.on.event(GROUP, VERSION, "sandboxwarmpools", registry=REGISTRY)
async def sandbox_warm_pool_event(event: kopf.RawEvent, memo: Any, namespace: str, name: str,
                                  **_: Any) -> None:
    controller = _controller(memo)
    changed = controller.observe(controller.warm_pools, event.get("type"), event["object"])
    if event.get("type") == "DELETED":
        await _in_thread(memo, lambda: controller.warm_pool_deleted(namespace, name))
    elif changed:
        await _in_thread(memo, lambda: controller.reconcile_warm_pool(namespace, name))


@kopf.on.event(GROUP, VERSION, "trainingruns", registry=REGISTRY)
def training_run_event(event: kopf.RawEvent, memo: Any, namespace: str, name: str,
                       **_: Any) -> None:
    _on_resource_event("TrainingRun", event, memo, namespace, name)


def _deletes_storage(spec: kopf.Spec, **_: Any) -> bool:
    return bool((spec.get("checkpoint") or {}).get("deleteOnRunDeletion"))


@kopf.on.delete(GROUP, VERSION, "trainingruns", when=_deletes_storage, registry=REGISTRY)
def delete_run_storage(body: kopf.Body, memo: Any, **_: Any) -> None:
    """Only runs that opted in lose their checkpoints and trajectories (kopf retries this)."""
    _controller(memo).delete_run_storage(dict(body))


@kopf.on.event(GROUP, VERSION, "rolloutpools", registry=REGISTRY)
def rollout_pool_event(event: kopf.RawEvent, memo: Any, namespace: str, name: str,
                       **_: Any) -> None:
    _on_resource_event("RolloutPool", event, memo, namespace, name)


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_COMPONENT: COMPONENT_ROLLOUT},
               registry=REGISTRY)
def deployment_event(event: kopf.RawEvent, memo: Any, namespace: str, **_: Any) -> None:
    controller = _controller(memo)
    body = event["object"]
    changed = controller.observe(controller.deployments, event.get("type"), body)
    pool = ((body.get("metadata") or {}).get("labels") or {}).get("posttrain.io/pool")
    if pool and changed:
        controller.reconcile_pool(namespace, pool)


@kopf.on.event("ray.io", "v1", "rayclusters", labels={LABEL_COMPONENT: COMPONENT_TRAINER},
               registry=REGISTRY)
def ray_cluster_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """KubeRay's RayClusters of multi-node runs. Served only when the CRD exists at start-up
    (kopf warns "Unresolved resources" otherwise); the resync's re-list covers the rest."""
    _controller(memo).on_ray_cluster(event.get("type"), event["object"])


@kopf.on.event("", "v1", "pods", labels={LABEL_COMPONENT: kopf.PRESENT}, registry=REGISTRY)
async def pod_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    for work in _controller(memo).route_pod(event.get("type"), event["object"]):
        await _in_thread(memo, work)
