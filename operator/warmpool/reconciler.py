"""SandboxWarmPool reconciler: keep ``spec.replicas`` idle ready pods, hand them to tasks.

plan (:func:`.plan.plan_warm_pool`) → build (:func:`.builders.build_warm_pod`) → apply
(here). Claims are made here too, for the SandboxTask reconciler: a claim is one conditional
patch of an idle pod, so a pod is never handed to two tasks.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from posttrain.api import SandboxTask, SandboxWarmPool
from posttrain.api.labels import (
    ANNOTATION_SPEC_HASH,
    LABEL_TASK,
)
from posttrain.api.reasons import Reason

from ..kube import KubeError, resource_path
from ..metrics import (
    CHILDREN_CREATED,
    WARM_POOL_CLAIM_CONFLICTS,
    WARM_POOL_CLAIM_SECONDS,
    WARM_POOL_CLAIMS,
)
from ..shared.sandbox_namespace import SandboxNamespaces
from ..shared.state import Body, Key, OperatorState, now
from ..shared.views import EventSpec, pod_view
from . import builders as wp
from . import plan as warm_plan

log = logging.getLogger(__name__)

KIND = "SandboxWarmPool"

# Idle pods a claim tries before giving up on the pool (each 409 means another claim or
# a status update won that pod; the next idle pod is tried).
MAX_CLAIM_TRIES = 8
# Pods one pool reconcile creates before it hands over (and asks for another pass): bounds how
# long the pool's lock is held, so refills interleave with claims and shutdown is prompt.
WARM_POOL_CREATE_BATCH = 50


def claimable(pod: Body, want_hash: str) -> bool:
    """warmpool.is_claimable on the raw body: cheap enough to scan a whole pool per claim."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return (
        LABEL_TASK not in (meta.get("labels") or {})
        and not meta.get("deletionTimestamp")
        and status.get("phase") == "Running"
        and (meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH) == want_hash
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
    )


class WarmPoolReconciler:
    """Reconciles SandboxWarmPools (coalesced, through the work queue) and claims their pods."""

    def __init__(self, state: OperatorState, namespaces: SandboxNamespaces) -> None:
        self.state = state
        self.namespaces = namespaces
        # Idle pods a claim is patching right now (so two threads never try the same one,
        # and the pool never deletes one mid-claim); refills waiting to run, coalesced.
        self._claiming: set[Key] = set()
        self._claim_lock = threading.Lock()
        self._refills_pending: set[Key] = set()
        # The operator's work queue (controllers.Controller binds it): True when it took the
        # request; until then a refill runs on a thread of its own.
        self.enqueue: Callable[[str, str], bool] = lambda namespace, pool: False

    # ------------------------------------------------------------ claims (for SandboxTasks)

    def claim(self, task: SandboxTask, body: Body) -> Body | None:
        """Adopt an idle ready pod of spec.warmPoolRef for attempt 1; None = go cold.

        The claim is one merge patch with the pod's resourceVersion as a precondition: if the
        pod changed since the cache saw it (another claim, a deletion) the apiserver answers
        409 and the next idle pod is tried, so a pod is never handed to two tasks.
        """
        state = self.state
        namespace, ref = task.metadata.namespace, task.spec.warm_pool_ref or ""
        if task.status.warm_pool:
            return None  # claimed once already (that pod is gone): retry cold, never twice
        pool_body = state.warm_pools.get(namespace, ref)
        if pool_body is None:
            WARM_POOL_CLAIMS.labels("missing").inc()
            state.emit(
                body,
                [
                    EventSpec(
                        "Warning",
                        Reason.WARM_POOL_NOT_FOUND,
                        f"spec.warmPoolRef {ref!r}: no SandboxWarmPool of that name in {namespace}; "
                        "started a cold pod (create the pool or fix the name)",
                    )
                ],
            )
            return None
        pool = SandboxWarmPool.model_validate(pool_body)
        mismatch = wp.claim_mismatch(task, pool, state.config)
        if mismatch:
            WARM_POOL_CLAIMS.labels("mismatch").inc()
            state.emit(
                body,
                [
                    EventSpec(
                        "Warning",
                        Reason.WARM_POOL_MISMATCH,
                        f"SandboxWarmPool {ref} cannot serve this task ({mismatch}); started a cold "
                        "pod (make the task's image/resources/network/runtimeClassName match)",
                    )
                ],
            )
            return None
        want_hash = wp.template_hash(wp.pool_template(pool, state.config))
        started = time.perf_counter()
        tried: set[str] = set()
        for _ in range(MAX_CLAIM_TRIES):
            pod = self._reserve_idle_pod(namespace, ref, want_hash, tried)
            if pod is None:
                break
            pod_name = pod["metadata"]["name"]
            tried.add(pod_name)
            try:
                claimed = state.kube.patch(
                    resource_path("v1", "pods", namespace, pod_name),
                    wp.build_claim_patch(task, pod, now()),
                )
            except KubeError as exc:
                if exc.status not in (404, 409):
                    raise
                WARM_POOL_CLAIM_CONFLICTS.inc()
                continue
            finally:
                with self._claim_lock:
                    self._claiming.discard((namespace, pod_name))
            WARM_POOL_CLAIMS.labels("claimed").inc()
            WARM_POOL_CLAIM_SECONDS.observe(time.perf_counter() - started)
            state.sandbox_pods.put(claimed)
            state.warm_pods.put(claimed)
            self.request_reconcile(namespace, ref)
            return claimed
        WARM_POOL_CLAIMS.labels("empty").inc()
        return None

    def _reserve_idle_pod(
        self, namespace: str, pool: str, want_hash: str, skip: set[str]
    ) -> Body | None:
        with self._claim_lock:
            for pod in self.state.warm_pods.children(namespace, pool):
                name = pod["metadata"]["name"]
                if name in skip or (namespace, name) in self._claiming:
                    continue
                if claimable(pod, want_hash):
                    self._claiming.add((namespace, name))
                    return pod
        return None

    # ------------------------------------------------------------ the pool itself

    def request_reconcile(self, namespace: str, pool: str) -> None:
        """Reconcile the pool soon, on its own thread; any number of requests made before it
        starts coalesce into one.

        Claims and pooled-pod events come in bursts of hundreds, and each pool reconcile
        looks at every pod of the pool: reconciling once per event would be quadratic, and
        reconciles queued on the pool's lock would hold the event threads away from the tasks
        (docs/benchmarks.md has the burst's figures). Through the operator's work queue
        (shared/workqueue.py), which coalesces per pool; a thread of its own without it.
        """
        if self.enqueue(namespace, pool):
            return
        key = (namespace, pool)
        with self._claim_lock:
            if key in self._refills_pending:
                return
            self._refills_pending.add(key)

        def refill() -> None:
            with self._claim_lock:
                self._refills_pending.discard(key)
            try:
                self.reconcile(namespace, pool)
            except (KubeError, OSError) as exc:
                log.warning(
                    "refill of SandboxWarmPool %s/%s failed: %s (requeued)",
                    namespace,
                    pool,
                    exc,
                )

        context = contextvars.copy_context()  # the span context of the claim that asked
        threading.Thread(
            target=context.run, args=(refill,), name=f"refill-{pool}", daemon=True
        ).start()

    def reconcile(self, namespace: str, name: str) -> None:
        state = self.state
        body = state.warm_pools.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with state.reconciling(KIND, namespace, name):
            body = state.warm_pools.get(namespace, name) or body
            try:
                pool = SandboxWarmPool.model_validate(body)
            except ValidationError as exc:
                state.invalid(state.warm_pools, body, exc, terminal_phase=None)
                return
            want_hash = wp.template_hash(wp.pool_template(pool, state.config))
            pods = [pod_view(p) for p in state.warm_pods.children(namespace, name)]
            with self._claim_lock:
                reserved = frozenset(n for ns, n in self._claiming if ns == namespace)
            plan = warm_plan.plan_warm_pool(pool, pods, want_hash, reserved)
            for pod_name in plan.delete_pods:
                self._delete_idle_pod(namespace, pod_name)
            if plan.create and pool.spec.network == "none":
                self.namespaces.ensure_network_policy(namespace)
            manifest = wp.build_warm_pod(pool, state.config) if plan.create else None
            for _ in range(min(plan.create, WARM_POOL_CREATE_BATCH)):
                assert manifest is not None
                created = state.kube.request("POST", state.kube.path_of(manifest), manifest)[1]
                CHILDREN_CREATED.labels(KIND, "Pod").inc()
                state.warm_pods.put(created)
            state.patch_status(state.warm_pools, body, plan.status_patch)
            state.emit(body, plan.events)
        if plan.create > WARM_POOL_CREATE_BATCH:
            self.request_reconcile(namespace, name)

    def _delete_idle_pod(self, namespace: str, name: str) -> None:
        """Delete an idle pod only if it is still the version the cache saw: a pod claimed
        in the meantime (new resourceVersion) is refused with 409 and kept."""
        pod = self.state.warm_pods.get(namespace, name)
        rv = ((pod or {}).get("metadata") or {}).get("resourceVersion")
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if rv:
            body["preconditions"] = {"resourceVersion": rv}
        status, _ = self.state.kube.request(
            "DELETE", resource_path("v1", "pods", namespace, name), body, ok=(200, 202, 404, 409)
        )
        if status == 409:
            log.info("idle pod %s/%s changed before its deletion (claimed?); kept", namespace, name)

    def deleted(self, namespace: str, name: str) -> None:
        """Delete the idle pods of a deleted pool (the garbage collector does the same
        through ownerReferences where kube-controller-manager runs); claimed pods belong to
        their tasks and stay."""
        for pod in self.state.warm_pods.children(namespace, name):
            meta = pod["metadata"]
            if LABEL_TASK not in (meta.get("labels") or {}) and not meta.get("deletionTimestamp"):
                self._delete_idle_pod(namespace, meta["name"])
        self.state.forget_lock(KIND, namespace, name)
