"""The trainer's rollout wait signal (trainer/observe/rollout_wait.py): timed on a real
RolloutProducer-like take, averaged over the last steps."""

from __future__ import annotations

import doctest
import threading
from datetime import UTC, datetime
from typing import Any

from prometheus_client import REGISTRY

from posttrain.api import TrainingRunStatus
from posttrain.trainer.observe import rollout_wait
from posttrain.trainer.observe.rollout_wait import RolloutWaitWindow
from posttrain.trainer.observe.status import RunStatus


def test_docstring_examples_hold() -> None:
    result = doctest.testmod(rollout_wait)
    assert result.attempted > 0 and result.failed == 0


class SlowProducer:
    """Hands batch ``i`` out once a background thread 'sampled' it (after ``delay_s``)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.done = threading.Event()

    def take(self, batch_index: int, timeout: float) -> Any:
        threading.Timer(self.delay_s, self.done.set).start()
        assert self.done.wait(timeout)
        return f"batch-{batch_index}"


def test_take_measures_the_time_blocked_and_the_status_carries_it() -> None:
    window = RolloutWaitWindow(steps=3)
    before = datetime.now(UTC)
    batch, waited = window.take(SlowProducer(0.2), 7, timeout=30)  # type: ignore[arg-type]
    assert batch == "batch-7" and waited >= 0.2
    window.record(waited, waited * 2)  # the step took twice its wait
    wire = window.to_wire()
    assert wire is not None
    assert abs(wire["fraction"] - 0.5) < 0.01 and wire["steps"] == 1
    # The trainer's RunStatus carries it; the API's TrainingRunStatus accepts it as written.
    status = RunStatus(rollout_wait=wire).to_wire()
    parsed = TrainingRunStatus.model_validate(status).rollout_wait
    assert parsed is not None and parsed.window_start >= before.replace(microsecond=0)
    assert parsed.fraction == wire["fraction"]


def test_window_forgets_old_steps_and_starts_at_the_oldest_kept() -> None:
    window = RolloutWaitWindow(steps=2)
    starts = [datetime(2026, 1, 1, 0, 0, s, tzinfo=UTC) for s in (1, 2, 3)]
    for start, wait in zip(starts, (10.0, 0.0, 1.0), strict=True):
        window.record(wait, 10.0, start)
    wire = window.to_wire()
    assert wire == {
        "fraction": 0.05,
        "waitSeconds": 1.0,
        "stepSeconds": 20.0,
        "steps": 2,
        "windowStart": "2026-01-01T00:00:02Z",
    }
    assert RolloutWaitWindow().to_wire() is None  # before the first step: nothing to say
    # the same number on the trainer's /metrics (for an HPA through a metrics adapter)
    assert REGISTRY.get_sample_value("posttrain_trainer_rollout_wait_fraction") == 0.05
