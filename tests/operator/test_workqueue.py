"""The work queue (shared/workqueue.py) on a real thread pool and a real event loop: requests
for a queued object coalesce, a request during its reconcile runs it once more afterwards,
one object is never reconciled twice at once (by two threads, or by the loop and a thread),
and an unbound queue takes nothing."""

from __future__ import annotations

import asyncio
import contextlib
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


# ------------------------------------------------------------ claimed on the loop
# The SandboxTask burst: a key claimed by the event loop counts as running for the pool and
# for other claims, its passes run on a real asyncio loop, and a pass handed to the pool
# keeps the key taken until the pool is done.

KEY = ("SandboxTask", "ns", "t")


class Passes:
    """Who reconciled the key, in order, and the most reconciles of it at once (loop and
    threads together)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.most = 0
        self._now = 0
        self._lock = threading.Lock()

    def enter(self, where: str) -> None:
        with self._lock:
            self.log.append(where)
            self._now += 1
            self.most = max(self.most, self._now)

    def leave(self) -> None:
        with self._lock:
            self._now -= 1


class BlockedPool:
    """A reconcile that records every name and holds its thread on the key "blocker" until
    released: with a one-thread pool, what is added next stays queued, not started."""

    def __init__(self) -> None:
        self.busy, self.release = threading.Event(), threading.Event()
        self.runs: list[str] = []

    def reconcile(self, kind: str, namespace: str, name: str) -> None:
        self.runs.append(name)
        if name == "blocker":
            self.busy.set()
            assert self.release.wait(10)


def test_a_claimed_key_takes_no_other_reconcile_and_finish_reports_requests_once() -> None:
    runs: list[tuple[str, str, str]] = []
    queue = WorkQueue(lambda *key: runs.append(key))
    with ThreadPoolExecutor(4) as pool:
        queue.bind(pool)
        assert queue.claim(*KEY)
        assert not queue.claim(*KEY)  # the loop's own second event: one more pass
        for _ in range(5):  # the requeue or the resync meanwhile: no thread starts
            assert queue.add(*KEY)
        assert queue.finish(*KEY)  # asked for meanwhile: the caller runs it again
        assert not queue.finish(*KEY)  # nothing since: released
        assert queue.claim(*KEY)  # free again
        assert not queue.finish(*KEY)
        assert queue.add(*KEY)  # not claimed: the pool runs it
    assert runs == [KEY]


def test_a_claim_while_the_pool_runs_the_key_asks_for_one_more_pass_there() -> None:
    started, release = threading.Event(), threading.Event()
    passes = Passes()

    def reconcile(kind: str, namespace: str, name: str) -> None:
        passes.enter(f"pool {name}")
        try:
            if name == "t" and passes.log.count("pool t") == 1:
                started.set()
                assert release.wait(10)
        finally:
            passes.leave()

    queue = WorkQueue(reconcile)
    with ThreadPoolExecutor(4) as pool:
        queue.bind(pool)
        assert queue.add(*KEY)
        assert started.wait(10)
        for _ in range(10):
            assert not queue.claim(*KEY)
        release.set()
    assert passes.log == ["pool t", "pool t"]
    assert passes.most == 1
    assert queue.claim(*KEY)  # the pool's passes are over


def test_a_claim_of_a_queued_key_coalesces_into_the_queued_pass() -> None:
    blocked = BlockedPool()
    busy, release, runs = blocked.busy, blocked.release, blocked.runs
    queue = WorkQueue(blocked.reconcile)
    with ThreadPoolExecutor(1) as pool:  # one thread, held by the blocker
        queue.bind(pool)
        assert queue.add("SandboxTask", "ns", "blocker")
        assert busy.wait(10)
        assert queue.add(*KEY)  # queued behind it, not started
        for _ in range(5):
            assert not queue.claim(*KEY)  # it has not read the cache yet: no second pass
        release.set()
    assert runs == ["blocker", "t"]


def test_events_during_a_loop_pass_run_it_exactly_once_more_on_the_loop() -> None:
    passes = Passes()
    pool_runs: list[tuple[str, str, str]] = []

    async def main() -> None:
        queue = WorkQueue(lambda *key: pool_runs.append(key))
        with ThreadPoolExecutor(4) as pool:
            queue.bind(pool)
            in_pass, release = asyncio.Event(), asyncio.Event()

            async def on_loop() -> bool:
                passes.enter("loop")
                try:
                    in_pass.set()
                    if passes.log.count("loop") == 1:
                        await release.wait()
                    return True
                finally:
                    passes.leave()

            assert queue.claim(*KEY)
            task = asyncio.create_task(queue.reconcile_claimed(*KEY, on_loop))
            await in_pass.wait()
            for _ in range(10):  # the new pod's events, ahead of the create's response
                assert not queue.claim(*KEY)
            # and a due retry from another thread
            assert await asyncio.to_thread(queue.add, *KEY)
            release.set()
            await asyncio.wait_for(task, 10)
            assert queue.claim(*KEY)  # released after the second pass
            assert not queue.finish(*KEY)

    asyncio.run(main())
    assert passes.log == ["loop", "loop"]
    assert passes.most == 1
    assert pool_runs == []


def test_a_pass_the_loop_cannot_do_goes_to_the_pool_without_a_second_reconcile() -> None:
    passes = Passes()
    pool_started, pool_release = threading.Event(), threading.Event()

    def reconcile(kind: str, namespace: str, name: str) -> None:
        passes.enter("pool")
        try:
            if passes.log.count("pool") == 1:
                pool_started.set()
                assert pool_release.wait(10)
        finally:
            passes.leave()

    async def on_loop() -> bool:
        passes.enter("loop")
        passes.leave()
        return False  # e.g. a status transition: needs the blocking client

    async def main() -> None:
        queue = WorkQueue(reconcile)
        with ThreadPoolExecutor(4) as pool:
            queue.bind(pool)
            assert queue.claim(*KEY)
            await asyncio.wait_for(queue.reconcile_claimed(*KEY, on_loop), 10)
            assert await asyncio.to_thread(pool_started.wait, 10)
            for _ in range(10):  # events while the pool has it: not claimed, one more pass
                assert not queue.claim(*KEY)
            assert queue.add(*KEY)
            pool_release.set()
            await asyncio.to_thread(pool.shutdown, True)
        assert queue.claim(*KEY)  # the pool's passes are over: the next event may claim it

    asyncio.run(main())
    assert passes.log == ["loop", "pool", "pool"]
    assert passes.most == 1


def test_requests_before_a_handed_over_pass_starts_coalesce_into_it() -> None:
    blocked = BlockedPool()
    busy, release, runs = blocked.busy, blocked.release, blocked.runs
    queue = WorkQueue(blocked.reconcile)
    with ThreadPoolExecutor(1) as pool:
        queue.bind(pool)
        assert queue.add("SandboxTask", "ns", "blocker")
        assert busy.wait(10)
        assert queue.claim(*KEY)
        assert not queue.claim(*KEY)  # asked for during the loop's pass ...
        assert queue.hand_over(*KEY)  # ... which is served by the handed-over pass
        assert not queue.claim(*KEY)
        assert queue.add(*KEY)
        release.set()
    assert runs == ["blocker", "t"]


def test_a_failed_loop_pass_still_runs_once_more_if_asked_and_releases_the_key() -> None:
    passes: list[str] = []

    async def main() -> None:
        queue = WorkQueue(lambda *key: None)
        with ThreadPoolExecutor(2) as pool:
            queue.bind(pool)

            async def on_loop() -> bool:
                passes.append("loop")
                if len(passes) == 1:
                    assert not queue.claim(*KEY)  # an event during the failing pass
                    raise RuntimeError("create refused")  # requeued by the reconcile
                return True

            assert queue.claim(*KEY)
            await asyncio.wait_for(queue.reconcile_claimed(*KEY, on_loop), 10)
            assert queue.claim(*KEY)
            assert not queue.finish(*KEY)

    asyncio.run(main())
    assert passes == ["loop", "loop"]


def test_a_cancelled_loop_pass_releases_the_key() -> None:
    async def main() -> None:
        queue = WorkQueue(lambda *key: None)
        with ThreadPoolExecutor(2) as pool:
            queue.bind(pool)
            entered = asyncio.Event()

            async def on_loop() -> bool:
                entered.set()
                await asyncio.sleep(60)
                return True

            assert queue.claim(*KEY)
            task = asyncio.create_task(queue.reconcile_claimed(*KEY, on_loop))
            await entered.wait()
            assert not queue.claim(*KEY)
            task.cancel()  # shutdown
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled()
            assert queue.claim(*KEY)

    asyncio.run(main())


def test_nothing_is_claimed_or_handed_over_outside_bind() -> None:
    runs: list[tuple[str, str, str]] = []
    queue = WorkQueue(lambda *key: runs.append(key))
    assert not queue.claim(*KEY)  # before bind
    with ThreadPoolExecutor(2) as pool:
        queue.bind(pool)
        assert queue.claim(*KEY)
        assert not queue.claim(*KEY)  # asked for again ...
        queue.unbind()  # ... but the operator stops
        assert not queue.finish(*KEY)
        assert not queue.claim(*KEY)
        queue.bind(pool)
        assert queue.claim(*KEY)
        queue.unbind()
        assert not queue.hand_over(*KEY)  # released, nothing queued
        queue.bind(pool)
        assert queue.claim(*KEY)  # the key was let go
        assert not queue.finish(*KEY)
    assert runs == []
