"""The operator's state every reconciler shares: the caches, the REST client, per-object locks.

The caches are the operator's informers: the watch streams (handlers.py, informer.py) put
every TrainingRun, RolloutPool, SandboxTask, SandboxWarmPool and every labelled Pod,
Deployment, RayCluster and Workload here, and each reconcile reads only the cache (no GETs on
the hot path). Writes go through :class:`~posttrain.operator.kube.KubeClient` and their
responses are put back into the cache, so the next reconcile reads its own writes.

Reconciles of the same object are serialised by a per-object lock (a pod event and a task
event can arrive on two threads at once); different objects run in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any

from posttrain.api.labels import (
    LABEL_POOL,
    LABEL_RUN,
    LABEL_TASK,
    LABEL_WARM_POOL,
)
from posttrain.api.reasons import ConditionType, Reason
from posttrain.telemetry import get_tracer

from ..config import OperatorConfig
from ..kube import KubeClient, SupersededChild
from ..metrics import (
    CHILDREN_ADOPTED,
    CHILDREN_CREATED,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    RECONCILES,
)
from .requeue import Requeue, RetryLater
from .views import EventSpec

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

Body = dict[str, Any]
Key = tuple[str, str]
EventPoster = Callable[[Body, EventSpec], None]


def now() -> datetime:
    """The reconcilers' clock: UTC, whole seconds (what status timestamps carry)."""
    return datetime.now(UTC).replace(microsecond=0)


def count_child(parent: str, kind: str, created: bool) -> None:
    """One child created (or, after a 409, adopted) for a ``parent`` kind."""
    (CHILDREN_CREATED if created else CHILDREN_ADOPTED).labels(parent, kind).inc()


def _rv(body: Body) -> int | None:
    value = (body.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class Store:
    """Latest body per (namespace, name), plus an index of children by owner label value.

    Never goes back in time: a watch event older than a write response already stored is
    ignored (resourceVersions are compared as integers, which etcd-backed servers use). That
    holds across a removal too: events of one kind are cached on different threads, so a
    pod's DELETED event (or the operator's own delete) can be applied before an older
    MODIFIED event of the same pod; a tombstone (uid, resourceVersion) keeps that stale
    event from bringing the deleted pod back as a live one that no later event would remove.
    """

    TOMBSTONE_SECONDS = 300.0
    """How long a removal is remembered: far longer than any event's trip through the
    operator's queues, short enough that a burst of deleted sandbox pods costs no memory."""

    def __init__(self, owner_label: str | None = None) -> None:
        self._owner_label = owner_label
        self._items: dict[Key, Body] = {}
        self._by_owner: dict[Key, set[str]] = {}
        self._tombstones: dict[Key, tuple[str | None, int | None, float]] = {}
        self._pruned_at = time.monotonic()
        self._lock = threading.Lock()

    def _owner_key(self, body: Body) -> Key | None:
        if not self._owner_label:
            return None
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(self._owner_label)
        return (meta.get("namespace", ""), owner) if owner else None

    def put(self, body: Body) -> bool:
        """Store ``body``; False when the cache already had this version or a newer one.

        A False return is how the watch echo of the operator's own write is recognised (the
        write's response was stored first), so that echo costs no reconcile.
        """
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            tombstone = self._tombstones.get(key)
            if tombstone is not None:
                uid, removed_rv, _ = tombstone
                new_rv = _rv(body)
                if uid == meta.get("uid") and (
                    removed_rv is None or new_rv is None or new_rv <= removed_rv
                ):
                    return False  # an event from before the removal, delivered after it
                del self._tombstones[key]  # a newer version, or a new object of that name
            old = self._items.get(key)
            if old is not None:
                old_rv, new_rv = _rv(old), _rv(body)
                same = (old.get("metadata") or {}).get("uid") == meta.get("uid")
                if same and old_rv is not None and new_rv is not None and new_rv <= old_rv:
                    return False
            self._items[key] = body
            owner = self._owner_key(body)
            if owner:
                self._by_owner.setdefault(owner, set()).add(key[1])
            return True

    def remove(self, namespace: str, name: str, last: Body | None = None) -> None:
        """Forget ``namespace/name``; ``last`` is its final version when known (a DELETED
        event's body), else the cached one is. Older events of it are ignored from now on."""
        with self._lock:
            body = self._items.pop((namespace, name), None)
            final = last or body
            if final is not None:
                now = time.monotonic()
                if now - self._pruned_at > self.TOMBSTONE_SECONDS:  # amortised: O(1) a removal
                    self._tombstones = {
                        k: t
                        for k, t in self._tombstones.items()
                        if now - t[2] < self.TOMBSTONE_SECONDS
                    }
                    self._pruned_at = now
                rvs = [v for v in (_rv(final), _rv(body) if body else None) if v is not None]
                self._tombstones[(namespace, name)] = (
                    (final.get("metadata") or {}).get("uid"),
                    max(rvs) if rvs else None,
                    now,
                )
            owner = self._owner_key(body) if body else None
            if owner and owner in self._by_owner:
                self._by_owner[owner].discard(name)
                if not self._by_owner[owner]:
                    del self._by_owner[owner]

    def get(self, namespace: str, name: str) -> Body | None:
        with self._lock:
            return self._items.get((namespace, name))

    def children(self, namespace: str, owner: str) -> list[Body]:
        with self._lock:
            names = self._by_owner.get((namespace, owner), set())
            return [self._items[(namespace, n)] for n in names if (namespace, n) in self._items]

    def snapshot_keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)


def observe(store: Store, event_type: str | None, body: Body) -> bool:
    """Apply a watch event to ``store``; False when it told the cache nothing new."""
    meta = body.get("metadata") or {}
    if event_type == "DELETED":
        store.remove(meta.get("namespace", ""), meta.get("name", ""), last=body)
        return True
    return store.put(body)


class OperatorState:
    """One per operator process: configuration, REST client, Event poster, every cache, and
    the per-object locks; plus the write helpers every reconciler uses the same way."""

    def __init__(self, config: OperatorConfig, kube: KubeClient, post_event: EventPoster) -> None:
        self.config = config
        self.kube = kube
        self.post_event = post_event
        # The four kinds.
        self.runs = Store()
        self.pools = Store()
        self.tasks = Store()
        self.warm_pools = Store()
        # Their children, indexed by the owner's label.
        self.trainer_pods = Store(LABEL_RUN)
        self.rollout_pods = Store(LABEL_POOL)
        self.sandbox_pods = Store(LABEL_TASK)
        self.warm_pods = Store(LABEL_WARM_POOL)
        self.deployments = Store(LABEL_POOL)
        self.ray_clusters = Store(LABEL_RUN)
        self.workloads = Store(LABEL_RUN)
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.requeue = Requeue(config.requeue_base_seconds, config.requeue_max_seconds)

    # ------------------------------------------------------------ per-object locks

    def lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    def forget_lock(self, kind: str, namespace: str, name: str) -> None:
        """The object is gone: drop its lock and its retries."""
        with self._locks_guard:
            self._locks.pop((kind, namespace, name), None)
        self.requeue.forget(kind, namespace, name)

    @contextmanager
    def reconciling(
        self,
        kind: str,
        namespace: str,
        name: str,
        locked: bool = False,
        started: float | None = None,
    ) -> Iterator[None]:
        """Per-object lock (``locked``: the caller holds it) + OpenTelemetry span + Prometheus
        metrics around one reconcile; a failure (an exception, or :class:`RetryLater`)
        requeues the object with backoff, a success resets its backoff."""
        started = time.perf_counter() if started is None else started
        RECONCILES.labels(kind).inc()
        with (
            nullcontext() if locked else self.lock(kind, namespace, name),
            tracer.start_as_current_span(f"reconcile {kind}") as span,
        ):
            span.set_attribute("k8s.namespace.name", namespace)
            span.set_attribute("posttrain.object", name)
            try:
                yield
            except (SupersededChild, RetryLater) as exc:
                # Expected (e.g. after a delete and re-apply of the same name): not an error,
                # but the object is retried soon.
                log.info("%s %s/%s: %s", kind, namespace, name, exc)
                self.requeue.failed(kind, namespace, name, exc)
            except Exception as exc:
                RECONCILE_ERRORS.labels(kind).inc()
                span.record_exception(exc)
                self.requeue.failed(kind, namespace, name, repr(exc))
                raise
            else:
                self.requeue.succeeded(kind, namespace, name)
            finally:
                RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)

    # ------------------------------------------------------------ writes

    def emit(self, body: Body, events: list[EventSpec]) -> None:
        """Log and post ``events`` about ``body``."""
        for event in events:
            log.info(
                "%s %s/%s: %s: %s",
                body.get("kind"),
                body["metadata"].get("namespace"),
                body["metadata"].get("name"),
                event.reason,
                event.message,
            )
            self.post_event(body, event)

    def create(self, parent: str, manifest: Body) -> Body:
        """Create a child of a ``parent`` kind (adopting one that exists); its stored body."""
        created, obj = self.kube.create_or_adopt(manifest)
        count_child(parent, manifest["kind"], created)
        return obj

    def patch_status(self, store: Store, body: Body, patch: dict[str, Any]) -> None:
        """Merge ``patch`` into ``body``'s status subresource and cache the response."""
        if not patch:
            return
        meta = body["metadata"]
        path = self.kube.path_of(
            {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": meta},
            with_name=True,
        )
        updated = self.kube.patch(path, {"status": patch}, subresource="status")
        store.put(updated)

    def invalid(self, store: Store, body: Body, exc: Exception, terminal_phase: str | None) -> None:
        """A spec the builders cannot turn into children: say so on the object, don't retry."""
        message = f"cannot build children: {exc}"[:1000]
        gen = (body.get("metadata") or {}).get("generation")
        condition = {
            "type": ConditionType.FAILED if terminal_phase else ConditionType.READY,
            "status": "True" if terminal_phase else "False",
            "reason": Reason.INVALID_SPEC,
            "message": message,
            "lastTransitionTime": now().isoformat().replace("+00:00", "Z"),
            "observedGeneration": gen,
        }
        patch: dict[str, Any] = {"conditions": [condition], "observedGeneration": gen}
        if terminal_phase:
            patch["phase"] = terminal_phase
        self.patch_status(store, body, patch)
        self.emit(body, [EventSpec("Warning", Reason.INVALID_SPEC, message)])
