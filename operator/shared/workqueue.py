"""One work queue of object keys for every kind: what to reconcile, on the operator's thread
pool or on its event loop, at most one reconcile per object at a time.

Like controller-runtime's work queue: :meth:`WorkQueue.add` of a key that is already queued
does nothing (requests made before its reconcile starts coalesce into one), and of a key
whose reconcile is running marks it dirty, so it runs once more after that reconcile
instead of a second thread waiting on the object's lock. Informer events (their owner's key
for a child's event), due retries of the requeue (requeue.py), the periodic resync and the
warm pools' refills all feed it.

The SandboxTask burst goes through the same keys with a fast path on the loop (a new task's
one write, the pod create, made with the async client; a thread hop would cost more than the
work): the informer callback claims the key (:meth:`~WorkQueue.claim`), the loop runs its
passes (:meth:`~WorkQueue.reconcile_claimed`), :meth:`~WorkQueue.finish` says whether an
event asked for one more meanwhile, and a pass the loop cannot do is handed to the pool
(:meth:`~WorkQueue.hand_over`) without a gap in which a second reconcile could start. A
claimed key counts as running, so the loop and the pool never reconcile one object at once
and an event during either asks for exactly one more pass.

Before :meth:`~WorkQueue.bind` (or after shutdown) nothing runs through it: :meth:`add` and
:meth:`claim` report that with False and the caller reconciles inline (a ``Controller``
used without the runtime) or drops the request (shutdown; the next leader's first list
reconciles everything).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor

from .requeue import ObjectKey

log = logging.getLogger(__name__)


class WorkQueue:
    """The keys waiting for a reconcile and the keys being reconciled (on the pool or
    claimed on the loop), per operator process."""

    def __init__(self, reconcile: Callable[[str, str, str], None]) -> None:
        self._reconcile = reconcile  # (kind, namespace, name), blocking
        self._lock = threading.Lock()
        self._executor: Executor | None = None
        self._queued: set[ObjectKey] = set()
        self._running: set[ObjectKey] = set()  # on a thread, or claimed on the loop
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
            if self._taken(key):
                return True
            self._queued.add(key)
        self._submit(executor, key)
        return True

    def claim(self, kind: str, namespace: str, name: str) -> bool:
        """Take the object's next reconcile for the caller to run on the loop (never
        blocks); the caller then owns the key until :meth:`finish` releases it or
        :meth:`hand_over` gives it to the pool. False when someone else has it (as
        :meth:`add` does, this asks for one more pass after a running reconcile; a queued
        one has not started and will see the event) or the queue is not bound."""
        key = (kind, namespace, name)
        with self._lock:
            if self._executor is None or self._taken(key):
                return False
            self._running.add(key)
            return True

    def finish(self, kind: str, namespace: str, name: str) -> bool:
        """The caller's pass of a claimed key is done: True when the object was asked for
        meanwhile (the caller keeps the key and runs it again), else the key is released."""
        key = (kind, namespace, name)
        with self._lock:
            if key in self._dirty and self._executor is not None:
                self._dirty.discard(key)
                return True
            self._release(key)
            return False

    def hand_over(self, kind: str, namespace: str, name: str) -> bool:
        """Run a claimed key's next pass on the pool instead (what the loop cannot do: it
        would block): the key goes from claimed to queued in one step, so no other
        reconcile of the object starts in between and requests coalesce into the queued
        pass, as after :meth:`add`. False when the queue is not bound (released, nothing
        runs)."""
        key = (kind, namespace, name)
        with self._lock:
            self._release(key)  # a request made meanwhile is served by the queued pass
            executor = self._executor
            if executor is None:
                return False
            self._queued.add(key)
        self._submit(executor, key)
        return True

    async def reconcile_claimed(
        self, kind: str, namespace: str, name: str, on_loop: Callable[[], Awaitable[bool]]
    ) -> None:
        """Run a key the caller claimed (:meth:`claim`): ``on_loop()`` passes while the
        object is asked for again, each handed to the pool when it answers False
        (it could not do the pass without blocking). A failed pass is logged (the
        reconcile requeued it with backoff); cancelled (shutdown), the key is
        released."""
        key = (kind, namespace, name)
        try:
            while True:
                try:
                    done = await on_loop()
                except Exception as exc:  # counted and requeued inside the reconcile
                    log.error("reconcile failed (requeued): %r", exc, exc_info=exc)
                    done = True
                if not done:
                    self.hand_over(*key)
                    return
                if not self.finish(*key):
                    return
        except BaseException:
            with self._lock:
                self._release(key)
            raise

    def _taken(self, key: ObjectKey) -> bool:
        """Whether a reconcile of the key is queued or running (the lock held); a running
        one is marked dirty, so it runs once more and sees what was asked for."""
        if key in self._running:
            self._dirty.add(key)
            return True
        return key in self._queued

    def _release(self, key: ObjectKey) -> None:
        """Let go of a running key (the lock held)."""
        self._running.discard(key)
        self._dirty.discard(key)

    def _submit(self, executor: Executor, key: ObjectKey) -> None:
        try:
            executor.submit(self._process, key)
        except RuntimeError:  # the pool is shutting down
            with self._lock:
                self._queued.discard(key)

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
                # Decided and released under one lock: a request between the two would
                # mark a key dirty that no pass is left to serve.
                if not self.finish(*key):
                    return
        except BaseException:
            with self._lock:
                self._release(key)
            raise
