"""How long the trainer waits for rollouts: the demand signal a RolloutPool scales on.

Rollouts are sampled in the background (``trainer/rollouts.py``); a step blocks when the
batch it needs is not done yet, and -- with batches sampled ahead (``maxPolicyLag >= 1``)
-- when it publishes while the replicas are still generating the next batch: a replica
takes new weights only between batches, so the publish waits for that sampling (the
slowest replica's ``drain`` phase). Both are time the trainer sat idle for want of
rollout capacity, and the step loop adds them. That blocked time over the step's time is
what a short pool costs the run, whatever the model, the output lengths or the hardware:
0 means the pool keeps up, 0.5 means half of every step is spent idle. The first step a
trainer process runs with batches sampled ahead is left out of the window: nothing could
be sampled ahead of it, so its wait is a cold start's, not the pool's. The trainer writes it into
``TrainingRun.status.rolloutWait`` after each RL step; the operator's autoscaler reads it
(docs/rollout.md, "Autoscaling").
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

if TYPE_CHECKING:
    from posttrain.trainer.data.rollouts import RolloutBatch, RolloutProducer

WINDOW_STEPS = 4
"""Steps averaged: enough to smooth one long-tailed batch, few enough that the signal
follows a change in demand (a new domain with longer outputs) within a few steps."""

ROLLOUT_WAIT_FRACTION = Gauge(
    "posttrain_trainer_rollout_wait_fraction",
    "Seconds blocked waiting for rollouts / step seconds, over the last few RL steps "
    "(status.rolloutWait.fraction; an HPA can scale a RolloutPool on it through an adapter)",
)


@dataclass(frozen=True)
class StepWait:
    wait_seconds: float
    step_seconds: float
    started_at: datetime


class RolloutWaitWindow:
    """The last ``steps`` steps' rollout wait, as ``status.rolloutWait``.

    >>> w = RolloutWaitWindow(steps=2)
    >>> t = datetime(2026, 1, 1, tzinfo=UTC)
    >>> for wait in (9.0, 1.0, 3.0):
    ...     w.record(wait, 10.0, t)
    >>> w.to_wire()["fraction"], w.to_wire()["steps"]
    (0.2, 2)
    """

    def __init__(self, steps: int = WINDOW_STEPS) -> None:
        self._steps: deque[StepWait] = deque(maxlen=steps)
        self._step_started_at: datetime | None = None

    def take(
        self, producer: RolloutProducer, step: int, timeout: float
    ) -> tuple[RolloutBatch, float]:
        """``producer.take(step)``, timed: the batch and the seconds blocked on it."""
        self._step_started_at = datetime.now(UTC)
        started = time.monotonic()
        batch = producer.take(step, timeout=timeout)
        return batch, time.monotonic() - started

    def record(
        self, wait_seconds: float, step_seconds: float, started_at: datetime | None = None
    ) -> None:
        """One RL step: seconds blocked on its batch, and the step's seconds; it started at
        ``started_at`` (default: when :meth:`take` was called)."""
        start = started_at or self._step_started_at or datetime.now(UTC)
        self._steps.append(StepWait(max(wait_seconds, 0.0), max(step_seconds, 0.0), start))
        wire = self.to_wire()
        if wire is not None:
            ROLLOUT_WAIT_FRACTION.set(wire["fraction"])

    def to_wire(self) -> dict[str, Any] | None:
        """camelCase, as ``TrainingRunStatus.rolloutWait``; None before the first step."""
        if not self._steps:
            return None
        wait = sum(s.wait_seconds for s in self._steps)
        total = sum(s.step_seconds for s in self._steps)
        fraction = min(wait / total, 1.0) if total > 0 else 0.0
        return {
            "fraction": round(fraction, 4),
            "waitSeconds": round(wait, 3),
            "stepSeconds": round(total, 3),
            "steps": len(self._steps),
            "windowStart": self._steps[0].started_at.isoformat().replace("+00:00", "Z"),
        }
