"""Kopf settings, set deliberately from OperatorConfig (nothing left to kopf's defaults
where the default would be wrong for us)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import kopf

from .config import OperatorConfig

# Kopf removes its finalizer from every object it watches that no handler of its needs it
# for, and none does any more: the TrainingRun storage finalizer (posttrain.io/finalizer) is
# the reconciler's own (trainingrun/finalizer.py). So Kopf's is a name nothing ever carries.
KOPF_FINALIZER = "posttrain.io/kopf-unused"
ANNOTATIONS_PREFIX = "posttrain.io"
EVENT_COMPONENT = "posttrain-operator"

# Kinds with a change-detecting (on.create/update/delete) handler: only these need kopf's
# diff-base essence. None is left: every kind is watched with on.event handlers or our own
# informers.
KINDS_WITH_CHANGE_HANDLERS: frozenset[str] = frozenset()


class ChangeHandlerDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff-base, built only for kinds that have change handlers.

    kopf builds the essence of *every* watched event (a deep copy of the whole body,
    managedFields and status included, then trimmed) before it knows whether any handler
    needs a diff. For pods and SandboxTasks, watched with on.event handlers only, that copy
    was a quarter of the operator's CPU in a 500-task burst (bench/operator_sandbox_throughput.py,
    py-spy). Their essence is now empty: no diff, no change cause, nothing stored.
    """

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        if body.get("kind") not in KINDS_WITH_CHANGE_HANDLERS:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


class _DropWatchHandlerInfo(logging.Filter):
    """Drops kopf's INFO lines for on.event handlers ("Handler 'training_run_event' succeeded.").

    kopf logs one per watch event through a logger that never posts them as Kubernetes
    Events (``k8s_skip``); at hundreds of events a second they cost the operator measurable
    CPU and say nothing a reconcile log line does not. Warnings and errors still pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and getattr(record, "k8s_skip", False))


def quiet_per_request_logs() -> None:
    """No INFO line per watch event or per API request (idempotent; DEBUG keeps them).

    kopf's per-object logger gets the filter above; httpx logs every request at INFO ("HTTP
    Request: POST ... 201 Created"), i.e. one formatted line per pod the operator creates.
    """
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _DropWatchHandlerInfo) for f in objects.filters):
        objects.addFilter(_DropWatchHandlerInfo())
    logging.getLogger("httpx").setLevel(logging.WARNING)


def build_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf.OperatorSettings for ``config``.

    - persistence: a finalizer name nothing carries (KOPF_FINALIZER) and ``posttrain.io/``
      annotations for kopf's progress and diff-base, so nothing named ``kopf.zalando.org``
      lands on user objects; the diff-base is built only for kinds with change handlers
      (ChangeHandlerDiffBaseStorage: none left);
    - watching: server timeout below the client timeout, so the apiserver ends each watch
      cleanly and kopf re-lists instead of hitting a client-side read timeout;
    - queueing/execution: one worker per object (up to worker_limit) and a thread pool of
      max_workers for the synchronous reconcilers;
    - scanning off: CRDs are installed before the operator starts, so kopf needs no
      cluster-wide CRD/namespace watch (and the ClusterRole does not grant it);
    - peering: off (standalone) always: which replica works is decided by the Lease
      (leader.py), and Kopf watches no kind any more;
    - posting: Kubernetes Events for INFO and above, from component posttrain-operator.
    """
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = KOPF_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATIONS_PREFIX
    )
    settings.persistence.diffbase_storage = ChangeHandlerDiffBaseStorage(
        prefix=ANNOTATIONS_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = config.request_timeout
    settings.queueing.worker_limit = config.worker_limit
    settings.queueing.idle_timeout = 30.0  # per-object workers exit after 30 s of quiet
    settings.execution.max_workers = config.max_workers
    settings.scanning.disabled = True
    settings.peering.standalone = True
    settings.peering.mandatory = False
    settings.posting.enabled = True
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = EVENT_COMPONENT
    return settings
