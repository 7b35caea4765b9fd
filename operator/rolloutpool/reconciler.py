"""RolloutPool reconciler: a Deployment of vLLM replicas, its Service, and the pool's status.

plan (:func:`.plan.plan_rollout_pool`) → build (:func:`.builders.build_rollout_deployment`,
:func:`..builders.build_rollout_service`) → apply (here). Each reconcile also asks the ready
replicas which weight version they serve (status.weightVersion), and with spec.autoscaling
sizes the pool first (:mod:`.autoscaler`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import httpx
from pydantic import ValidationError

from posttrain.api import RolloutPool
from posttrain.storage.errors import StorageError

from ..kube import controller_uid
from ..shared.builders import BuildError, selector_string
from ..shared.state import OperatorState
from ..shared.views import PodView, pod_view
from ..storage_credentials import StorageCredentials
from . import builders
from .autoscaler import autoscale_pool
from .plan import plan_rollout_pool

log = logging.getLogger(__name__)

KIND = "RolloutPool"

# Per replica: a front door answers /v1/weights/version from memory, at once.
WEIGHT_PROBE_TIMEOUT_S = 2.0


def served_weight_versions(pods: list[PodView], port: int) -> dict[str, int]:
    """Ask each ready replica's front door which weight version it serves (pod -> version).

    Asked, not announced: a replica needs no Kubernetes credentials to report, and the
    answer is what it serves now. Replicas that do not answer in time are left out (the
    pool's weightVersion is then unknown). Runs at every pool reconcile and resync.
    """
    ready = [p for p in pods if p.ready and p.ip and not p.deleting]
    if not ready:
        return {}

    def ask(pod: PodView) -> tuple[str, int | None]:
        try:
            response = httpx.get(f"http://{pod.ip}:{port}/v1/weights/version",
                                 timeout=WEIGHT_PROBE_TIMEOUT_S)  # fmt: skip
            response.raise_for_status()
            return pod.name, int(response.json()["weight_version"])
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return pod.name, None

    with ThreadPoolExecutor(max_workers=min(16, len(ready))) as executor:
        answers = list(executor.map(ask, ready))
    return {name: version for name, version in answers if version is not None}


class RolloutPoolReconciler:
    """Reconciles RolloutPools (on event threads and at resync)."""

    def __init__(self, state: OperatorState, credentials: StorageCredentials) -> None:
        self.state = state
        self.credentials = credentials
        self._services: set[tuple[str, str, str | None]] = set()  # (namespace, name, uid) ensured

    def reconcile(self, namespace: str, name: str) -> None:
        state = self.state
        body = state.pools.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with state.reconciling(KIND, namespace, name):
            body = state.pools.get(namespace, name) or body
            try:
                pool = RolloutPool.model_validate(body)
                config = self.credentials.config_for_pool(pool)  # its own storage credentials
                desired = builders.build_rollout_deployment(pool, config)
            except (ValidationError, BuildError, ValueError) as exc:
                state.invalid(state.pools, body, exc, terminal_phase=None)
                return
            except StorageError as exc:
                self.credentials.failed(body, exc)  # raises RetryLater: requeued
            deployment = state.deployments.get(namespace, name)
            if deployment is not None and controller_uid(deployment) not in (
                None,
                pool.metadata.uid,
            ):
                deployment = None  # an earlier pool's of that name: creating ours replaces it
            pods = [pod_view(p) for p in state.rollout_pods.children(namespace, name)]
            selector = selector_string(builders.pool_selector(name))
            served = served_weight_versions(pods, pool.spec.port)
            ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
            scaled = autoscale_pool(state, pool, body, ready)  # spec.autoscaling, via /scale
            pool = scaled.pool
            desired["spec"]["replicas"] = pool.spec.replicas  # a Deployment created now too
            plan = plan_rollout_pool(
                pool, desired, deployment, pods, selector, builders.pool_endpoint(pool), served
            )
            service_key = (namespace, name, pool.metadata.uid)
            if service_key not in self._services:
                state.kube.create_if_absent(
                    builders.build_pool_token_secret(pool)
                )  # kept if it exists
                state.create(KIND, builders.build_rollout_service(pool))
                state.create(KIND, builders.build_pool_network_policy(pool, state.config))
                self._services.add(service_key)
            if plan.create_deployment:
                state.deployments.put(state.create(KIND, desired))
            if plan.patch_deployment:
                state.deployments.put(state.kube.patch(desired, plan.patch_deployment))
            state.patch_status(
                state.pools, body, {**plan.status_patch, **(scaled.status_patch or {})}
            )
            state.emit(body, scaled.events + plan.events)
