"""Bounded exponential backoff for calls to remote storage.

Kept separate from the stores so the policy is a plain value that callers can tune per use
(a checkpoint save may wait minutes for MinIO to come back; a trajectory flush must not
block the training loop and fails fast, leaving the chunk spooled).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from posttrain.storage.metrics import STORAGE_RETRIES

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long to keep retrying a transient failure.

    Retries stop at whichever limit comes first: ``max_attempts`` calls in total, or
    ``max_elapsed_s`` seconds since the first call.
    """

    max_attempts: int = 12
    initial_delay_s: float = 0.5
    max_delay_s: float = 8.0
    multiplier: float = 2.0
    max_elapsed_s: float = 120.0
    jitter: float = 0.1

    @classmethod
    def no_retry(cls) -> RetryPolicy:
        """One attempt only: for callers that have their own fallback (the trajectory spool)."""
        return cls(max_attempts=1, max_elapsed_s=0.0)

    def delay_for(self, attempt: int) -> float:
        """Backoff before retry number ``attempt`` (1-based), without jitter.

        >>> RetryPolicy(initial_delay_s=0.5, max_delay_s=3.0).delay_for(1)
        0.5
        >>> [RetryPolicy(initial_delay_s=0.5, max_delay_s=3.0).delay_for(n) for n in (2, 3, 4)]
        [1.0, 2.0, 3.0]
        """
        return min(self.max_delay_s, self.initial_delay_s * self.multiplier ** (attempt - 1))


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    describe: str,
    on_exhausted: Callable[[BaseException, int, float], BaseException],
) -> T:
    """Run ``fn`` until it succeeds, raises a non-transient error, or the policy runs out.

    ``on_exhausted(last_error, attempts, elapsed_s)`` builds the exception raised when the
    budget is spent, so each store can name its own endpoint in the message.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed = time.monotonic() - start
            delay = policy.delay_for(attempt) * (1 + random.uniform(-policy.jitter, policy.jitter))
            if attempt >= policy.max_attempts or elapsed + delay > policy.max_elapsed_s:
                raise on_exhausted(exc, attempt, elapsed) from exc
            STORAGE_RETRIES.labels(operation=describe.split(" ", 1)[0]).inc()
            log.warning(
                "%s failed (attempt %d/%d, %.1fs elapsed): %s; retrying in %.1fs",
                describe,
                attempt,
                policy.max_attempts,
                elapsed,
                short_error(exc),
                delay,
            )
            time.sleep(delay)


def short_error(exc: BaseException) -> str:
    """One line describing ``exc`` (urllib3 errors nest long reprs)."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
