"""The node agent's garbage-collector stand-in: children go when their owner goes.

A real cluster's kube-controller-manager deletes every object whose ownerReferences all name
owners that no longer exist (background propagation). The dev control plane runs no
controller-manager, so without this a deleted RolloutPool left its Deployment, Service and
server running, and a deleted TrainingRun its pods, ConfigMap and RBAC (issue #35). The
operator relies on the garbage collector, as on a real cluster (its children carry a
controller ownerReference: operator/shared/builders.py ``child_metadata``); this plays that part here.
Part of the dev node agent (:mod:`.nodeagent`), a development aid.

Limits, on purpose: the dependent and owner kinds are the ones posttrain creates and owns
(below); an owner of any other kind counts as present, so nothing is deleted on a guess;
``blockOwnerDeletion`` and foreground deletion are not honoured (owners are deleted at once,
children after, as with background propagation).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .podprocess import Manifest

log = logging.getLogger(__name__)

# (apiVersion, kind) -> (typed client class, the kind's snake_case name in its methods)
DEPENDENT_KINDS: dict[tuple[str, str], tuple[str, str]] = {
    ("v1", "Pod"): ("CoreV1Api", "pod"),
    ("v1", "Service"): ("CoreV1Api", "service"),
    ("v1", "ConfigMap"): ("CoreV1Api", "config_map"),
    ("v1", "Secret"): ("CoreV1Api", "secret"),
    ("v1", "ServiceAccount"): ("CoreV1Api", "service_account"),
    ("apps/v1", "Deployment"): ("AppsV1Api", "deployment"),
    ("batch/v1", "Job"): ("BatchV1Api", "job"),
    ("rbac.authorization.k8s.io/v1", "Role"): ("RbacAuthorizationV1Api", "role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): ("RbacAuthorizationV1Api", "role_binding"),
}
# posttrain's own kinds own most children: (apiVersion, kind) -> plural
CUSTOM_OWNER_KINDS: dict[tuple[str, str], str] = {
    ("posttrain.io/v1alpha1", "TrainingRun"): "trainingruns",
    ("posttrain.io/v1alpha1", "RolloutPool"): "rolloutpools",
    ("posttrain.io/v1alpha1", "SandboxTask"): "sandboxtasks",
    ("posttrain.io/v1alpha1", "SandboxWarmPool"): "sandboxwarmpools",
}
BUILTIN_OWNER_KINDS = (("apps/v1", "Deployment"), ("batch/v1", "Job"))


def orphans(
    dependents: Iterable[tuple[tuple[str, str], Manifest]],
    live_owner_uids: dict[tuple[str, str], set[str]],
) -> list[tuple[tuple[str, str], Manifest]]:
    """The dependents every owner of which is gone (what the garbage collector deletes).

    An owner of a kind not in ``live_owner_uids`` is taken to exist: it was not listed, so
    its absence is not known.

    >>> pool = ("posttrain.io/v1alpha1", "RolloutPool")
    >>> ref = {"apiVersion": pool[0], "kind": pool[1], "name": "p", "uid": "u-old"}
    >>> dep = {"metadata": {"name": "p", "ownerReferences": [ref]}}
    >>> other = {"metadata": {"name": "q", "ownerReferences": [{**ref, "kind": "Mystery"}]}}
    >>> free = {"metadata": {"name": "r"}}
    >>> kind = ("apps/v1", "Deployment")
    >>> [d["metadata"]["name"] for _, d in orphans(
    ...     [(kind, dep), (kind, other), (kind, free)], {pool: {"u-new"}})]
    ['p']
    """
    found = []
    for kind, obj in dependents:
        meta = obj.get("metadata") or {}
        refs = meta.get("ownerReferences") or []
        if not refs or meta.get("deletionTimestamp"):
            continue
        if all(
            (ref.get("apiVersion"), ref.get("kind")) in live_owner_uids
            and ref.get("uid") not in live_owner_uids[(ref.get("apiVersion"), ref.get("kind"))]
            for ref in refs
        ):
            found.append((kind, obj))
    return found


@dataclass
class GarbageCollectorStandIn:
    """Deletes, every ``interval_s``, the objects of ``namespaces`` whose owners are gone."""

    api_client: Any
    namespaces: Sequence[str] | None
    interval_s: float = 2.0
    _last: float = field(default=-1e9, repr=False)

    def sync(self) -> list[str]:
        """One pass (at most every ``interval_s``); returns what it deleted, ``Kind ns/name``."""
        if time.monotonic() - self._last < self.interval_s:
            return []
        self._last = time.monotonic()
        listed = {kind: self._list_builtin(kind) for kind in DEPENDENT_KINDS}
        dependents = [(kind, obj) for kind, objs in listed.items() for obj in objs]
        live = {kind: {o["metadata"]["uid"] for o in listed[kind]} for kind in BUILTIN_OWNER_KINDS}
        live |= {
            kind: {o["metadata"]["uid"] for o in self._list_custom(kind)}
            for kind in CUSTOM_OWNER_KINDS
        }
        deleted = []
        for kind, obj in orphans(dependents, live):
            meta = obj["metadata"]
            what = f"{kind[1]} {meta['namespace']}/{meta['name']}"
            owners = ", ".join(f"{r['kind']} {r['name']}" for r in meta["ownerReferences"])
            log.info("garbage collector stand-in: deleting %s (its owner %s is gone)", what, owners)
            self._delete(kind, meta["namespace"], meta["name"])
            deleted.append(what)
        return deleted

    def _api(self, name: str) -> Any:
        from kubernetes import client

        return getattr(client, name)(self.api_client)

    def _json(self, response: Any) -> Manifest:
        return json.loads(response.data or b"{}")  # type: ignore[no-any-return]

    def _list_builtin(self, kind: tuple[str, str]) -> list[Manifest]:
        api_name, snake = DEPENDENT_KINDS[kind]
        api = self._api(api_name)
        if self.namespaces is None:
            list_all = getattr(api, f"list_{snake}_for_all_namespaces")
            return self._json(list_all(_preload_content=False)).get("items") or []
        list_ns = getattr(api, f"list_namespaced_{snake}")
        return [
            item
            for namespace in self.namespaces
            for item in self._json(list_ns(namespace, _preload_content=False)).get("items") or []
        ]

    def _list_custom(self, kind: tuple[str, str]) -> list[Manifest]:
        from kubernetes.client.exceptions import ApiException

        group, version = kind[0].split("/")
        plural = CUSTOM_OWNER_KINDS[kind]
        api = self._api("CustomObjectsApi")
        try:
            if self.namespaces is None:
                return list(api.list_cluster_custom_object(group, version, plural)["items"])
            return [
                item
                for namespace in self.namespaces
                for item in api.list_namespaced_custom_object(group, version, namespace, plural)[
                    "items"
                ]
            ]
        except ApiException as err:
            if err.status == 404:  # its CRD is not installed: nothing of that kind exists
                return []
            raise

    def _delete(self, kind: tuple[str, str], namespace: str, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        api_name, snake = DEPENDENT_KINDS[kind]
        delete = getattr(self._api(api_name), f"delete_namespaced_{snake}")
        try:
            delete(name, namespace, propagation_policy="Background", _preload_content=False)
        except ApiException as err:
            if err.status != 404:  # deleted meanwhile: what we wanted
                raise
