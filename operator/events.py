"""Kubernetes Events about our objects, posted from one thread of the operator's own.

Reconciles run on threads and on the event loop; neither should wait for an Event (they are
for people reading ``kubectl describe``, not part of the object's state). :meth:`post`
queues; one daemon thread posts in order through the shared REST client.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import UTC, datetime
from typing import Any

from .kube import KubeClient, KubeError, resource_path
from .shared.views import EventSpec

log = logging.getLogger(__name__)

# The Events' source.component / reportingComponent.
EVENT_COMPONENT = "posttrain-operator"

Body = dict[str, Any]

# kubectl shows at most this much; the apiserver refuses messages over 1 MiB anyway.
MAX_MESSAGE = 1024
# Events waiting to be posted; beyond this new ones are dropped (logged) rather than
# letting memory grow while the apiserver is unreachable.
MAX_QUEUED = 10_000


def event_manifest(body: Body, event: EventSpec, component: str, now: datetime) -> Body:
    """The core/v1 Event about ``body`` (``kubectl describe`` shows it under Events).

    >>> task = {"apiVersion": "posttrain.io/v1alpha1", "kind": "SandboxTask",
    ...         "metadata": {"name": "t", "namespace": "ns", "uid": "u1"}}
    >>> e = event_manifest(task, EventSpec("Normal", "Created", "pod t-1"), "op",
    ...                    datetime(2026, 1, 2, tzinfo=UTC))
    >>> e["involvedObject"]["uid"], e["reason"], e["source"], e["firstTimestamp"]
    ('u1', 'Created', {'component': 'op'}, '2026-01-02T00:00:00Z')
    """
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace") or "default"
    stamp = now.isoformat().replace("+00:00", "Z")
    message = event.message
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE // 2 - 2] + " … " + message[-(MAX_MESSAGE // 2 - 3) :]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": namespace, "generateName": f"{meta.get('name', 'object')}."},
        "involvedObject": {
            "apiVersion": body.get("apiVersion"),
            "kind": body.get("kind"),
            "name": meta.get("name"),
            "namespace": namespace,
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event.type,
        "reason": event.reason,
        "message": message,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    """Queue Events from any thread or the loop; one thread posts them, in order."""

    def __init__(self, kube: KubeClient, component: str) -> None:
        self.kube = kube
        self.component = component
        self._queue: queue.Queue[Body | None] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.posted = 0  # for logs and tests

    def post(self, body: Body, event: EventSpec) -> None:
        """Queue an Event about ``body``; never blocks."""
        self._ensure_thread()
        try:
            self._queue.put_nowait(event_manifest(body, event, self.component, datetime.now(UTC)))
        except queue.Full:
            log.warning("event queue full; dropped %s %s", event.reason, event.message[:200])

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="posttrain-events", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while (manifest := self._queue.get()) is not None:
            try:
                namespace = manifest["metadata"]["namespace"]
                self.kube.request("POST", resource_path("v1", "events", namespace), manifest)
                self.posted += 1
            except (KubeError, RuntimeError) as exc:
                # RuntimeError: the client was closed at shutdown.
                log.warning(
                    "posting event %s about %s failed: %s",
                    manifest["reason"],
                    manifest["involvedObject"]["name"],
                    exc,
                )

    def close(self, timeout_s: float = 5.0) -> None:
        """Post what is queued (up to ``timeout_s``), then stop the thread."""
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join(timeout_s)
