"""SandboxTask reconciler: one pod per attempt, retries, TTL, warm-pool claims, artifact URLs.

plan (:func:`.plan.plan_sandbox`) → build (:func:`.builders.build_sandbox_pod`) →
apply (here). A burst of new tasks is the operator's hot path: :meth:`reconcile_on_loop`
handles the plain "create the first pod" case without leaving the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from pydantic import ValidationError

from posttrain.api import API_VERSION, SandboxTask

from ..shared.builders import BuildError
from ..shared.sandbox_namespace import SandboxNamespaces
from ..shared.state import Body, OperatorState, count_child, now
from ..shared.views import pod_view
from ..warmpool.reconciler import WarmPoolReconciler
from . import builders
from .artifacts import SandboxArtifactSigner
from .plan import SandboxPlan, plan_sandbox

log = logging.getLogger(__name__)

KIND = "SandboxTask"

# Steps of SandboxTaskReconciler._step_on_loop besides a manifest (compared by identity).
_NOOP: Body = {}
_FULL: Body = {}


class SandboxTaskReconciler:
    """Reconciles SandboxTasks: on a thread (:meth:`reconcile`) or on the loop (the burst)."""

    def __init__(
        self,
        state: OperatorState,
        namespaces: SandboxNamespaces,
        artifacts: SandboxArtifactSigner,
        warm_pools: WarmPoolReconciler,
    ) -> None:
        self.state = state
        self.namespaces = namespaces
        self.artifacts = artifacts
        self.warm_pools = warm_pools

    def reconcile(self, namespace: str, name: str) -> None:
        state = self.state
        body = state.tasks.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with state.reconciling(KIND, namespace, name):
            body = state.tasks.get(namespace, name) or body
            try:
                task = SandboxTask.model_validate(body)
            except ValidationError as exc:
                state.invalid(state.tasks, body, exc, terminal_phase="Failed")
                return
            pods = [pod_view(p) for p in state.sandbox_pods.children(namespace, name)]
            plan = plan_sandbox(task, pods, now())
            if plan.delete_task:
                for pod in plan.delete_pods:
                    state.kube.delete("v1", "Pod", namespace, pod)
                state.kube.delete(API_VERSION, KIND, namespace, name)
                state.emit(body, plan.events)
                return
            # Warm pods were started without the artifact entrypoint: snapshot/restore go cold.
            needs_entrypoint = task.spec.snapshot or task.spec.restore_from is not None
            if plan.create_attempt == 1 and task.spec.warm_pool_ref and not needs_entrypoint:
                try:
                    claimed = self.warm_pools.claim(task, body)
                except BuildError as exc:
                    state.invalid(state.tasks, body, exc, terminal_phase="Failed")
                    return
                if claimed is not None:
                    plan = self._plan_claimed(task, claimed)
            if plan.create_attempt is not None:
                if task.spec.network == "none":
                    self.namespaces.ensure_network_policy(namespace)
                try:
                    artifacts = self.artifacts.sign(task, plan.create_attempt)
                    manifest = builders.build_sandbox_pod(
                        task, state.config, plan.create_attempt, artifacts=artifacts
                    )
                except BuildError as exc:
                    state.invalid(state.tasks, body, exc, terminal_phase="Failed")
                    return
                state.sandbox_pods.put(state.create(KIND, manifest))
            for pod in plan.delete_pods:
                state.kube.delete("v1", "Pod", namespace, pod)
            state.patch_status(state.tasks, body, plan.status_patch)
            state.emit(body, plan.events)

    def _plan_claimed(self, task: SandboxTask, claimed: Body) -> SandboxPlan:
        """Re-plan with the claimed pod: it is already running, so the task is Running now
        (one status write records the claim, the pod and the start)."""
        namespace, name = task.metadata.namespace, task.metadata.name
        pods = [pod_view(p) for p in self.state.sandbox_pods.children(namespace, name)]
        plan = plan_sandbox(task, pods, now())
        plan.status_patch["warmPool"] = task.spec.warm_pool_ref
        if "startTime" in plan.status_patch:
            plan.status_patch["startTime"] = now().isoformat().replace("+00:00", "Z")
        log.debug(
            "SandboxTask %s/%s claimed warm pod %s", namespace, name, claimed["metadata"]["name"]
        )
        return plan

    async def reconcile_on_loop(
        self,
        namespace: str,
        name: str,
        create: Callable[[Body], Awaitable[tuple[bool, Body]]],
    ) -> bool:
        """:meth:`reconcile` for the burst case without leaving the event loop; False when the
        caller must run :meth:`reconcile` on a thread instead.

        Handled here: a reconcile with nothing to do, or whose one write is the pod create
        (a new task: no status patch, no Event), made with ``create`` (AsyncKube's). Anything
        more (retries, status transitions, warm-pool claims, artifact URLs, the network
        policy's first create, invalid specs) and a task whose lock another reconcile holds
        go to the thread: the loop never blocks on a lock or a synchronous request.
        """
        started = time.perf_counter()
        lock = self.state.lock(KIND, namespace, name)
        if not lock.acquire(blocking=False):
            return False
        try:
            step = self._step_on_loop(namespace, name)
            if step is None or step is _FULL:
                return step is None
            with self.state.reconciling(KIND, namespace, name, locked=True, started=started):
                if step is not _NOOP:
                    created, obj = await create(step)
                    count_child(KIND, "Pod", created)
                    self.state.sandbox_pods.put(obj)
            return True
        finally:
            lock.release()

    def _step_on_loop(self, namespace: str, name: str) -> Body | None:
        """For reconcile_on_loop, without I/O: None (no task, or it is being deleted:
        reconcile would return at once), _NOOP, _FULL, or the pod manifest to create."""
        state = self.state
        body = state.tasks.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            task = SandboxTask.model_validate(body)
        except ValidationError:
            return _FULL
        pods = [pod_view(p) for p in state.sandbox_pods.children(namespace, name)]
        plan = plan_sandbox(task, pods, now())
        if plan.delete_task or plan.delete_pods or plan.status_patch or plan.events:
            return _FULL
        if plan.create_attempt is None:
            return _NOOP
        spec = task.spec
        if (
            spec.warm_pool_ref
            or spec.snapshot
            or spec.restore_from
            or state.config.sandbox_artifacts_uri
            or (spec.network == "none" and not self.namespaces.has_network_policy(namespace))
        ):
            return _FULL
        try:
            return builders.build_sandbox_pod(task, state.config, plan.create_attempt)
        except BuildError:
            return _FULL
