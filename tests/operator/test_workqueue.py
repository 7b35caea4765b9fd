"""The work queue (shared/workqueue.py) on a real thread pool: requests for a queued object
coalesce, a request during its reconcile runs it once more afterwards, one object is never
reconciled by two threads at once, and an unbound queue takes nothing."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from posttrain.operator.shared.workqueue import WorkQueue


def test_an_unbound_queue_takes_nothing() -> None:
    queue = WorkQueue(lambda kind, namespace, name: None)
    assert queue.add("TrainingRun", "ns", "a") is False


def test_requests_coalesce_and_one_during_a_reconcile_runs_it_once_more() -> None:
    started, release = threading.Event(), threading.Event()
    runs: list[tuple[str, str, str]] = []
    concurrent, most = [0], [0]
    lock = threading.Lock()

    def reconcile(kind: str, namespace: str, name: str) -> None:
        with lock:
            concurrent[0] += 1
            most[0] = max(most[0], concurrent[0])
            runs.append((kind, namespace, name))
        if len(runs) == 1:
            started.set()
            assert release.wait(10)
        with lock:
            concurrent[0] -= 1

    queue = WorkQueue(reconcile)
    with ThreadPoolExecutor(8) as pool:
        queue.bind(pool)
        assert queue.add("RolloutPool", "ns", "p")
        assert started.wait(10)
        for _ in range(20):  # while it runs: one more pass, not twenty
            assert queue.add("RolloutPool", "ns", "p")
        release.set()
    assert runs == [("RolloutPool", "ns", "p")] * 2
    assert most[0] == 1


def test_a_failed_reconcile_does_not_stop_the_queue() -> None:
    seen: list[str] = []

    def reconcile(kind: str, namespace: str, name: str) -> None:
        seen.append(name)
        if name == "bad":
            raise RuntimeError("refused")

    queue = WorkQueue(reconcile)
    with ThreadPoolExecutor(1) as pool:
        queue.bind(pool)
        queue.add("SandboxWarmPool", "ns", "bad")
        queue.add("SandboxWarmPool", "ns", "good")
    assert seen == ["bad", "good"]
    queue.unbind()
    assert queue.add("SandboxWarmPool", "ns", "good") is False
