"""Lean list+watch informers, run on the operator's event loop (runtime.py), one per watched
kind and namespace: the SandboxTask burst path (SandboxTasks, labelled pods), TrainingRuns,
RolloutPools, SandboxWarmPools, rollout Deployments, KubeRay's RayClusters and Kueue's
Workloads (docs/operator.md, "One event path").

Why not Kopf's watch, which the operator used before (#32): Kopf runs every event through
its per-object machinery (a worker task per object, Body/Patch wrappers, a kwargs context
per handler call); a py-spy ``--gil`` profile of a 500-task burst put half the operator's
CPU there, for two events per task that need a cache update and, for a new task, one pod
create. An Informer here lists, then watches from the list's resourceVersion, and hands
each event to a plain callback.

Behind a :class:`Gate`: a replica that is not the leader (leader.LeaseGate) neither lists nor
watches, and lists again when it leads again. Like any informer: bookmarks,
re-list on 410 Gone (expired resourceVersion), re-watch from the last resourceVersion after a
dropped connection, and a re-list that reports objects deleted meanwhile as DELETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
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
GATE_POLL_S = 0.1  # how often a gate re-checks whether it opened or closed
MAX_BACKOFF_S = 30.0


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class Gate:
    """Whether this replica may list/watch. This one is always open: a standalone operator
    (one replica, no leader election) works all the time; leader.LeaseGate is open while
    this replica holds the Lease."""

    def is_open(self) -> bool:
        return True

    async def wait_active(self) -> None:
        while not self.is_open():
            await asyncio.sleep(GATE_POLL_S)

    async def wait_paused(self) -> None:
        await asyncio.Event().wait()  # never


def _key(body: Body) -> Key:
    meta = body.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")


class Informer:
    """List+watch one collection (one namespace or all, optional label selector).

    ``on_event(type, body)`` runs on the loop, in stream order, for ADDED / MODIFIED / DELETED
    (a re-list reports each listed object as ADDED or MODIFIED and each vanished one as
    DELETED with its last known body). It must be quick; an exception is logged and the
    stream goes on (the periodic resync is the safety net).
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
