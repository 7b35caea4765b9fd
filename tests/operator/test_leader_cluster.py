"""Lease leader election (operator/leader.py) against the real apiserver: a live holder keeps
the Lease, a dead one loses it after the lease duration (as observed by the candidates), a
clean stop hands it over at once, and exactly one candidate leads at any time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.operator.kube import AsyncKube, KubeClient, load_credentials, resource_path
from posttrain.operator.leader import LEASE_API_VERSION, LeaseGate, lease_spec

pytestmark = pytest.mark.cluster

DURATION_S, DEADLINE_S, RETRY_S = 3.0, 2.0, 0.3


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_one_leader_a_dead_holder_expires_and_a_clean_stop_hands_over(
    kubeconfig: Path, kube: KubeClient, namespace: str
) -> None:
    path = resource_path(LEASE_API_VERSION, "leases", namespace, "op")

    def lease() -> dict[str, object]:
        spec: dict[str, object] = kube.request("GET", path)[1]["spec"]
        return spec

    async def scenario() -> None:
        # A holder that crashed a moment ago: it never renews again.
        await asyncio.to_thread(
            kube.request,
            "POST",
            path.rsplit("/", 1)[0],
            {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"name": "op", "namespace": namespace},
                "spec": lease_spec("crashed", int(DURATION_S), None),
            },
        )
        client = AsyncKube(load_credentials(str(kubeconfig)))
        gates = {
            who: LeaseGate(client, namespace, "op", who, DURATION_S, DEADLINE_S, RETRY_S)
            for who in ("a", "b")
        }
        tasks = {who: asyncio.create_task(gate.run()) for who, gate in gates.items()}

        def leaders() -> list[str]:
            return [who for who, gate in gates.items() if gate.is_open()]

        try:
            await asyncio.sleep(DURATION_S / 2)
            assert leaders() == [], "took the Lease of a holder that may still be alive"
            await _until(lambda: len(leaders()) == 1, "a takeover once the lease expired")
            (first,) = leaders()
            spec = await asyncio.to_thread(lease)
            assert spec["holderIdentity"] == first and spec["leaseTransitions"] == 1
            # The holder renews: nobody else leads for two lease durations.
            for _ in range(int(2 * DURATION_S / 0.1)):
                assert leaders() == [first]
                await asyncio.sleep(0.1)
            # A clean stop releases the Lease: the other takes it without waiting it out.
            tasks[first].cancel()
            await asyncio.gather(tasks[first], return_exceptions=True)
            (second,) = set(gates) - {first}
            await _until(lambda: leaders() == [second], "the hand-over", timeout_s=DURATION_S)
            spec = await asyncio.to_thread(lease)
            assert spec["holderIdentity"] == second and spec["leaseTransitions"] == 2
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await client.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
