"""A small synchronous Kubernetes REST client for the reconcilers (httpx, pooled, dict bodies).

Why not the generated ``kubernetes`` client: it validates every body into typed models,
which costs more than the request itself when hundreds of sandbox pods are created at once,
and the operator only needs create / merge-patch / delete / get on a handful of paths.
Credentials come from the same kubeconfig or in-cluster service account as kopf's.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
from kopf import ConnectionInfo

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    """An API request failed with a status the caller did not expect."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> HTTP {status}: {body[:500]}")
        self.status = status


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

    def connection_info(self) -> ConnectionInfo:
        """The same credentials in kopf's form (for the @kopf.on.login handler)."""
        return ConnectionInfo(
            server=self.server,
            ca_path=self.ca_path,
            insecure=self.insecure,
            certificate_path=self.cert_path,
            private_key_path=self.key_path,
            token=self.token,
            scheme="Bearer" if self.token else None,
        )


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


class KubeClient:
    """Thread-safe pooled client; one instance shared by all reconciler threads."""

    def __init__(
        self,
        creds: Credentials,
        pool_size: int = 32,
        timeout: float = 30.0,
        reload: Callable[[], Credentials] | None = None,
    ) -> None:
        """``reload`` re-reads credentials after a 401: in-cluster service-account tokens are
        rotated by the kubelet (bound tokens expire), and a long-running operator must follow."""
        self._reload = reload
        headers = {"Authorization": f"Bearer {creds.token}"} if creds.token else {}
        self._http = httpx.Client(
            base_url=creds.server,
            verify=ssl_context(creds),
            headers=headers,
            timeout=timeout,
            limits=httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size),
        )

    def close(self) -> None:
        self._http.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        ok: tuple[int, ...] = (200, 201, 202),
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Send one request; statuses outside ``ok`` raise KubeError.

        ``headers`` adds request headers, e.g. ``Impersonate-User`` for RBAC checks.
        """
        all_headers = dict(headers or {})
        if body is not None:
            all_headers["Content-Type"] = content_type
        response = self._http.request(method, path, json=body, headers=all_headers)
        if response.status_code == 401 and self._reload is not None:
            fresh = self._reload()
            if fresh.token:
                self._http.headers["Authorization"] = f"Bearer {fresh.token}"
                log.info("API token rejected (401); retrying with re-read credentials")
                response = self._http.request(method, path, json=body, headers=all_headers)
        if response.status_code not in ok:
            raise KubeError(response.status_code, method, path, response.text)
        try:
            data = response.json()
        except ValueError:
            data = {}
        return response.status_code, data

    def path_of(self, manifest: dict[str, Any], with_name: bool = False) -> str:
        meta = manifest["metadata"]
        return resource_path(
            manifest["apiVersion"],
            PLURALS[manifest["kind"]],
            meta["namespace"],
            meta["name"] if with_name else "",
        )

    def create_or_adopt(self, manifest: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
        """Create ``manifest``; if its (deterministic) name exists already, adopt that object.

        Returns (created, object). Adoption is what makes a restarted operator idempotent. An
        object of that name controlled by *another* owner uid is not adopted: it belongs to a
        deleted predecessor of the same name (a run deleted and applied again before the
        garbage collector got to its children), so it is deleted and ``SupersededChild``
        raised; the owner's next reconcile creates its own.
        """
        status, data = self.request("POST", self.path_of(manifest), manifest, ok=(201, 200, 409))
        if status == 409:
            _, data = self.request("GET", self.path_of(manifest, with_name=True))
            ours, theirs = controller_uid(manifest), controller_uid(data)
            if ours is not None and theirs is not None and ours != theirs:
                meta = manifest["metadata"]
                self.delete(
                    manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"]
                )
                raise SupersededChild(
                    409,
                    "POST",
                    self.path_of(manifest),
                    f"{manifest['kind']} {meta['name']} belonged to an earlier owner of that "
                    f"name (uid {theirs}, now {ours}): deleted it; ours follows once it is gone",
                )
            return False, data
        return True, data

    def create_if_absent(self, manifest: dict[str, Any]) -> bool:
        """Create ``manifest`` unless its name exists (then leave that object as it is, unread:
        for Secrets, which the operator may create but never read). True when created."""
        status, _ = self.request("POST", self.path_of(manifest), manifest, ok=(201, 200, 409))
        return status != 409

    def patch(
        self, manifest_or_path: dict[str, Any] | str, patch: dict[str, Any], subresource: str = ""
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of an object or its status subresource."""
        path = (
            manifest_or_path
            if isinstance(manifest_or_path, str)
            else self.path_of(manifest_or_path, with_name=True)
        )
        if subresource:
            path = f"{path}/{subresource}"
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)[1]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete by name; False when it was already gone."""
        path = resource_path(api_version, PLURALS[kind], namespace, name)
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        status, _ = self.request("DELETE", path, body, ok=(200, 202, 404))
        return status != 404

    def serves(self, api_version: str, plural: str) -> bool:
        """Whether the apiserver serves ``plural`` in ``api_version`` (API discovery).

        Discovery is readable by every authenticated user (system:discovery), so this needs no
        RBAC on CustomResourceDefinitions. A group that is not installed answers 404.
        """
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        status, data = self.request("GET", base, ok=(200, 404))
        if status == 404:
            return False
        return any(r.get("name") == plural for r in data.get("resources") or [])

    def list(
        self, api_version: str, kind: str, namespace: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        """Objects of ``kind`` in ``namespace`` (optionally filtered by a label selector)."""
        path = resource_path(api_version, PLURALS[kind], namespace)
        if label_selector:
            path += "?" + urlencode({"labelSelector": label_selector})
        items: list[dict[str, Any]] = self.request("GET", path)[1].get("items") or []
        for item in items:
            # List items carry no apiVersion/kind; the cache and the builders expect them.
            item.setdefault("apiVersion", api_version)
            item.setdefault("kind", kind)
        return items

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        status, data = self.request(
            "GET", resource_path(api_version, PLURALS[kind], namespace, name), ok=(200, 404)
        )
        return data if status == 200 else None
