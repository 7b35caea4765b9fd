"""The lean informer (operator/informer.py) against the real apiserver: it converges after an
expired resourceVersion (410) and after a dropped watch connection, and it neither lists nor
watches while another replica leads (leader.LeaseGate)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from posttrain.operator.informer import Gate, Informer
from posttrain.operator.kube import AsyncKube, KubeClient, load_credentials, resource_path
from posttrain.operator.leader import LeaseGate

pytestmark = pytest.mark.cluster

LABEL = "posttrain.io/informer-test"
GONE = (
    b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":"Failure",'
    b'"message":"too old resource version: 1 (2)","reason":"Expired","code":410}}'
)


class FaultyKube(AsyncKube):
    """The real client, except that watch number n follows ``faults[n]`` when there is one:
    "gone" answers with a 410 ERROR event, "drop" cuts the connection after one real event."""

    def __init__(self, kubeconfig: Path, faults: dict[int, str]) -> None:
        super().__init__(load_credentials(str(kubeconfig)))
        self.faults = faults
        self.watches = 0

    async def lines(self, path: str, read_timeout: float) -> AsyncIterator[bytes]:
        self.watches += 1
        fault = self.faults.get(self.watches)
        if fault == "gone":
            yield GONE
            return
        delivered = 0
        async for line in super().lines(path, read_timeout):
            yield line
            delivered += 1
            if fault == "drop" and delivered == 1:
                raise aiohttp.ClientPayloadError("connection dropped (test)")


def _config_map(kube: KubeClient, namespace: str, name: str) -> None:
    kube.request(
        "POST",
        resource_path("v1", "configmaps", namespace),
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {LABEL: "yes"}},
            "data": {"k": name},
        },
    )


def _delete(kube: KubeClient, namespace: str, name: str) -> None:
    kube.request("DELETE", resource_path("v1", "configmaps", namespace, name))


def _labelled(kube: KubeClient, namespace: str) -> set[str]:
    path = resource_path("v1", "configmaps", namespace) + f"?labelSelector={LABEL}"
    return {item["metadata"]["name"] for item in kube.request("GET", path)[1]["items"]}


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


class View:
    """What the informer reported: the current names, and every (type, name) in order."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.events: list[tuple[str, str]] = []

    def __call__(self, event_type: str, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        assert body["kind"] == "ConfigMap" and body["apiVersion"] == "v1"
        self.events.append((event_type, name))
        (self.names.discard if event_type == "DELETED" else self.names.add)(name)


def test_converges_after_410_and_a_dropped_connection(
    kubeconfig: Path, kube: KubeClient, namespace: str
) -> None:
    async def scenario() -> None:
        _config_map(kube, namespace, "before")
        client = FaultyKube(kubeconfig, {1: "gone", 2: "drop"})
        view = View()
        informer = Informer(
            client, "v1", "ConfigMap", "configmaps", namespace, view, label_selector=LABEL
        )
        running = asyncio.create_task(informer.run(Gate()))
        try:
            # Watch 1 answers 410: the informer lists again (2 lists) and watches from there.
            await _until(lambda: informer.lists == 2 and client.watches >= 2, "re-list on 410")
            assert view.names == {"before"}
            # Watch 2 delivers one event, then its connection drops.
            await asyncio.to_thread(_config_map, kube, namespace, "during")
            await _until(lambda: client.watches >= 3, "re-watch after the drop")
            # What happens after the drop arrives on watch 3, from the last resourceVersion.
            await asyncio.to_thread(_delete, kube, namespace, "before")
            await asyncio.to_thread(_config_map, kube, namespace, "after")
            want = await asyncio.to_thread(_labelled, kube, namespace)
            await _until(lambda: view.names == want, f"the informer's view = {want}")
            assert want == {"during", "after"}
            assert ("DELETED", "before") in view.events
            assert informer.lists == 2, "a dropped connection re-watches, it does not re-list"
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await client.close()

    _run(scenario)


def test_informer_follows_the_lease(kubeconfig: Path, kube: KubeClient, namespace: str) -> None:
    """Behind a LeaseGate: nothing is listed while another live replica holds the Lease; the
    informer lists once this replica takes it (the holder released it); it stops watching
    when this replica stops leading, and its re-list on leading again reports what was
    deleted meanwhile."""

    async def scenario() -> None:
        _config_map(kube, namespace, "a")
        _config_map(kube, namespace, "b")
        client = AsyncKube(load_credentials(str(kubeconfig)))
        timings = (3.0, 2.0, 0.2)  # lease duration, renew deadline, retry period (s)
        other = LeaseGate(client, namespace, "op", "other", *timings)
        me = LeaseGate(client, namespace, "op", "me", *timings)
        assert await other.try_acquire_or_renew()
        holding = asyncio.create_task(other.run())
        view = View()
        informer = Informer(
            client, "v1", "ConfigMap", "configmaps", namespace, view, label_selector=LABEL
        )
        running = asyncio.create_task(informer.run(me))
        leading = asyncio.create_task(me.run())
        try:
            await asyncio.sleep(1.0)
            assert informer.lists == 0 and view.events == [], "listed while another led"
            holding.cancel()  # a clean stop: the Lease is released
            await asyncio.gather(holding, return_exceptions=True)
            await _until(lambda: view.names == {"a", "b"}, "the first list (this replica leads)")
            leading.cancel()
            await asyncio.gather(leading, return_exceptions=True)
            assert not me.is_open()
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_delete, kube, namespace, "b")
            await asyncio.sleep(0.5)
            assert ("DELETED", "b") not in view.events, "watched while not leading"
            leading = asyncio.create_task(me.run())
            await _until(lambda: view.names == {"a"}, "the re-list on leading again")
            assert ("DELETED", "b") in view.events and informer.lists == 2
        finally:
            for task in (running, leading, holding):
                task.cancel()
            await asyncio.gather(running, leading, holding, return_exceptions=True)
            await client.close()

    _run(scenario)
