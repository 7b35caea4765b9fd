"""Lean list+watch informers for the SandboxTask burst path, run inside kopf's event loop.

Why not kopf's own watch for these: kopf runs every event through its per-object machinery
(a worker task per object, Body/Patch wrappers, a kwargs context per handler call); a py-spy
``--gil`` profile of a 500-task burst put half the operator's CPU there, for two events per
task that need a cache update and, for a new task, one pod create. An Informer here lists,
then watches from the list's resourceVersion, and hands each event to a plain callback.

Kept from kopf: peering (a Gate over kopf's own pause toggles: a paused or not yet
elected replica neither lists nor watches), re-list after a pause. Like any informer: bookmarks,
re-list on 410 Gone (expired resourceVersion), re-watch from the last resourceVersion after a
dropped connection, and a re-list that reports objects deleted meanwhile as DELETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any, Protocol
from urllib.parse import urlencode

import aiohttp
from pydantic_core import from_json

from .akube import AsyncKube
from .kube import KubeError

log = logging.getLogger(__name__)

Body = dict[str, Any]
Key = tuple[str, str]
OnEvent = Callable[[str, Body], None]
LIST_PAGE = 500
MAX_BACKOFF_S = 30.0


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): list again."""


class PauseToggles(Protocol):
    """kopf's operator_paused ToggleSet, as far as the Gate uses it."""

    def is_on(self) -> bool: ...
    def __iter__(self) -> Any: ...
    async def wait_for(self, state: bool, /) -> None: ...


class Gate:
    """Whether this replica may list/watch: kopf's ``operator_paused`` is off.

    With peering, kopf creates one pause toggle per peering object (already on until the
    first peering event shows this replica leads) only once its orchestration starts; until
    those toggles exist the gate stays closed, so a follower never acts, not even briefly.
    """

    def __init__(self, paused: PauseToggles | None, peering_toggles: Collection[str] = ()) -> None:
        self._paused = paused
        self._needed = frozenset(peering_toggles)

    def _ready(self) -> bool:
        if self._paused is None:
            return True
        names = {toggle.name for toggle in self._paused}
        return self._needed <= names and not self._paused.is_on()

    async def wait_active(self) -> None:
        while not self._ready():
            await asyncio.sleep(0.1)

    async def wait_paused(self) -> None:
        if self._paused is None:
            await asyncio.Event().wait()  # never
        else:
            await self._paused.wait_for(True)


def peering_toggle_names(peering_name: str, namespaces: Iterable[str] | None) -> set[str]:
    """The names kopf gives its per-peering pause toggles (``None``: cluster-wide).

    >>> sorted(peering_toggle_names("op", ["a", "b"])), peering_toggle_names("op", None)
    (['op@a', 'op@b'], {'op@None'})
    """
    return {f"{peering_name}@{ns}" for ns in (namespaces if namespaces is not None else [None])}


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


def kopf_pause_toggles(tasks: Iterable[asyncio.Task[Any]]) -> PauseToggles:
    """kopf's ``operator_paused`` toggles, from the tasks that ``kopf.spawn_tasks`` returned
    (kopf passes them only to its own processor; no public API exposes them).

    The one use of kopf's internals left (docs/operator.md, "kopf's public API"): kopf is
    pinned (pyproject); if its internals move, this fails loudly at start-up rather than
    running informers that ignore peering.
    """
    for task in tasks:
        if task.get_name() != "multidimensional multitasker":
            continue
        guard = task.get_coro()
        orchestrator = guard.cr_frame.f_locals["coro"]  # type: ignore[union-attr]
        processor = orchestrator.cr_frame.f_locals["processor"]
        if isinstance(processor, functools.partial):
            paused: PauseToggles = processor.keywords["operator_paused"]
            return paused
    raise RuntimeError("cannot find kopf's pause toggles (kopf internals changed?)")
