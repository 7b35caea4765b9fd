"""The run's live status: what ``kubectl get tr`` and the operator read while it trains.

One object owns it because two kinds of thread write it: the training loop after each step,
and the verifier threads when the sandbox's health changes (the operator shows that as the
SandboxAvailable condition at once, not a step later). Both go through one lock, and each
report sends the whole trainer-owned status (:class:`RunStatus`), so a report never carries
half of another's update.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from posttrain.trainer.observe.rollout_wait import RolloutWaitWindow
from posttrain.trainer.observe.status import RunStatus, StatusReporter

SANDBOX_REPORT_INTERVAL_S = 10.0
"""While a failing sandbox keeps a step waiting, its health is re-reported at most this often."""


class LiveStatus:
    """The trainer-owned status of one run, its reporter, and the rollout-wait window
    (``status.rolloutWait``, the signal a RolloutPool autoscales on)."""

    def __init__(self, reporter: StatusReporter) -> None:
        self.reporter = reporter
        self.waits = RolloutWaitWindow()
        self.status = RunStatus()  # replaced by begin() once the run knows where it starts
        self._lock = threading.Lock()
        self._started = False  # nothing is reported before begin()
        self._sandbox_reported = (True, 0.0)  # (available, when) of the last health report

    def begin(self, status: RunStatus) -> None:
        """Start reporting from ``status`` (the step, stage and checkpoint resumed from)."""
        with self._lock:
            self.status, self._started = status, True

    @contextmanager
    def editing(self) -> Iterator[RunStatus]:
        """The status to change fields of, under the lock (the next report sends them)."""
        with self._lock:
            yield self.status

    def report(
        self, step: int, version: int, stages: list[dict[str, Any]], sandbox: Any = None
    ) -> None:
        """Send the status with the loop's counters, the stages, the rollout wait and
        ``sandbox`` (a ``verification.SandboxHealth``, when code runs in a sandbox)."""
        with self._lock:
            status = self.status
            status.step, status.weight_version = step, version
            status.stages = list(stages)
            status.rollout_wait = self.waits.to_wire()
            if sandbox is not None and status.sandbox is not None:
                status.sandbox = sandbox.to_wire()
            self.reporter.report(status)

    def report_sandbox(self, health: Any) -> None:  # verification.SandboxHealth
        """Put the sandbox's health into the status at once when it changes, and at most
        every :data:`SANDBOX_REPORT_INTERVAL_S` while a failing sandbox keeps the step
        waiting. Before :meth:`begin` there is nothing to report yet."""
        now = time.monotonic()
        with self._lock:
            was_available, reported_at = self._sandbox_reported
            if not self._started or (
                health.available == was_available and now - reported_at < SANDBOX_REPORT_INTERVAL_S
            ):
                return
            self._sandbox_reported = (health.available, now)
            self.status.sandbox = health.to_wire()
            self.reporter.report(self.status)
