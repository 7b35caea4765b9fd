"""One work queue of object keys for every kind: what to reconcile, run on the operator's
thread pool, at most one reconcile per object at a time.

Like controller-runtime's work queue: :meth:`WorkQueue.add` of a key that is already queued
does nothing (requests made before its reconcile starts coalesce into one), and of a key
whose reconcile is running marks it dirty, so it runs once more after that reconcile
instead of a second thread waiting on the object's lock. Informer events (their owner's key
for a child's event), due retries of the requeue (requeue.py), the periodic resync and the
warm pools' refills all feed it. Before :meth:`bind` (or after shutdown) nothing runs
through it: :meth:`add` reports that with False and the caller reconciles inline (a
``Controller`` used without the runtime) or drops the request (shutdown; the next leader's
first list reconciles everything).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor

from .requeue import ObjectKey

log = logging.getLogger(__name__)


class WorkQueue:
    """The keys waiting for a reconcile and the keys being reconciled, per operator process."""

    def __init__(self, reconcile: Callable[[str, str, str], None]) -> None:
        self._reconcile = reconcile  # (kind, namespace, name), blocking
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._queued: set[ObjectKey] = set()
        self._running: set[ObjectKey] = set()
        self._dirty: set[ObjectKey] = set()

    def bind(self, executor: Executor) -> None:
        """Run the reconciles on ``executor`` from now on."""
        with self._lock:
            self._executor = executor

    def unbind(self) -> None:
        """Stop taking work (shutdown); what is queued and not started yet is dropped by the
        executor's shutdown."""
        with self._lock:
            self._executor = None
            self._dirty.clear()

    def add(self, kind: str, namespace: str, name: str) -> bool:
        """Ask for a reconcile of the object (any thread; never blocks). False when the
        queue is not bound: nothing will run it."""
        key = (kind, namespace, name)
        with self._lock:
            executor = self._executor
            if executor is None:
                return False
            if key in self._running:
                self._dirty.add(key)
                return True
            if key in self._queued:
                return True
            self._queued.add(key)
        try:
            executor.submit(self._process, key)
        except RuntimeError:  # the pool is shutting down
            with self._lock:
                self._queued.discard(key)
        return True

    def _process(self, key: ObjectKey) -> None:
        with self._lock:
            self._queued.discard(key)
            self._running.add(key)
        try:
            while True:
                try:
                    self._reconcile(*key)
                except Exception as exc:  # counted and requeued inside the reconcile
                    log.error("reconcile failed (requeued): %r", exc, exc_info=exc)
                with self._lock:
                    if key not in self._dirty or self._executor is None:
                        return
                    self._dirty.discard(key)
        finally:
            with self._lock:
                self._running.discard(key)
