"""An asyncio Kubernetes REST client for the burst path: watch streams and pod creates made on
the operator's event loop (aiohttp, kopf's own HTTP stack, keep-alive pooled; JSON through
pydantic-core, 1.5x (parse) to 3x (serialise) faster than the json module on pod bodies).

Why next to the synchronous KubeClient: in a burst of SandboxTasks each task cost a hop to a
reconciler thread plus a synchronous httpx request; py-spy (``--gil``, 500 tasks) put a quarter
of the operator's CPU there. Only the hot path uses this client (see informer.py); everything
else still goes through KubeClient on kopf's thread pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
from pydantic_core import from_json, to_json
from yarl import URL

from .kube import PLURALS, Credentials, KubeError, resource_path, ssl_context

log = logging.getLogger(__name__)

Body = dict[str, Any]
JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}


class AsyncKube:
    """One aiohttp session (created on first use, inside the running loop)."""

    def __init__(
        self,
        creds: Credentials,
        pool_size: int = 64,
        timeout: float = 30.0,
        reload: Callable[[], Credentials] | None = None,
    ) -> None:
        """``reload`` re-reads credentials after a 401 (rotated service-account tokens)."""
        self._creds = creds
        self._server = creds.server.rstrip("/")
        self._pool_size = pool_size
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._reload = reload
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None
        self._auth = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}

    def _http(self, watch: bool = False) -> aiohttp.ClientSession:
        """The request session (at most pool_size connections) or the watch session (one
        long-lived connection per watch, unlimited: watches must never starve requests)."""
        session = self._watch_session if watch else self._session
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                ssl=ssl_context(self._creds), limit=0 if watch else self._pool_size
            )
            # No cookies: the apiserver sets none, and the jar costs per response.
            session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=self._auth,
                timeout=self._timeout,
            )
            if watch:
                self._watch_session = session
            else:
                self._session = session
        return session

    def _url(self, path: str) -> URL:
        return URL(self._server + path, encoded=True)

    async def _reauthenticate(self) -> bool:
        """After a 401: re-read the credentials; True when there is a new token to try."""
        if self._reload is None:
            return False
        fresh = await asyncio.get_running_loop().run_in_executor(None, self._reload)
        if not fresh.token:
            return False
        self._auth = {"Authorization": f"Bearer {fresh.token}"}
        await self.close()  # the sessions carry the old header; new ones get the new one
        log.info("API token rejected (401); retrying with re-read credentials")
        return True

    async def request(
        self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201, 202)
    ) -> tuple[int, Body]:
        """Send one JSON request; statuses outside ``ok`` raise KubeError (as KubeClient)."""
        data = None if body is None else to_json(body)
        for attempt in (1, 2):
            async with self._http().request(
                method, self._url(path), data=data, headers=JSON_HEADERS
            ) as response:
                status, raw = response.status, await response.read()
            if status == 401 and attempt == 1 and await self._reauthenticate():
                continue
            break
        if status not in ok:
            raise KubeError(status, method, path, raw.decode(errors="replace"))
        return status, (from_json(raw) if raw else {})

    async def create_or_adopt(self, manifest: Body) -> tuple[bool, Body]:
        """KubeClient.create_or_adopt on the loop: (created, object); a 409 adopts."""
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], PLURALS[manifest["kind"]], meta["namespace"])
        status, data = await self.request("POST", path, manifest, ok=(201, 200, 409))
        if status == 409:
            _, data = await self.request("GET", f"{path}/{meta['name']}")
            return False, data
        return True, data

    async def lines(self, path: str, read_timeout: float) -> AsyncGenerator[bytes, None]:
        """The non-empty lines of a streaming GET (a watch: one JSON event per line).

        Split here rather than with the stream's readline, which refuses lines over 128 KiB
        (a SandboxTask with inline files can be larger).
        """
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout)
        async with self._http(watch=True).get(self._url(path), timeout=timeout) as response:
            status = response.status
            if status != 200:
                text = (await response.read()).decode(errors="replace")
            else:
                pending = b""
                async for chunk in response.content.iter_any():
                    if pending:
                        chunk = pending + chunk
                    *complete, pending = chunk.split(b"\n")
                    for line in complete:
                        if line:
                            yield line
                return
        if status == 401:
            await self._reauthenticate()  # the caller's next watch uses the new token
        raise KubeError(status, "GET", path, text)

    async def close(self) -> None:
        sessions, self._session, self._watch_session = (
            [self._session, self._watch_session],
            None,
            None,
        )
        for session in sessions:
            if session is not None:
                await session.close()
