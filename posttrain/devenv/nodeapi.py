"""The node agent's Kubernetes API calls: raw JSON on a ``kubernetes.client.ApiClient``.

Part of the dev node agent (:mod:`.nodeagent`), a development aid; see its docstring.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .podprocess import Manifest

# Tokens are requested for an hour and rewritten at half-life, as the kubelet does.
TOKEN_SECONDS = 3600
# Status lists (conditions, containerStatuses) are always sent whole, so a merge patch
# replacing them is exactly what we mean, and it needs no strategic-merge keys.
MERGE_PATCH = "application/merge-patch+json"


class NodeAPI:
    """The few raw-dict API calls the agent needs, on a ``kubernetes.client.ApiClient``.

    Raw JSON (``_preload_content=False``) keeps objects in their wire form (camelCase),
    the same form the operator's builders produce, and sidesteps the generated client's
    model validation (V1Binding responses fail to deserialize there).
    """

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    @staticmethod
    def _json(response: Any) -> Manifest:
        return json.loads(response.data or b"{}")

    def _list(
        self,
        all_namespaces: Callable[..., Any],
        namespaced: Callable[..., Any],
        namespaces: Sequence[str] | None,
    ) -> list[Manifest]:
        """Items of one kind, cluster-wide (``namespaces`` None) or from each namespace."""
        if namespaces is None:
            return self._json(all_namespaces(_preload_content=False))["items"]
        return [
            item
            for ns in namespaces
            for item in self._json(namespaced(ns, _preload_content=False))["items"]
        ]

    def list_pods(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.core.list_pod_for_all_namespaces, self.core.list_namespaced_pod, namespaces
        )

    def list_deployments(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.apps.list_deployment_for_all_namespaces,
            self.apps.list_namespaced_deployment,
            namespaces,
        )

    def list_services(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.core.list_service_for_all_namespaces, self.core.list_namespaced_service, namespaces
        )

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        from kubernetes.client.exceptions import ApiException

        read = {
            "Secret": self.core.read_namespaced_secret,
            "ConfigMap": self.core.read_namespaced_config_map,
        }[kind]
        try:
            return self._json(read(name, namespace, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def service_account_token(self, namespace: str, name: str) -> str | None:
        """A bound token for ServiceAccount ``namespace/name`` (TokenRequest); None if absent."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        }
        try:
            response = self.core.create_namespaced_service_account_token(
                name,
                namespace,
                client.AuthenticationV1TokenRequest.model_validate(body),
                _preload_content=False,
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return str(self._json(response)["status"]["token"])

    def apiserver_address(self) -> tuple[str, int, str | None]:
        """(host, port, CA file) of the apiserver this agent talks to, for in-cluster clients."""
        from urllib.parse import urlparse

        configuration = self.api_client.configuration
        url = urlparse(configuration.host)
        return url.hostname or "127.0.0.1", url.port or 443, configuration.ssl_ca_cert

    def bind(self, namespace: str, name: str, node_name: str) -> None:
        from kubernetes import client

        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_name},
        }
        self.core.create_namespaced_pod_binding(
            name, namespace, client.V1Binding.model_validate(body), _preload_content=False
        )

    def patch_pod_status(self, namespace: str, name: str, status: Manifest) -> None:
        self.core.patch_namespaced_pod_status(
            name, namespace, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=grace_seconds, _preload_content=False
            )
        except ApiException as err:
            if err.status != 404:
                raise

    def create_pod(self, namespace: str, body: Manifest) -> None:
        from kubernetes import client

        self.core.create_namespaced_pod(
            namespace, client.V1Pod.model_validate(body), _preload_content=False
        )

    def patch_deployment_status(self, namespace: str, name: str, status: Manifest) -> None:
        self.apps.patch_namespaced_deployment_status(
            name, namespace, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )

    def ensure_node(self, node: Manifest) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_node(client.V1Node.model_validate(node), _preload_content=False)
        except ApiException as err:
            if err.status != 409:
                raise
        self.patch_node_status(node["metadata"]["name"], node["status"])

    def patch_node_status(self, name: str, status: Manifest) -> None:
        self.core.patch_node_status(
            name, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )
