"""The per-object requeue (operator/shared/requeue.py) on a real event loop, no cluster:
exponential backoff, one pending retry per object, reset on success, nothing after shutdown."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from posttrain.operator.shared.requeue import Requeue


def requeues(kind: str) -> float:
    return REGISTRY.get_sample_value("posttrain_operator_requeues_total", {"kind": kind}) or 0.0


def test_failures_back_off_exponentially_and_a_success_resets() -> None:
    async def scenario() -> tuple[list[float], list[float | None], int, bool]:
        loop = asyncio.get_running_loop()
        requeue = Requeue(base_seconds=0.05, max_seconds=0.2)
        fired: list[float] = []
        delays: list[float | None] = []
        start = time.monotonic()

        def run(kind: str, namespace: str, name: str) -> None:
            fired.append(time.monotonic() - start)
            if len(fired) < 4:  # the retried reconcile fails three more times, then succeeds
                delays.append(requeue.failed(kind, namespace, name, "still failing"))
            else:
                requeue.succeeded(kind, namespace, name)

        requeue.bind(loop, run)
        delays.append(requeue.failed("SandboxTask", "ns", "t", "refused"))
        while len(fired) < 4:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # nothing more fires after the success
        return (
            fired,
            delays,
            requeue.failures("SandboxTask", "ns", "t"),
            requeue.pending("SandboxTask", "ns", "t"),
        )

    before = requeues("SandboxTask")
    fired, delays, failures, pending = asyncio.run(scenario())
    assert delays == [0.05, 0.1, 0.2, 0.2]  # doubled, capped
    assert len(fired) == 4
    gaps = [b - a for a, b in zip([0.0, *fired], fired, strict=False)]
    for gap, delay in zip(gaps, delays, strict=True):
        assert delay is not None and delay <= gap < delay + 0.15
    assert (failures, pending) == (0, False)
    assert requeues("SandboxTask") - before == 4


def test_one_pending_retry_per_object_and_success_cancels_it() -> None:
    async def scenario() -> tuple[list[tuple[str, str, str]], list[float | None]]:
        requeue = Requeue(base_seconds=0.05, max_seconds=1.0)
        fired: list[tuple[str, str, str]] = []
        requeue.bind(asyncio.get_running_loop(), lambda *key: fired.append(key))
        delays = [requeue.failed("TrainingRun", "ns", "a", "x") for _ in range(5)]
        delays.append(requeue.failed("TrainingRun", "ns", "b", "x"))  # another object
        delays.append(requeue.failed("RolloutPool", "ns", "c", "x"))
        requeue.succeeded("RolloutPool", "ns", "c")  # succeeded before its retry was due
        await asyncio.sleep(0.3)
        assert requeue.failures("TrainingRun", "ns", "a") == 5  # counted, not re-scheduled
        return fired, delays

    fired, delays = asyncio.run(scenario())
    assert delays == [0.05, None, None, None, None, 0.05, 0.05]
    assert sorted(fired) == [("TrainingRun", "ns", "a"), ("TrainingRun", "ns", "b")]


def test_nothing_is_scheduled_without_a_loop_or_after_shutdown() -> None:
    async def scenario() -> list[tuple[str, str, str]]:
        requeue = Requeue(base_seconds=0.01, max_seconds=1.0)
        fired: list[tuple[str, str, str]] = []
        assert requeue.failed("SandboxTask", "ns", "t", "x") is None  # not bound yet
        requeue.bind(asyncio.get_running_loop(), lambda *key: fired.append(key))
        assert requeue.failed("SandboxTask", "ns", "t", "x") == 0.02  # the second failure
        requeue.unbind()
        await asyncio.sleep(0.1)
        return fired

    assert asyncio.run(scenario()) == []
