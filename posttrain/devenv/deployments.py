"""The node agent's Deployment controller stand-in (see :class:`DeploymentStandIn` for its
limits). Part of the dev node agent (:mod:`.nodeagent`), a development aid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

from .nodeapi import NodeAPI
from .podprocess import Manifest

log = logging.getLogger(__name__)

TEMPLATE_HASH_ANNOTATION = "posttrain.io/devenv-template-hash"


def template_hash(template: Manifest) -> str:
    """Digest of a pod template: a changed template means the stand-in recreates the pods.

    >>> template_hash({"a": 1}) == template_hash({"a": 1}) != template_hash({"a": 2})
    True
    """
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def pod_is_ready(pod: Manifest) -> bool:
    """Whether the pod's Ready condition is True (what a Deployment counts as ready)."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def controller_uid(obj: Manifest) -> str | None:
    """The uid of ``obj``'s controlling owner, if any.

    >>> controller_uid({"metadata": {"ownerReferences": [{"uid": "u1"},
    ...                                                  {"uid": "u2", "controller": True}]}})
    'u2'
    """
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


@dataclass
class DeploymentStandIn:
    """Keeps ``spec.replicas`` pods per Deployment and writes the Deployment's status.

    Limits, on purpose (a dev aid, not a controller-manager): no ReplicaSets; pods are named
    ``<deployment>-<n>`` and owned by the Deployment itself; a changed pod template recreates
    every pod at once (no rolling strategy, no maxSurge); a pod that ends is deleted and
    recreated after ``replace_delay_s`` (that is the only "restart", with no backoff);
    the selector is not used (ownership is by ownerReference); pods of a deleted
    Deployment are deleted by the garbage-collector stand-in (:mod:`.garbage`).
    """

    cluster: NodeAPI
    replace_delay_s: float = 2.0
    last_replaced: dict[str, float] = field(default_factory=dict)

    def sync(self, deployments: list[Manifest], pods: list[Manifest]) -> None:
        by_owner: dict[str, list[Manifest]] = {}
        for pod in pods:
            uid = controller_uid(pod)
            if uid is not None:
                by_owner.setdefault(uid, []).append(pod)
        for deployment in deployments:
            if not deployment["metadata"].get("deletionTimestamp"):
                self._sync_one(deployment, by_owner.get(deployment["metadata"]["uid"], []))

    def _sync_one(self, deployment: Manifest, owned: list[Manifest]) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        namespace, name = meta["namespace"], meta["name"]
        replicas = int(spec.get("replicas", 1))
        want_hash = template_hash(spec["template"])
        wanted_names = {f"{name}-{i}" for i in range(replicas)}
        existing = {p["metadata"]["name"]: p for p in owned}
        for pod_name, pod in existing.items():
            stale = (pod["metadata"].get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)
            ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            unwanted = pod_name not in wanted_names or stale != want_hash or ended
            if unwanted and pod["metadata"].get("deletionTimestamp") is None:
                log.info("deployment %s/%s: deleting pod %s", namespace, name, pod_name)
                self.cluster.delete_pod(namespace, pod_name, 0)
                self.last_replaced[f"{namespace}/{pod_name}"] = time.monotonic()
        for pod_name in sorted(wanted_names - set(existing)):
            if (
                time.monotonic() - self.last_replaced.get(f"{namespace}/{pod_name}", -1e9)
                < self.replace_delay_s
            ):
                continue
            self.cluster.create_pod(
                namespace, self._pod_from_template(deployment, pod_name, want_hash)
            )
        current = [
            p
            for p in owned
            if p["metadata"]["name"] in wanted_names
            and not p["metadata"].get("deletionTimestamp")
            and (p["metadata"].get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) == want_hash
        ]
        ready = sum(1 for p in current if pod_is_ready(p))
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len([p for p in owned if not p["metadata"].get("deletionTimestamp")]),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(replicas - ready, 0),
        }
        old = deployment.get("status") or {}
        if any(old.get(k, 0) != v for k, v in status.items()):
            self.cluster.patch_deployment_status(namespace, name, status)

    @staticmethod
    def _pod_from_template(deployment: Manifest, pod_name: str, want_hash: str) -> Manifest:
        template = deployment["spec"]["template"]
        meta = template.get("metadata") or {}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "labels": dict(meta.get("labels") or {}),
                "annotations": {
                    **(meta.get("annotations") or {}),
                    TEMPLATE_HASH_ANNOTATION: want_hash,
                },
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": deployment["metadata"]["name"],
                        "uid": deployment["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
