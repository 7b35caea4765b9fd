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
from typing import Any

import kopf

from posttrain.api import GROUP, VERSION

from .builders import COMPONENT_ROLLOUT, LABEL_COMPONENT
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


@kopf.on.event(GROUP, VERSION, "sandboxtasks", registry=REGISTRY)
def sandbox_task_event(event: kopf.RawEvent, memo: Any, namespace: str, name: str,
                       **_: Any) -> None:
    _on_resource_event("SandboxTask", event, memo, namespace, name)


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


@kopf.on.event("", "v1", "pods", labels={LABEL_COMPONENT: kopf.PRESENT}, registry=REGISTRY)
def pod_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    _controller(memo).on_pod(event.get("type"), event["object"])
