"""The operator's one Kubernetes REST client: :class:`AsyncKube` (aiohttp, keep-alive pooled,
dict bodies, JSON through pydantic-core) and :class:`KubeClient`, its synchronous facade for
the reconciler threads.

Why one asyncio client with a facade (measured, docs/operator.md "One REST client"): the burst
path creates pods and watches on the operator's event loop, where aiohttp spends ~0.12
client CPU-s per 500 pod creates against ~1.1 for httpx's AsyncClient; the threads reach the
same client through a loop of its own (~0.21 CPU-s per 500, against ~0.41 for the synchronous
httpx client they used before). Why not the generated ``kubernetes`` client: it validates
every body into typed models, which costs more than the request itself in a burst, and the
operator only needs create / merge-patch / delete / get / list / watch on a handful of paths.
Credentials come from the kubeconfig or the in-cluster service account (:func:`load_credentials`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlencode

import aiohttp
import uvloop
from pydantic_core import from_json, to_json
from yarl import URL

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
Body = dict[str, Any]
T = TypeVar("T")


class KubeError(RuntimeError):
    """An API request failed with a status the caller did not expect."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status


class KubeUnreachable(KubeError):
    """The request got no HTTP answer (connection refused or dropped, timeout): status 0, so
    every ``except KubeError`` also covers a transport failure."""


class SupersededChild(KubeError):
    """A child's name is still held by the child of a deleted owner of the same name (another
    uid) that the garbage collector has not removed yet: it was deleted, and the owner's
    next reconcile creates its own."""


def controller_uid(obj: dict[str, Any]) -> str | None:
    """The uid of ``obj``'s controlling owner, if any.

    >>> controller_uid({"metadata": {"ownerReferences": [{"uid": "a"}, {"uid": "b", "controller": True}]}})
    'b'
    """
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


@dataclass(frozen=True)
class Credentials:
    """Where the apiserver is and how to authenticate (client cert and/or bearer token)."""

    server: str
    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    token: str | None = None
    insecure: bool = False


def ssl_context(creds: Credentials) -> ssl.SSLContext:
    """TLS context for the apiserver: its CA (or none checked when insecure), our client cert."""
    context = ssl.create_default_context(cafile=creds.ca_path)
    if creds.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if creds.cert_path:
        context.load_cert_chain(creds.cert_path, creds.key_path)
    return context


def load_credentials(kubeconfig: str | None) -> Credentials:
    """Credentials from ``kubeconfig``, else in-cluster, else $KUBECONFIG/~/.kube/config."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(client_configuration=cfg)
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix(
        "authorization"
    )
    token = header.split(" ", 1)[-1] if header else None
    return Credentials(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        cert_path=cfg.cert_file,
        key_path=cfg.key_file,
        token=token,
        insecure=not cfg.verify_ssl,
    )


def resource_path(api_version: str, plural: str, namespace: str, name: str = "") -> str:
    """REST path of a namespaced resource.

    >>> resource_path("v1", "pods", "ns", "p")
    '/api/v1/namespaces/ns/pods/p'
    >>> resource_path("apps/v1", "deployments", "ns")
    '/apis/apps/v1/namespaces/ns/deployments'
    """
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


# kind -> plural for every kind the operator creates (no discovery round-trips).
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments",
    "Job": "jobs",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "TrainingRun": "trainingruns",
    "RolloutPool": "rolloutpools",
    "SandboxTask": "sandboxtasks",
    "SandboxWarmPool": "sandboxwarmpools",
    "RayCluster": "rayclusters",
    "Workload": "workloads",
}


class AsyncKube:
    """One aiohttp session for requests (created on first use, inside the running loop) and
    one for watches; the asyncio client the informers, the burst path and :class:`KubeClient`
    all use."""

    def __init__(
        self,
        creds: Credentials,
        pool_size: int = 64,
        timeout: float = 30.0,
        reload: Callable[[], Credentials] | None = None,
    ) -> None:
        """``reload`` re-reads credentials after a 401: in-cluster service-account tokens are
        rotated by the kubelet (bound tokens expire), and a long-running operator must follow."""
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
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (200, 201, 202),
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Body]:
        """Send one JSON request; statuses outside ``ok`` raise KubeError, no answer at all
        KubeUnreachable. ``headers`` adds request headers, e.g. ``Impersonate-User``."""
        data = None if body is None else to_json(body)
        all_headers = {"Accept": "application/json", **(headers or {})}
        if body is not None:
            all_headers["Content-Type"] = content_type
        for attempt in (1, 2):
            try:
                async with self._http().request(
                    method, self._url(path), data=data, headers=all_headers
                ) as response:
                    status, raw = response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise KubeUnreachable(0, method, path, repr(exc)) from exc
            if status == 401 and attempt == 1 and await self._reauthenticate():
                continue
            break
        if status not in ok:
            raise KubeError(status, method, path, raw.decode(errors="replace"))
        try:
            return status, (from_json(raw) if raw else {})
        except ValueError:
            return status, {}

    def path_of(self, manifest: Body, with_name: bool = False) -> str:
        meta = manifest["metadata"]
        return resource_path(
            manifest["apiVersion"],
            PLURALS[manifest["kind"]],
            meta["namespace"],
            meta["name"] if with_name else "",
        )

    async def create_or_adopt(self, manifest: Body) -> tuple[bool, Body]:
        """Create ``manifest``; if its (deterministic) name exists already, adopt that object.

        Returns (created, object). Adoption is what makes a restarted operator idempotent. An
        object of that name controlled by *another* owner uid is not adopted: it belongs to a
        deleted predecessor of the same name (a run deleted and applied again before the
        garbage collector got to its children), so it is deleted and ``SupersededChild``
        raised; the owner's next reconcile creates its own.
        """
        path = self.path_of(manifest)
        status, data = await self.request("POST", path, manifest, ok=(201, 200, 409))
        if status != 409:
            return True, data
        _, data = await self.request("GET", self.path_of(manifest, with_name=True))
        ours, theirs = controller_uid(manifest), controller_uid(data)
        if ours is not None and theirs is not None and ours != theirs:
            meta = manifest["metadata"]
            await self.delete(
                manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
            )
            raise SupersededChild(
                409,
                "POST",
                path,
                f"{manifest['kind']} {meta['name']} belonged to an earlier owner of that "
                f"name (uid {theirs}, now {ours}): deleted it; ours follows once it is gone",
            )
        return False, data

    async def create_if_absent(self, manifest: Body) -> bool:
        """Create ``manifest`` unless its name exists (then leave that object as it is, unread:
        for Secrets, which the operator may create but never read). True when created."""
        status, _ = await self.request("POST", self.path_of(manifest), manifest, ok=(201, 200, 409))
        return status != 409

    async def patch(self, manifest_or_path: Body | str, patch: Body, subresource: str = "") -> Body:
        """JSON merge patch (RFC 7386) of an object or its status subresource."""
        path = (
            manifest_or_path
            if isinstance(manifest_or_path, str)
            else self.path_of(manifest_or_path, with_name=True)
        )
        if subresource:
            path = f"{path}/{subresource}"
        return (await self.request("PATCH", path, patch, content_type=MERGE_PATCH))[1]

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete by name; False when it was already gone."""
        path = resource_path(api_version, PLURALS[kind], namespace, name)
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        status, _ = await self.request("DELETE", path, body, ok=(200, 202, 404))
        return status != 404

    async def serves(self, api_version: str, plural: str) -> bool:
        """Whether the apiserver serves ``plural`` in ``api_version`` (API discovery).

        Discovery is readable by every authenticated user (system:discovery), so this needs no
        RBAC on CustomResourceDefinitions. A group that is not installed answers 404.
        """
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        status, data = await self.request("GET", base, ok=(200, 404))
        if status == 404:
            return False
        return any(r.get("name") == plural for r in data.get("resources") or [])

    async def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> list[Body]:
        """Objects of ``kind`` in ``namespace`` (optionally filtered by a label selector)."""
        path = resource_path(api_version, PLURALS[kind], namespace)
        if label_selector:
            path += "?" + urlencode({"labelSelector": label_selector})
        items: list[Body] = (await self.request("GET", path))[1].get("items") or []
        for item in items:
            # List items carry no apiVersion/kind; the cache and the builders expect them.
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Body | None:
        path = resource_path(api_version, PLURALS[kind], namespace, name)
        status, data = await self.request("GET", path, ok=(200, 404))
        return data if status == 200 else None

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


CLOSE_POLL_S = 0.5  # how often a waiting call checks whether the client was closed


class KubeClient:
    """:class:`AsyncKube` for threads: each call runs on the client's own event loop (a daemon
    thread) and blocks its caller until the answer; thread-safe, one instance shared by every
    reconciler thread. Its loop is never the operator's, so a caller on the operator's loop
    cannot deadlock it (though it blocks that loop while it waits, as any blocking call)."""

    def __init__(
        self,
        creds: Credentials,
        pool_size: int = 32,
        timeout: float = 30.0,
        reload: Callable[[], Credentials] | None = None,
    ) -> None:
        self.aio = AsyncKube(creds, pool_size=pool_size, timeout=timeout, reload=reload)
        self._loop = uvloop.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="posttrain-kube", daemon=True
        )
        self._thread.start()

    def _call(self, work: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            work.close()
            raise RuntimeError("the Kubernetes client is closed")
        future = asyncio.run_coroutine_threadsafe(work, self._loop)
        while True:
            # Waited on in slices: a call racing close() would otherwise wait forever on a
            # loop that stopped under it, and a reconcile thread that never returns keeps
            # the process from exiting (the thread pools are joined at exit).
            try:
                return future.result(timeout=CLOSE_POLL_S)
            except TimeoutError:
                if future.done():  # just now, or the call's own TimeoutError
                    return future.result()
                if self._closed:  # its loop stops (or stopped): the call will never finish
                    raise RuntimeError("the Kubernetes client was closed during the call") from None

    def close(self) -> None:
        """Close the sessions and stop the loop (idempotent); later calls raise RuntimeError."""
        if self._closed:
            return
        self._call(self.aio.close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (200, 201, 202),
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Body]:
        """:meth:`AsyncKube.request`."""
        return self._call(self.aio.request(method, path, body, content_type, ok, headers))

    def path_of(self, manifest: Body, with_name: bool = False) -> str:
        return self.aio.path_of(manifest, with_name)

    def create_or_adopt(self, manifest: Body) -> tuple[bool, Body]:
        """:meth:`AsyncKube.create_or_adopt`."""
        return self._call(self.aio.create_or_adopt(manifest))

    def create_if_absent(self, manifest: Body) -> bool:
        """:meth:`AsyncKube.create_if_absent`."""
        return self._call(self.aio.create_if_absent(manifest))

    def patch(self, manifest_or_path: Body | str, patch: Body, subresource: str = "") -> Body:
        """:meth:`AsyncKube.patch`."""
        return self._call(self.aio.patch(manifest_or_path, patch, subresource))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """:meth:`AsyncKube.delete`."""
        return self._call(self.aio.delete(api_version, kind, namespace, name))

    def serves(self, api_version: str, plural: str) -> bool:
        """:meth:`AsyncKube.serves`."""
        return self._call(self.aio.serves(api_version, plural))

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> list[Body]:
        """:meth:`AsyncKube.list`."""
        return self._call(self.aio.list(api_version, kind, namespace, label_selector))

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Body | None:
        """:meth:`AsyncKube.get`."""
        return self._call(self.aio.get(api_version, kind, namespace, name))
