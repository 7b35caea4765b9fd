"""Kopf settings, set deliberately from OperatorConfig (nothing left to kopf's defaults
where the default would be wrong for us)."""

from __future__ import annotations

import logging

import kopf

from .config import OperatorConfig

FINALIZER = "posttrain.io/finalizer"
ANNOTATIONS_PREFIX = "posttrain.io"
EVENT_COMPONENT = "posttrain-operator"


def build_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf.OperatorSettings for ``config``.

    - persistence: our finalizer name and ``posttrain.io/`` annotations for kopf's progress
      and diff-base, so nothing named ``kopf.zalando.org`` lands on user objects;
    - watching: server timeout below the client timeout, so the apiserver ends each watch
      cleanly and kopf re-lists instead of hitting a client-side read timeout;
    - queueing/execution: one worker per object (up to worker_limit) and a thread pool of
      max_workers for the synchronous reconcilers;
    - scanning off: CRDs are installed before the operator starts, so kopf needs no
      cluster-wide CRD/namespace watch (and the ClusterRole does not grant it);
    - peering: standalone for tests and single replicas; otherwise replicas share a
      KopfPeering and only the highest-priority one reconciles;
    - posting: Kubernetes Events for INFO and above, from component posttrain-operator.
    """
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATIONS_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATIONS_PREFIX, key="last-handled-configuration")
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = config.request_timeout
    settings.queueing.worker_limit = config.worker_limit
    settings.queueing.idle_timeout = 30.0  # per-object workers exit after 30 s of quiet
    settings.execution.max_workers = config.max_workers
    settings.scanning.disabled = True
    settings.peering.standalone = config.standalone
    settings.peering.name = config.peering_name
    settings.peering.priority = config.priority
    settings.peering.mandatory = not config.standalone
    settings.peering.clusterwide = config.all_namespaces
    settings.posting.enabled = True
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = EVENT_COMPONENT
    return settings
