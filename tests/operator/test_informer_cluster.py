"""The lean informer (operator/informer.py) against the real apiserver: it converges after an
expired resourceVersion (410) and after a dropped watch connection, and it neither lists nor
watches while kopf's pause toggles say so (peering)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from posttrain.operator.informer import Gate, Informer, PeeringGate
from posttrain.operator.kube import AsyncKube, KubeClient, load_credentials, resource_path

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


def _peer(priority: int, seen: datetime | None = None) -> dict[str, Any]:
    """A KopfPeering status entry as Kopf writes it (its keep-alive)."""
    when = seen or datetime.now(UTC)
    return {"priority": priority, "lifetime": 60, "lastseen": when.isoformat()}


def _set_peers(kube: KubeClient, namespace: str, peers: dict[str, Any]) -> None:
    """Merge-patch the peering object's status (None removes a peer), as Kopf's touch does."""
    kube.request(
        "PATCH",
        resource_path("kopf.dev/v1", "kopfpeerings", namespace, "op"),
        {"status": peers},
        content_type="application/merge-patch+json",
    )


def test_peering_gate_follows_the_peering_object(
    crds_installed: None, kubeconfig: Path, kube: KubeClient, namespace: str
) -> None:
    """Kopf's peering, read from the KopfPeering: nothing is listed before the object shows
    this replica, nothing while a live peer of higher (or equal) priority is there; a dead
    one does not count; after a pause the re-list reports what was deleted meanwhile."""

    async def scenario() -> None:
        _config_map(kube, namespace, "a")
        _config_map(kube, namespace, "b")
        client = AsyncKube(load_credentials(str(kubeconfig)))
        gate = PeeringGate("op", [namespace], priority=10)
        view = View()
        informer = Informer(
            client, "v1", "ConfigMap", "configmaps", namespace, view, label_selector=LABEL
        )
        watchers = [asyncio.create_task(w.run(Gate())) for w in gate.informers(client, 30, 40.0)]
        running = asyncio.create_task(informer.run(gate))
        try:
            await asyncio.sleep(0.5)
            assert informer.lists == 0 and view.events == [], "listed with no peering object"
            await asyncio.to_thread(
                kube.request,
                "POST",
                resource_path("kopf.dev/v1", "kopfpeerings", namespace),
                {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "op"}},
            )
            await asyncio.to_thread(_set_peers, kube, namespace, {"leader": _peer(100)})
            await asyncio.sleep(0.5)
            assert informer.lists == 0, "listed before this replica was announced"
            await asyncio.to_thread(_set_peers, kube, namespace, {"me": _peer(10)})
            await asyncio.sleep(0.5)
            assert informer.lists == 0, "listed while a higher-priority peer is alive"
            long_ago = datetime.now(UTC) - timedelta(minutes=5)
            await asyncio.to_thread(_set_peers, kube, namespace, {"leader": _peer(100, long_ago)})
            await _until(lambda: view.names == {"a", "b"}, "the first list (the leader is dead)")
            await asyncio.to_thread(_set_peers, kube, namespace, {"twin": _peer(10)})
            await _until(lambda: not gate.is_open(), "the pause (same priority: Kopf pauses both)")
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_delete, kube, namespace, "b")
            await asyncio.sleep(0.5)
            assert ("DELETED", "b") not in view.events, "watched while paused"
            await asyncio.to_thread(_set_peers, kube, namespace, {"twin": None})
            await _until(lambda: view.names == {"a"}, "the re-list after the pause")
            assert ("DELETED", "b") in view.events and informer.lists == 2
        finally:
            for task in (running, *watchers):
                task.cancel()
            await asyncio.gather(running, *watchers, return_exceptions=True)
            await client.close()

    _run(scenario)
