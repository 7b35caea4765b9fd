"""Controllers: feed the pure plans in reconcile.py from in-memory caches and execute them.

The caches are the operator's informers: kopf's watch streams (see handlers.py) put every
TrainingRun, RolloutPool, SandboxTask, and every labelled Pod and Deployment here, and each
reconcile reads only the cache (no GETs on the hot path). Writes go through KubeClient and
their responses are put back into the cache, so the next reconcile reads its own writes.

Reconciles of the same object are serialised by a per-object lock (a pod event and a task
event can arrive on two threads at once); different objects run in parallel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
from pydantic import ValidationError

from posttrain.api import API_VERSION, RolloutPool, SandboxTask, TrainingRun
from posttrain.telemetry import get_tracer

from . import builders as b
from .config import OperatorConfig
from .kube import KubeClient, KubeError
from .metrics import (
    CHILDREN_ADOPTED,
    CHILDREN_CREATED,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    RECONCILES,
)
from .reasons import ConditionType, Reason
from .reconcile import (
    EventSpec,
    plan_rollout_pool,
    plan_sandbox,
    plan_training_run,
    pod_view,
)

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

Body = dict[str, Any]
Key = tuple[str, str]
EventPoster = Callable[[Body, EventSpec], None]


def _rv(body: Body) -> int | None:
    value = (body.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class Store:
    """Latest body per (namespace, name), plus an index of children by owner label value.

    Never goes back in time: a watch event older than a write response already stored is
    ignored (resourceVersions are compared as integers, which etcd-backed servers use).
    """

    def __init__(self, owner_label: str | None = None) -> None:
        self._owner_label = owner_label
        self._items: dict[Key, Body] = {}
        self._by_owner: dict[Key, set[str]] = {}
        self._lock = threading.Lock()

    def _owner_key(self, body: Body) -> Key | None:
        if not self._owner_label:
            return None
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(self._owner_label)
        return (meta.get("namespace", ""), owner) if owner else None

    def put(self, body: Body) -> bool:
        """Store ``body``; False when the cache already had this version or a newer one.

        A False return is how the watch echo of the operator's own write is recognised (the
        write's response was stored first), so that echo costs no reconcile.
        """
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                old_rv, new_rv = _rv(old), _rv(body)
                same = (old.get("metadata") or {}).get("uid") == meta.get("uid")
                if same and old_rv is not None and new_rv is not None and new_rv <= old_rv:
                    return False
            self._items[key] = body
            owner = self._owner_key(body)
            if owner:
                self._by_owner.setdefault(owner, set()).add(key[1])
            return True

    def remove(self, namespace: str, name: str) -> None:
        with self._lock:
            body = self._items.pop((namespace, name), None)
            owner = self._owner_key(body) if body else None
            if owner and owner in self._by_owner:
                self._by_owner[owner].discard(name)
                if not self._by_owner[owner]:
                    del self._by_owner[owner]

    def get(self, namespace: str, name: str) -> Body | None:
        with self._lock:
            return self._items.get((namespace, name))

    def children(self, namespace: str, owner: str) -> list[Body]:
        with self._lock:
            names = self._by_owner.get((namespace, owner), set())
            return [self._items[(namespace, n)] for n in names if (namespace, n) in self._items]

    def snapshot_keys(self) -> list[Key]:
        with self._lock:
            return list(self._items)


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class Controller:
    """Owns the caches and the three reconcilers; one instance per operator process."""

    def __init__(self, config: OperatorConfig, kube: KubeClient, post_event: EventPoster) -> None:
        self.config = config
        self.kube = kube
        self.post_event = post_event
        self.runs = Store()
        self.pools = Store()
        self.tasks = Store()
        self.trainer_pods = Store(b.LABEL_RUN)
        self.rollout_pods = Store(b.LABEL_POOL)
        self.sandbox_pods = Store(b.LABEL_TASK)
        self.deployments = Store(b.LABEL_POOL)
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._policy_namespaces: set[str] = set()
        self._ensured: set[tuple[str, str, str]] = set()

    # ------------------------------------------------------------ plumbing

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    def _forget_lock(self, kind: str, namespace: str, name: str) -> None:
        with self._locks_guard:
            self._locks.pop((kind, namespace, name), None)

    @contextmanager
    def _reconciling(self, kind: str, namespace: str, name: str) -> Iterator[None]:
        """Per-object lock + OpenTelemetry span + Prometheus metrics around one reconcile."""
        started = time.perf_counter()
        RECONCILES.labels(kind).inc()
        with (
            self._lock(kind, namespace, name),
            tracer.start_as_current_span(f"reconcile {kind}") as span,
        ):
            span.set_attribute("k8s.namespace.name", namespace)
            span.set_attribute("posttrain.object", name)
            try:
                yield
            except Exception as exc:
                RECONCILE_ERRORS.labels(kind).inc()
                span.record_exception(exc)
                raise
            finally:
                RECONCILE_SECONDS.labels(kind).observe(time.perf_counter() - started)

    def _emit(self, body: Body, events: list[EventSpec]) -> None:
        for event in events:
            log.info("%s %s/%s: %s: %s", body.get("kind"), body["metadata"].get("namespace"),
                     body["metadata"].get("name"), event.reason, event.message)
            self.post_event(body, event)

    def _create(self, parent: str, manifest: Body) -> Body:
        created, obj = self.kube.create_or_adopt(manifest)
        (CHILDREN_CREATED if created else CHILDREN_ADOPTED).labels(parent, manifest["kind"]).inc()
        return obj

    def _patch_status(self, store: Store, body: Body, patch: dict[str, Any]) -> None:
        if not patch:
            return
        meta = body["metadata"]
        path = self.kube.path_of(
            {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": meta},
            with_name=True)
        updated = self.kube.patch(path, {"status": patch}, subresource="status")
        store.put(updated)

    # ------------------------------------------------------------ watch intake

    def observe(self, store: Store, event_type: str | None, body: Body) -> bool:
        """Apply a watch event to ``store``; False when it told the cache nothing new."""
        meta = body.get("metadata") or {}
        if event_type == "DELETED":
            store.remove(meta.get("namespace", ""), meta.get("name", ""))
            return True
        return store.put(body)

    # ------------------------------------------------------------ SandboxTask

    def reconcile_task(self, namespace: str, name: str) -> None:
        body = self.tasks.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with self._reconciling("SandboxTask", namespace, name):
            body = self.tasks.get(namespace, name) or body
            try:
                task = SandboxTask.model_validate(body)
            except ValidationError as exc:
                self._invalid(self.tasks, body, exc, terminal_phase="Failed")
                return
            pods = [pod_view(p) for p in self.sandbox_pods.children(namespace, name)]
            plan = plan_sandbox(task, pods, _now())
            if plan.delete_task:
                for pod in plan.delete_pods:
                    self.kube.delete("v1", "Pod", namespace, pod)
                self.kube.delete(API_VERSION, "SandboxTask", namespace, name)
                self._emit(body, plan.events)
                return
            if plan.create_attempt is not None:
                if task.spec.network == "none":
                    self._ensure_network_policy(namespace)
                try:
                    manifest = b.build_sandbox_pod(task, self.config, plan.create_attempt)
                except b.BuildError as exc:
                    self._invalid(self.tasks, body, exc, terminal_phase="Failed")
                    return
                self.sandbox_pods.put(self._create("SandboxTask", manifest))
            for pod in plan.delete_pods:
                self.kube.delete("v1", "Pod", namespace, pod)
            self._patch_status(self.tasks, body, plan.status_patch)
            self._emit(body, plan.events)

    def _ensure_network_policy(self, namespace: str) -> None:
        """The namespace's default-deny policy, created once per operator process."""
        if namespace in self._policy_namespaces:
            return
        self.kube.create_or_adopt(b.build_sandbox_network_policy(namespace))
        self._policy_namespaces.add(namespace)

    def _invalid(self, store: Store, body: Body, exc: Exception, terminal_phase: str | None) -> None:
        """A spec the builders cannot turn into children: say so on the object, don't retry."""
        message = f"cannot build children: {exc}"[:1000]
        gen = (body.get("metadata") or {}).get("generation")
        condition = {
            "type": ConditionType.FAILED if terminal_phase else ConditionType.READY,
            "status": "True" if terminal_phase else "False",
            "reason": Reason.INVALID_SPEC,
            "message": message,
            "lastTransitionTime": _now().isoformat().replace("+00:00", "Z"),
            "observedGeneration": gen,
        }
        patch: dict[str, Any] = {"conditions": [condition], "observedGeneration": gen}
        if terminal_phase:
            patch["phase"] = terminal_phase
        self._patch_status(store, body, patch)
        self._emit(body, [EventSpec("Warning", Reason.INVALID_SPEC, message)])

    # ------------------------------------------------------------ TrainingRun

    def reconcile_run(self, namespace: str, name: str) -> None:
        body = self.runs.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with self._reconciling("TrainingRun", namespace, name):
            body = self.runs.get(namespace, name) or body
            try:
                run = TrainingRun.model_validate(body)
            except ValidationError as exc:
                self._invalid(self.runs, body, exc, terminal_phase="Failed")
                return
            annotations = run.metadata.annotations
            incarnation = int(annotations.get(b.ANNOTATION_INCARNATION, "0") or 0)
            pods = [pod_view(p) for p in self.trainer_pods.children(namespace, name)]
            plan = plan_training_run(run, pods, incarnation, _now())
            for pod in plan.delete_pods:
                self.kube.delete("v1", "Pod", namespace, pod)
                self.trainer_pods.remove(namespace, pod)
            if plan.incarnation != incarnation:
                # Persist the new incarnation before its pods exist, so a restarted operator
                # continues this gang instead of recreating the old one.
                updated = self.kube.patch(
                    {"apiVersion": body["apiVersion"], "kind": "TrainingRun",
                     "metadata": body["metadata"]},
                    {"metadata": {"annotations": {
                        b.ANNOTATION_INCARNATION: str(plan.incarnation)}}})
                self.runs.put(updated)
                body = updated
            if plan.ensure_children:
                self._ensure_run_children(run)
            endpoints = self._rollout_endpoints(run) if plan.create_ranks else []
            for rank in plan.create_ranks:
                manifest = b.build_trainer_pod(
                    run, self.config, plan.incarnation, rank, rollout_endpoints=endpoints
                )
                self.trainer_pods.put(self._create("TrainingRun", manifest))
            self._patch_status(self.runs, body, plan.status_patch)
            self._emit(body, plan.events)

    def _rollout_endpoints(self, run: TrainingRun) -> list[str]:
        """The Service URL of spec.rollout.pool, when the pool exists (else none: the trainer
        then fails with a message that names the missing endpoints)."""
        pool_name = run.spec.rollout.pool
        if not pool_name or run.spec.rollout.endpoints:
            return []
        body = self.pools.get(run.metadata.namespace, pool_name) or self.kube.get(
            API_VERSION, "RolloutPool", run.metadata.namespace, pool_name
        )
        if body is None:
            log.warning("TrainingRun %s/%s: RolloutPool %r not found",
                        run.metadata.namespace, run.metadata.name, pool_name)
            return []
        return [b.pool_endpoint(RolloutPool.model_validate(body))]

    def _ensure_run_children(self, run: TrainingRun) -> None:
        """ConfigMap (refreshed to the current spec), trainer RBAC and head Service."""
        for manifest in b.build_trainer_children(run, self.config):
            obj = self._create("TrainingRun", manifest)
            if manifest["kind"] == "ConfigMap" and obj.get("data") != manifest["data"]:
                # The spec changed since the ConfigMap was made: new pods get the new config.
                self.kube.patch(manifest, {"data": manifest["data"]})

    def delete_run_storage(self, body: Body) -> int:
        """Delete every object under the run's storage URI (only with deleteOnRunDeletion)."""
        from posttrain.storage.store import open_store

        run = TrainingRun.model_validate(body)
        uri = b.run_storage_uri(run, self.config)
        store = open_store(uri, create_bucket=False)
        keys = store.list("")
        for key in keys:
            store.delete(key)
        self._emit(body, [EventSpec("Normal", Reason.STORAGE_DELETED,
                                    f"deleted {len(keys)} object(s) under {uri}")])
        return len(keys)

    # ------------------------------------------------------------ RolloutPool

    def reconcile_pool(self, namespace: str, name: str) -> None:
        body = self.pools.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with self._reconciling("RolloutPool", namespace, name):
            body = self.pools.get(namespace, name) or body
            try:
                pool = RolloutPool.model_validate(body)
                desired = b.build_rollout_deployment(pool, self.config)
            except (ValidationError, b.BuildError, ValueError) as exc:
                self._invalid(self.pools, body, exc, terminal_phase=None)
                return
            deployment = self.deployments.get(namespace, name)
            pods = [pod_view(p) for p in self.rollout_pods.children(namespace, name)]
            selector = b.selector_string(b.pool_selector(name))
            plan = plan_rollout_pool(pool, desired, deployment, pods, selector,
                                     b.pool_endpoint(pool))
            service_key = ("Service", namespace, f"{name}/{pool.metadata.uid}")
            if service_key not in self._ensured:
                self._create("RolloutPool", b.build_rollout_service(pool))
                self._ensured.add(service_key)
            if plan.create_deployment:
                self.deployments.put(self._create("RolloutPool", desired))
            if plan.patch_deployment:
                self.deployments.put(self.kube.patch(desired, plan.patch_deployment))
            self._patch_status(self.pools, body, plan.status_patch)
            self._emit(body, plan.events)

    # ------------------------------------------------------------ routing

    def on_pod(self, event_type: str | None, body: Body) -> None:
        """A labelled pod changed: update the right cache and reconcile its owner."""
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        namespace = meta.get("namespace", "")
        component = labels.get(b.LABEL_COMPONENT)
        # An unchanged pod (the echo of our own create) needs no reconcile of its owner.
        if component == b.COMPONENT_SANDBOX and b.LABEL_TASK in labels:
            if self.observe(self.sandbox_pods, event_type, body):
                self.reconcile_task(namespace, labels[b.LABEL_TASK])
        elif component == b.COMPONENT_TRAINER and b.LABEL_RUN in labels:
            if self.observe(self.trainer_pods, event_type, body):
                self.reconcile_run(namespace, labels[b.LABEL_RUN])
        elif component == b.COMPONENT_ROLLOUT and b.LABEL_POOL in labels:  # noqa: SIM102
            if self.observe(self.rollout_pods, event_type, body):
                self.reconcile_pool(namespace, labels[b.LABEL_POOL])

    def resync(self) -> None:
        """Reconcile everything known: time-based transitions (TTL, deadlines) and a safety
        net for missed events. Errors are logged per object so one bad object can't stop it."""
        for store, reconcile in (
            (self.runs, self.reconcile_run),
            (self.pools, self.reconcile_pool),
            (self.tasks, self.reconcile_task),
        ):
            for namespace, name in store.snapshot_keys():
                try:
                    reconcile(namespace, name)
                except (KubeError, OSError, httpx.HTTPError) as exc:
                    log.warning("resync of %s/%s failed: %s", namespace, name, exc)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        self._forget_lock(kind, namespace, name)
