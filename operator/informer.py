"""Lean list+watch informers, run inside kopf's event loop: for the SandboxTask burst path
(SandboxTasks, labelled pods) and the low-rate kinds moved off kopf so far (TrainingRuns,
RolloutPools, SandboxWarmPools, rollout Deployments; docs/operator.md, "One event path").

Why not kopf's own watch for these: kopf runs every event through its per-object machinery
(a worker task per object, Body/Patch wrappers, a kwargs context per handler call); a py-spy
``--gil`` profile of a 500-task burst put half the operator's CPU there, for two events per
task that need a cache update and, for a new task, one pod create. An Informer here lists,
then watches from the list's resourceVersion, and hands each event to a plain callback.

Kept from kopf: peering (a :class:`PeeringGate` reads kopf's peering objects and applies its
rule: a paused or not yet announced replica neither lists nor watches), re-list after a pause. Like any informer: bookmarks,
re-list on 410 Gone (expired resourceVersion), re-watch from the last resourceVersion after a
dropped connection, and a re-list that reports objects deleted meanwhile as DELETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

import aiohttp
from pydantic_core import from_json

from .kube import AsyncKube, KubeError

log = logging.getLogger(__name__)

Body = dict[str, Any]
Key = tuple[str, str]
OnEvent = Callable[[str, Body], None]
LIST_PAGE = 500
PEERING_API_VERSION = "kopf.dev/v1"
GATE_POLL_S = 0.1  # how often a gate re-checks whether it opened or closed
MAX_BACKOFF_S = 30.0


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class Gate:
    """Whether this replica may list/watch. This one is always open: a standalone operator
    (one replica, no peering) works all the time; :class:`PeeringGate` follows peering."""

    def is_open(self) -> bool:
        return True

    async def wait_active(self) -> None:
        while not self.is_open():
            await asyncio.sleep(GATE_POLL_S)

    async def wait_paused(self) -> None:
        await asyncio.Event().wait()  # never


def _is_dead(entry: Body, now: datetime) -> bool:
    """A peer whose keep-alive is older than its lifetime (Kopf's ``Peer.is_dead``; a peer
    without ``lastseen`` is taken as seen now, as Kopf does)."""
    lastseen = entry.get("lastseen")
    if lastseen is None:
        return False
    seen = datetime.fromisoformat(str(lastseen))
    return seen + timedelta(seconds=int(entry.get("lifetime", 60))) <= now


def may_work(status: Body | None, priority: int, now: datetime) -> bool:
    """Kopf's peering verdict for the replica of ``priority``, from a KopfPeering's ``status``
    (``{identity: {priority, lifetime, lastseen}}``; the rule of Kopf's
    ``process_peering_event``): pause while another live peer has a higher priority, or the
    same one (Kopf then pauses every replica of that priority). One more condition, ours:
    this replica's own entry is there (a live entry of its priority), so a replica whose Kopf
    has not yet announced itself never acts, not even briefly.

    >>> now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    >>> def peer(priority, seen="2026-01-01T11:59:30+00:00"):
    ...     return {"priority": priority, "lifetime": 60, "lastseen": seen}
    >>> may_work({"me": peer(10)}, 10, now), may_work({}, 10, now), may_work(None, 10, now)
    (True, False, False)
    >>> may_work({"me": peer(10), "leader": peer(100)}, 10, now)
    False
    >>> may_work({"me": peer(10), "twin": peer(10)}, 10, now)
    False
    >>> may_work({"me": peer(10), "gone": peer(100, "2026-01-01T11:00:00+00:00")}, 10, now)
    True
    """
    live = [
        entry
        for entry in (status or {}).values()
        if isinstance(entry, dict) and not _is_dead(entry, now)
    ]
    priorities = [int(entry.get("priority", 0)) for entry in live]
    return priorities.count(priority) == 1 and not any(p > priority for p in priorities)


class PeeringGate(Gate):
    """Open while Kopf's peering lets this replica work, read from the peering objects.

    Kopf's own pause state has no public accessor (docs/operator.md, "Kopf: kept"), so the
    gate watches the same KopfPeering objects Kopf decides from (one per watched namespace,
    or the ClusterKopfPeering with ``--all-namespaces``; :meth:`informers`) and applies Kopf's
    rule (:func:`may_work`) to each. It stays closed until every one of them has been seen.
    """

    def __init__(self, peering_name: str, namespaces: Iterable[str] | None, priority: int) -> None:
        self.peering_name = peering_name
        self.namespaces: list[str | None] = list(namespaces) if namespaces is not None else [None]
        self.priority = priority
        self._needed = {(ns or "", peering_name) for ns in self.namespaces}
        self._status: dict[Key, Body] = {}

    def on_event(self, event_type: str, body: Body) -> None:
        """An informer callback for the peering objects (others of their kind are ignored)."""
        key = _key(body)
        if key not in self._needed:
            return
        if event_type == "DELETED":
            self._status.pop(key, None)
        else:
            self._status[key] = body.get("status") or {}

    def is_open(self) -> bool:
        now = datetime.now(UTC)
        return all(
            key in self._status and may_work(self._status[key], self.priority, now)
            for key in self._needed
        )

    async def wait_paused(self) -> None:
        while self.is_open():
            await asyncio.sleep(GATE_POLL_S)

    def informers(
        self, kube: AsyncKube, server_timeout: int, client_timeout: float
    ) -> list[Informer]:
        """The list+watch of the peering objects that feed :meth:`on_event` (run them with an
        open :class:`Gate`: they are how this gate learns)."""
        return [
            Informer(
                kube,
                PEERING_API_VERSION,
                "KopfPeering" if namespace else "ClusterKopfPeering",
                "kopfpeerings" if namespace else "clusterkopfpeerings",
                namespace,
                self.on_event,
                server_timeout=server_timeout,
                client_timeout=client_timeout,
            )
            for namespace in self.namespaces
        ]


def _key(body: Body) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class Informer:
    """List+watch one collection (one namespace or all, optional label selector).

    ``on_event(type, body)`` runs on the loop, in stream order, for ADDED / MODIFIED / DELETED
    (a re-list reports each listed object as ADDED or MODIFIED and each vanished one as
    DELETED with its last known body). It must be quick; an exception is logged and the
    stream goes on (the periodic resync is the safety net, as with kopf's on.event).
    """

    def __init__(
        self,
        kube: AsyncKube,
        api_version: str,
        kind: str,
        plural: str,
        namespace: str | None,
        on_event: OnEvent,
        label_selector: str = "",
        server_timeout: int = 300,
        client_timeout: float = 330.0,
    ) -> None:
        self.kube = kube
        self.api_version, self.kind = api_version, kind
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        self.path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
        self.label_selector = label_selector
        self.on_event = on_event
        self.server_timeout, self.client_timeout = server_timeout, client_timeout
        self.known: dict[Key, Body] = {}
        self.lists = 0  # how many times it (re-)listed: for logs and tests
        self.name = f"{kind} informer ({namespace or 'all namespaces'})"

    def _query(self, **params: Any) -> str:
        if self.label_selector:
            params["labelSelector"] = self.label_selector
        return f"{self.path}?{urlencode(params)}"

    def _deliver(self, event_type: str, body: Body) -> None:
        try:
            self.on_event(event_type, body)
        except Exception:
            log.exception("%s: handling %s %s/%s failed", self.name, event_type, *_key(body))

    async def run(self, gate: Gate) -> None:
        """Forever: wait until the gate opens, list+watch until it pauses, repeat."""
        while True:
            await gate.wait_active()
            work = asyncio.create_task(self._list_and_watch(), name=self.name)
            paused = asyncio.create_task(gate.wait_paused())
            try:
                await asyncio.wait({work, paused}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (work, paused):
                    task.cancel()
                await asyncio.gather(work, paused, return_exceptions=True)
            log.info("%s paused", self.name)

    async def _list_and_watch(self) -> None:
        rv: str | None = None
        backoff = 0.5
        while True:
            try:
                if rv is None:
                    rv = await self.relist()
                rv = await self.watch(rv)
                backoff = 0.5
            except Gone:
                log.info("%s: resourceVersion %s expired; listing again", self.name, rv)
                rv = None
            except (TimeoutError, aiohttp.ClientError, OSError, KubeError, ValueError) as exc:
                if isinstance(exc, KubeError) and exc.status == 410:
                    rv = None
                log.warning(
                    "%s: %s; watching again in %.1f s", self.name, exc or type(exc), backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def relist(self) -> str:
        """List everything (paged), report it, report what vanished; the list's version."""
        items: list[Body] = []
        params: dict[str, Any] = {"limit": LIST_PAGE}
        while True:
            data = (await self.kube.request("GET", self._query(**params)))[1]
            items.extend(data.get("items") or [])
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                break
            params["continue"] = token
        rv: str = data["metadata"]["resourceVersion"]
        self.lists += 1
        listed: dict[Key, Body] = {}
        for item in items:
            # List items carry no apiVersion/kind; the caches and the builders expect them.
            item.setdefault("apiVersion", self.api_version)
            item.setdefault("kind", self.kind)
            listed[_key(item)] = item
        gone = [body for key, body in self.known.items() if key not in listed]
        previous, self.known = self.known, listed
        for key, item in listed.items():
            self._deliver("MODIFIED" if key in previous else "ADDED", item)
        for body in gone:
            self._deliver("DELETED", body)
        log.debug("%s: listed %d at resourceVersion %s", self.name, len(items), rv)
        return rv

    async def watch(self, rv: str) -> str:
        """Stream events from ``rv`` until the server ends the watch; the last version seen."""
        path = self._query(
            watch=1,
            resourceVersion=rv,
            allowWatchBookmarks="true",
            timeoutSeconds=self.server_timeout,
        )
        lines = self.kube.lines(path, self.client_timeout)
        async with contextlib.aclosing(lines):
            async for line in lines:
                event = from_json(line)
                event_type, body = event.get("type"), event.get("object") or {}
                if event_type == "ERROR":
                    if body.get("code") == 410:
                        raise Gone(body.get("message"))
                    raise KubeError(
                        int(body.get("code") or 500), "WATCH", self.path, json.dumps(body)
                    )
                rv = (body.get("metadata") or {}).get("resourceVersion") or rv
                if event_type == "BOOKMARK":
                    continue
                if event_type == "DELETED":
                    self.known.pop(_key(body), None)
                else:
                    self.known[_key(body)] = body
                self._deliver(event_type, body)
        return rv
