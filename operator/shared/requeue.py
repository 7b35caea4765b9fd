"""Per-object requeue with exponential backoff: a failed reconcile is retried for that object
soon, not at the next resync.

Like controller-runtime's work queue with its per-item rate limiter: a reconcile that raises
(or asks for a retry, :class:`RetryLater`) schedules one retry of that object after
``base, 2 base, 4 base ...`` seconds, capped; a success forgets the failures and cancels the
pending retry; any number of failures while a retry is pending leave one retry pending
(deduplicated per object). Reconciles run on threads and on the event loop, so the
bookkeeping is under a lock and the timers live on the operator's loop
(:meth:`Requeue.bind`); before it is bound (or after shutdown) a failure is only counted and
the resync is the safety net, as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from ..metrics import REQUEUES

log = logging.getLogger(__name__)

ObjectKey = tuple[str, str, str]
"""(kind, namespace, name)."""


class RetryLater(Exception):
    """Raised inside a reconcile that could not finish for a reason expected to pass (storage
    credentials not mintable yet, a child name still held by a deleted owner's child): the
    object is requeued with backoff, without counting a reconcile error."""


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """Seconds before the retry after ``failures`` consecutive failures (1 = the first).

    >>> [backoff_delay(n, 1.0, 60.0) for n in range(1, 9)]
    [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    >>> backoff_delay(200, 0.5, 30.0)
    30.0
    """
    return min(cap, base * 2.0 ** min(failures - 1, 62))


class Requeue:
    """The retries of one operator process: failures per object, at most one pending retry
    per object, timers on the operator's event loop."""

    def __init__(self, base_seconds: float, max_seconds: float) -> None:
        self.base_seconds = base_seconds
        self.max_seconds = max_seconds
        self._failures: dict[ObjectKey, int] = {}
        self._pending: dict[ObjectKey, object] = {}  # key -> token of its one scheduled retry
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._run: Callable[[str, str, str], None] | None = None

    def bind(self, loop: asyncio.AbstractEventLoop, run: Callable[[str, str, str], None]) -> None:
        """Start scheduling retries on ``loop``; ``run(kind, namespace, name)`` is called on
        the loop when one is due and must not block (it hands the reconcile to a thread)."""
        self._loop, self._run = loop, run

    def unbind(self) -> None:
        """Stop scheduling (shutdown); pending retries are dropped."""
        with self._lock:
            self._loop, self._run = None, None
            self._pending.clear()

    def failures(self, kind: str, namespace: str, name: str) -> int:
        """Consecutive failed reconciles of the object (0 after a success)."""
        with self._lock:
            return self._failures.get((kind, namespace, name), 0)

    def pending(self, kind: str, namespace: str, name: str) -> bool:
        """Whether a retry of the object is scheduled."""
        with self._lock:
            return (kind, namespace, name) in self._pending

    def failed(self, kind: str, namespace: str, name: str, why: object) -> float | None:
        """Count a failure and schedule the object's retry unless one is pending; the delay
        scheduled (None when a retry was already pending or no loop is bound)."""
        key = (kind, namespace, name)
        with self._lock:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            loop = self._loop
            if key in self._pending or loop is None:
                log.debug("%s %s/%s failed again (%s); retry already pending", kind, *key[1:], why)
                return None
            token = object()
            self._pending[key] = token
        delay = backoff_delay(failures, self.base_seconds, self.max_seconds)
        try:
            loop.call_soon_threadsafe(self._arm, key, token, delay)
        except RuntimeError:  # the loop is closed: shutting down
            with self._lock:
                self._pending.pop(key, None)
            return None
        REQUEUES.labels(kind).inc()
        log.warning(
            "%s %s/%s: retry %d in %.1f s after a failed reconcile: %s",
            kind,
            *key[1:],
            failures,
            delay,
            why,
        )
        return delay

    def succeeded(self, kind: str, namespace: str, name: str) -> None:
        """A reconcile of the object succeeded: reset its backoff, drop its pending retry."""
        key = (kind, namespace, name)
        if key not in self._failures and key not in self._pending:
            return  # the common case, without the lock (a racing failure is newer anyway)
        with self._lock:
            self._failures.pop(key, None)
            self._pending.pop(key, None)

    forget = succeeded
    """The object is gone: the same bookkeeping."""

    def _arm(self, key: ObjectKey, token: object, delay: float) -> None:
        if self._loop is not None:
            self._loop.call_later(delay, self._fire, key, token)

    def _fire(self, key: ObjectKey, token: object) -> None:
        with self._lock:
            if self._pending.get(key) is not token:
                return  # cancelled by a success, the object's deletion or shutdown
            del self._pending[key]
            run = self._run
        if run is not None:
            run(*key)
