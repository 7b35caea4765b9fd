"""Controllers: feed the pure plans in reconcile.py from in-memory caches and execute them.

The caches are the operator's informers: kopf's watch streams (see handlers.py) put every
TrainingRun, RolloutPool, SandboxTask, and every labelled Pod and Deployment here, and each
reconcile reads only the cache (no GETs on the hot path). Writes go through KubeClient and
their responses are put back into the cache, so the next reconcile reads its own writes.

Reconciles of the same object are serialised by a per-object lock (a pod event and a task
event can arrive on two threads at once); different objects run in parallel.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
import urllib3
from minio.error import MinioException
from pydantic import ValidationError

from posttrain.api import API_VERSION, RolloutPool, SandboxTask, SandboxWarmPool, TrainingRun
from posttrain.api.labels import ANNOTATION_INCARNATION
from posttrain.errors import UsageError
from posttrain.telemetry import get_tracer

from . import builders as b
from . import sandbox_runner
from . import warmpool as wp
from .admission import KueueAdmission
from .config import OperatorConfig
from .kube import KubeClient, KubeError, resource_path
from .metrics import (
    CHILDREN_ADOPTED,
    CHILDREN_CREATED,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    RECONCILES,
    SANDBOX_ARTIFACT_URLS,
    WARM_POOL_CLAIM_CONFLICTS,
    WARM_POOL_CLAIM_SECONDS,
    WARM_POOL_CLAIMS,
)
from .reasons import ConditionType, Reason
from .reconcile import (
    TERMINAL,
    EventSpec,
    PodView,
    RayClusterView,
    SandboxPlan,
    managed_elsewhere,
    plan_rollout_pool,
    plan_sandbox,
    plan_training_run,
    pod_view,
    ray_cluster_view,
)

if TYPE_CHECKING:
    from posttrain.storage.store import S3Store

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

Body = dict[str, Any]
Key = tuple[str, str]
EventPoster = Callable[[Body, EventSpec], None]

# Idle pods a claim tries before giving up on the pool (each 409 means another claim or
# a status update won that pod; the next idle pod is tried).
MAX_CLAIM_TRIES = 8
# Pods one pool reconcile creates before it hands over (and asks for another pass): bounds how
# long the pool's lock is held, so refills interleave with claims and shutdown is prompt.
WARM_POOL_CREATE_BATCH = 50


# Steps of Controller._task_step_on_loop besides a manifest (compared by identity).
_NOOP: Body = {}
_FULL: Body = {}


def _count_child(parent: str, kind: str, created: bool) -> None:
    """One child created (or, after a 409, adopted) for a ``parent`` kind."""
    (CHILDREN_CREATED if created else CHILDREN_ADOPTED).labels(parent, kind).inc()


def _claimable(pod: Body, want_hash: str) -> bool:
    """wp.is_claimable on the raw body: cheap enough to scan a whole pool per claim."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return (
        b.LABEL_TASK not in (meta.get("labels") or {})
        and not meta.get("deletionTimestamp")
        and status.get("phase") == "Running"
        and (meta.get("annotations") or {}).get(b.ANNOTATION_SPEC_HASH) == want_hash
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
    )


def _rv(body: Body) -> int | None:
    value = (body.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


class Store:
    """Latest body per (namespace, name), plus an index of children by owner label value.

    Never goes back in time: a watch event older than a write response already stored is
    ignored (resourceVersions are compared as integers, which etcd-backed servers use). That
    holds across a removal too: events of one kind are cached on different threads, so a
    pod's DELETED event (or the operator's own delete) can be applied before an older
    MODIFIED event of the same pod; a tombstone (uid, resourceVersion) keeps that stale
    event from bringing the deleted pod back as a live one that no later event would remove.
    """

    TOMBSTONE_SECONDS = 300.0
    """How long a removal is remembered: far longer than any event's trip through the
    operator's queues, short enough that a burst of deleted sandbox pods costs no memory."""

    def __init__(self, owner_label: str | None = None) -> None:
        self._owner_label = owner_label
        self._items: dict[Key, Body] = {}
        self._by_owner: dict[Key, set[str]] = {}
        self._tombstones: dict[Key, tuple[str | None, int | None, float]] = {}
        self._pruned_at = time.monotonic()
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
            tombstone = self._tombstones.get(key)
            if tombstone is not None:
                uid, removed_rv, _ = tombstone
                new_rv = _rv(body)
                if uid == meta.get("uid") and (
                    removed_rv is None or new_rv is None or new_rv <= removed_rv
                ):
                    return False  # an event from before the removal, delivered after it
                del self._tombstones[key]  # a newer version, or a new object of that name
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

    def remove(self, namespace: str, name: str, last: Body | None = None) -> None:
        """Forget ``namespace/name``; ``last`` is its final version when known (a DELETED
        event's body), else the cached one is. Older events of it are ignored from now on."""
        with self._lock:
            body = self._items.pop((namespace, name), None)
            final = last or body
            if final is not None:
                now = time.monotonic()
                if now - self._pruned_at > self.TOMBSTONE_SECONDS:  # amortised: O(1) a removal
                    self._tombstones = {
                        k: t
                        for k, t in self._tombstones.items()
                        if now - t[2] < self.TOMBSTONE_SECONDS
                    }
                    self._pruned_at = now
                rvs = [v for v in (_rv(final), _rv(body) if body else None) if v is not None]
                self._tombstones[(namespace, name)] = (
                    (final.get("metadata") or {}).get("uid"),
                    max(rvs) if rvs else None,
                    now,
                )
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


def _nodes(run: Body | None) -> int:
    """spec.resources.nodes of a raw TrainingRun body (1 when unset or unknown).

    >>> _nodes({"spec": {"resources": {"nodes": 4}}}), _nodes(None)
    (4, 1)
    """
    resources = ((run or {}).get("spec") or {}).get("resources") or {}
    value = resources.get("nodes", 1)
    return value if isinstance(value, int) else 1


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


# Per replica: a front door answers /v1/weights/version from memory, at once.
WEIGHT_PROBE_TIMEOUT_S = 2.0


def served_weight_versions(pods: list[Any], port: int) -> dict[str, int]:
    """Ask each ready replica's front door which weight version it serves (pod -> version).

    Asked, not announced: a replica needs no Kubernetes credentials to report, and the
    answer is what it serves now. Replicas that do not answer in time are left out (the
    pool's weightVersion is then unknown). Runs at every pool reconcile and resync.
    """
    ready = [p for p in pods if p.ready and p.ip and not p.deleting]
    if not ready:
        return {}

    def ask(pod: Any) -> tuple[str, int | None]:
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
        self.warm_pools = Store()
        self.warm_pods = Store(wp.LABEL_WARM_POOL)
        # Idle pods a claim is patching right now (so two threads never try the same one,
        # and the pool never deletes one mid-claim); refills waiting to run, coalesced.
        self._claiming: set[Key] = set()
        self._claim_lock = threading.Lock()
        self._refills_pending: set[Key] = set()
        self.deployments = Store(b.LABEL_POOL)
        self.ray_clusters = Store(b.LABEL_RUN)
        self._kuberay_lock = threading.Lock()
        self._kuberay_installed = False
        self._kuberay_checked_at = float("-inf")
        self.workloads = Store(b.LABEL_RUN)
        self.kueue = KueueAdmission(config, kube, self.workloads)
        self._left_alone: set[str] = set()  # uids of runs managed elsewhere, already told
        self._locks: dict[tuple[str, str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._policy_namespaces: set[str] = set()
        self._artifacts: S3Store | None = None  # of sandbox_artifacts_uri, opened on first use
        self._ensured: set[tuple[str, str, str]] = set()

    # ------------------------------------------------------------ plumbing

    def _lock(self, kind: str, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((kind, namespace, name), threading.Lock())

    def _forget_lock(self, kind: str, namespace: str, name: str) -> None:
        with self._locks_guard:
            self._locks.pop((kind, namespace, name), None)

    @contextmanager
    def _reconciling(
        self,
        kind: str,
        namespace: str,
        name: str,
        locked: bool = False,
        started: float | None = None,
    ) -> Iterator[None]:
        """Per-object lock (``locked``: the caller holds it) + OpenTelemetry span + Prometheus
        metrics around one reconcile."""
        started = time.perf_counter() if started is None else started
        RECONCILES.labels(kind).inc()
        with (
            nullcontext() if locked else self._lock(kind, namespace, name),
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
            log.info(
                "%s %s/%s: %s: %s",
                body.get("kind"),
                body["metadata"].get("namespace"),
                body["metadata"].get("name"),
                event.reason,
                event.message,
            )
            self.post_event(body, event)

    def _create(self, parent: str, manifest: Body) -> Body:
        created, obj = self.kube.create_or_adopt(manifest)
        _count_child(parent, manifest["kind"], created)
        return obj

    def _patch_status(self, store: Store, body: Body, patch: dict[str, Any]) -> None:
        if not patch:
            return
        meta = body["metadata"]
        path = self.kube.path_of(
            {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": meta},
            with_name=True,
        )
        updated = self.kube.patch(path, {"status": patch}, subresource="status")
        store.put(updated)

    # ------------------------------------------------------------ watch intake

    def observe(self, store: Store, event_type: str | None, body: Body) -> bool:
        """Apply a watch event to ``store``; False when it told the cache nothing new."""
        meta = body.get("metadata") or {}
        if event_type == "DELETED":
            store.remove(meta.get("namespace", ""), meta.get("name", ""), last=body)
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
            # Warm pods were started without the artifact entrypoint: snapshot/restore go cold.
            needs_entrypoint = task.spec.snapshot or task.spec.restore_from is not None
            if plan.create_attempt == 1 and task.spec.warm_pool_ref and not needs_entrypoint:
                try:
                    claimed = self._claim_warm_pod(task, body)
                except b.BuildError as exc:
                    self._invalid(self.tasks, body, exc, terminal_phase="Failed")
                    return
                if claimed is not None:
                    plan = self._plan_claimed(task, claimed)
            if plan.create_attempt is not None:
                if task.spec.network == "none":
                    self._ensure_network_policy(namespace)
                try:
                    artifacts = self._sandbox_artifacts(task, plan.create_attempt)
                    manifest = b.build_sandbox_pod(
                        task, self.config, plan.create_attempt, artifacts=artifacts
                    )
                except b.BuildError as exc:
                    self._invalid(self.tasks, body, exc, terminal_phase="Failed")
                    return
                self.sandbox_pods.put(self._create("SandboxTask", manifest))
            for pod in plan.delete_pods:
                self.kube.delete("v1", "Pod", namespace, pod)
            self._patch_status(self.tasks, body, plan.status_patch)
            self._emit(body, plan.events)

    async def reconcile_task_on_loop(
        self,
        namespace: str,
        name: str,
        create: Callable[[Body], Awaitable[tuple[bool, Body]]],
    ) -> bool:
        """reconcile_task for the burst case without leaving the event loop; False when the
        caller must run reconcile_task on a thread instead.

        Handled here: a reconcile with nothing to do, or whose one write is the pod create
        (a new task: no status patch, no Event), made with ``create`` (AsyncKube's). Anything
        more (retries, status transitions, warm-pool claims, artifact URLs, the network
        policy's first create, invalid specs) and a task whose lock another reconcile holds
        go to the thread: the loop never blocks on a lock or a synchronous request.
        """
        started = time.perf_counter()
        lock = self._lock("SandboxTask", namespace, name)
        if not lock.acquire(blocking=False):
            return False
        try:
            step = self._task_step_on_loop(namespace, name)
            if step is None or step is _FULL:
                return step is None
            with self._reconciling("SandboxTask", namespace, name, locked=True, started=started):
                if step is not _NOOP:
                    created, obj = await create(step)
                    _count_child("SandboxTask", "Pod", created)
                    self.sandbox_pods.put(obj)
            return True
        finally:
            lock.release()

    def _task_step_on_loop(self, namespace: str, name: str) -> Body | None:
        """For reconcile_task_on_loop, without I/O: None (no task, or it is being deleted:
        reconcile_task would return at once), _NOOP, _FULL, or the pod manifest to create."""
        body = self.tasks.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        try:
            task = SandboxTask.model_validate(body)
        except ValidationError:
            return _FULL
        pods = [pod_view(p) for p in self.sandbox_pods.children(namespace, name)]
        plan = plan_sandbox(task, pods, _now())
        if plan.delete_task or plan.delete_pods or plan.status_patch or plan.events:
            return _FULL
        if plan.create_attempt is None:
            return _NOOP
        spec = task.spec
        if (
            spec.warm_pool_ref
            or spec.snapshot
            or spec.restore_from
            or self.config.sandbox_artifacts_uri
            or (spec.network == "none" and namespace not in self._policy_namespaces)
        ):
            return _FULL
        try:
            return b.build_sandbox_pod(task, self.config, plan.create_attempt)
        except b.BuildError:
            return _FULL

    def _ensure_network_policy(self, namespace: str) -> None:
        """The namespace's default-deny policy, created once per operator process (its one
        egress exception, the artifact store, follows the operator's configuration)."""
        if namespace in self._policy_namespaces:
            return
        egress = self.config.sandbox_artifacts_egress if self.config.sandbox_artifacts_uri else []
        manifest = b.build_sandbox_network_policy(namespace, egress)
        _, existing = self.kube.create_or_adopt(manifest)
        if (existing.get("spec") or {}).get("egress") != manifest["spec"].get("egress"):
            self.kube.patch(manifest, {"spec": {"egress": manifest["spec"].get("egress")}})
        self._policy_namespaces.add(namespace)

    def _artifact_store(self) -> S3Store:
        """The S3 store of sandbox_artifacts_uri's bucket, opened once (with the operator's own
        credentials from its environment, like delete_run_storage)."""
        if self._artifacts is None:
            from posttrain.storage.store import s3_store_from_env

            bucket = self.config.sandbox_artifacts_uri[len("s3://") :].partition("/")[0]
            self._artifacts = s3_store_from_env(bucket, create_bucket=True)
        return self._artifacts

    def _sandbox_artifacts(self, task: SandboxTask, attempt: int) -> b.SandboxArtifacts | None:
        """Presigned URLs for this attempt's log (always), snapshot (spec.snapshot) and the
        snapshot to restore (spec.restoreFrom); None when artifact storage is off.

        Each URL is good for one object and expires after the task's deadline plus an hour
        (scheduling, image pulls). restoreFrom must name an object under this namespace's
        prefix: the operator's credentials can read more than a task may.
        """
        spec = task.spec
        uri = self.config.sandbox_artifacts_uri
        if not uri:
            if spec.snapshot or spec.restore_from:
                raise b.BuildError(
                    "spec.snapshot / spec.restoreFrom need sandbox artifact storage, which this "
                    "operator has not got: set POSTTRAIN_OPERATOR_SANDBOX_ARTIFACTS_URI "
                    "(s3://bucket/prefix) or drop those fields"
                )
            return None
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        namespace_prefix = "/".join(p for p in (prefix.strip("/"), task.metadata.namespace) if p)
        if spec.restore_from and not spec.restore_from.startswith(
            f"s3://{bucket}/{namespace_prefix}/"
        ):
            raise b.BuildError(
                f"spec.restoreFrom {spec.restore_from!r} is not a sandbox snapshot of this "
                f"namespace; use a status.snapshotUri under s3://{bucket}/{namespace_prefix}/"
            )
        expires = timedelta(
            seconds=min(
                spec.timeout_seconds + self.config.sandbox_upload_grace_seconds + 3600,
                7 * 24 * 3600,
            )
        )  # S3's longest presigned lifetime
        self._ensure_entrypoint(task.metadata.namespace)
        try:
            client = self._artifact_store().client
            logs_key = b.sandbox_artifact_key(prefix, task, attempt, "logs.txt")
            artifacts = b.SandboxArtifacts(
                logs_uri=f"s3://{bucket}/{logs_key}",
                logs_url=client.presigned_put_object(bucket, logs_key, expires=expires),
            )
            if spec.snapshot:
                key = b.sandbox_artifact_key(prefix, task, attempt, "snapshot.tar")
                artifacts = replace(
                    artifacts,
                    snapshot_uri=f"s3://{bucket}/{key}",
                    snapshot_url=client.presigned_put_object(bucket, key, expires=expires),
                )
            if spec.restore_from:
                key = spec.restore_from[len(f"s3://{bucket}/") :]
                artifacts = replace(
                    artifacts, restore_url=client.presigned_get_object(bucket, key, expires=expires)
                )
        except (MinioException, urllib3.exceptions.HTTPError, UsageError, OSError) as exc:
            if spec.snapshot or spec.restore_from:
                raise  # retried by the next event or resync; the task needs the store
            log.warning(
                "SandboxTask %s/%s runs without a stored log: cannot sign URLs for %s (%s)",
                task.metadata.namespace,
                task.metadata.name,
                uri,
                exc,
            )
            return None
        SANDBOX_ARTIFACT_URLS.inc()
        return artifacts

    def _ensure_entrypoint(self, namespace: str) -> None:
        """The namespace's entrypoint ConfigMap, created once per operator process."""
        key = ("ConfigMap", namespace, b.sandbox_entrypoint_config_map_name())
        if key in self._ensured:
            return
        self.kube.create_or_adopt(b.build_sandbox_entrypoint_config_map(namespace))
        self._ensured.add(key)

    # ------------------------------------------------------------ SandboxWarmPool

    def _claim_warm_pod(self, task: SandboxTask, body: Body) -> Body | None:
        """Adopt an idle ready pod of spec.warmPoolRef for attempt 1; None = go cold.

        The claim is one merge patch with the pod's resourceVersion as a precondition: if the
        pod changed since the cache saw it (another claim, a deletion) the apiserver answers
        409 and the next idle pod is tried, so a pod is never handed to two tasks.
        """
        namespace, ref = task.metadata.namespace, task.spec.warm_pool_ref or ""
        if task.status.warm_pool:
            return None  # claimed once already (that pod is gone): retry cold, never twice
        pool_body = self.warm_pools.get(namespace, ref)
        if pool_body is None:
            WARM_POOL_CLAIMS.labels("missing").inc()
            self._emit(
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
        mismatch = wp.claim_mismatch(task, pool, self.config)
        if mismatch:
            WARM_POOL_CLAIMS.labels("mismatch").inc()
            self._emit(
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
        want_hash = wp.template_hash(wp.pool_template(pool, self.config))
        started = time.perf_counter()
        tried: set[str] = set()
        for _ in range(MAX_CLAIM_TRIES):
            pod = self._reserve_idle_pod(namespace, ref, want_hash, tried)
            if pod is None:
                break
            pod_name = pod["metadata"]["name"]
            tried.add(pod_name)
            try:
                claimed = self.kube.patch(
                    resource_path("v1", "pods", namespace, pod_name),
                    wp.build_claim_patch(task, pod, _now()),
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
            self.sandbox_pods.put(claimed)
            self.warm_pods.put(claimed)
            self.request_pool_reconcile(namespace, ref)
            return claimed
        WARM_POOL_CLAIMS.labels("empty").inc()
        return None

    def _reserve_idle_pod(
        self, namespace: str, pool: str, want_hash: str, skip: set[str]
    ) -> Body | None:
        with self._claim_lock:
            for pod in self.warm_pods.children(namespace, pool):
                name = pod["metadata"]["name"]
                if name in skip or (namespace, name) in self._claiming:
                    continue
                if _claimable(pod, want_hash):
                    self._claiming.add((namespace, name))
                    return pod
        return None

    def _plan_claimed(self, task: SandboxTask, claimed: Body) -> SandboxPlan:
        """Re-plan with the claimed pod: it is already running, so the task is Running now
        (one status write records the claim, the pod and the start)."""
        namespace, name = task.metadata.namespace, task.metadata.name
        pods = [pod_view(p) for p in self.sandbox_pods.children(namespace, name)]
        plan = plan_sandbox(task, pods, _now())
        plan.status_patch["warmPool"] = task.spec.warm_pool_ref
        if "startTime" in plan.status_patch:
            plan.status_patch["startTime"] = _now().isoformat().replace("+00:00", "Z")
        log.debug(
            "SandboxTask %s/%s claimed warm pod %s", namespace, name, claimed["metadata"]["name"]
        )
        return plan

    def request_pool_reconcile(self, namespace: str, pool: str) -> None:
        """Reconcile the pool soon, on its own thread; any number of requests made before it
        starts coalesce into one.

        Claims and pooled-pod events come in bursts of hundreds, and each pool reconcile
        looks at every pod of the pool: reconciling once per event was quadratic, and the
        reconciles queued on the pool's lock held kopf's worker threads away from the tasks
        (a 500-claim burst took 78 s and 17 CPU-s before this).
        """
        key = (namespace, pool)
        with self._claim_lock:
            if key in self._refills_pending:
                return
            self._refills_pending.add(key)

        def refill() -> None:
            with self._claim_lock:
                self._refills_pending.discard(key)
            try:
                self.reconcile_warm_pool(namespace, pool)
            except (KubeError, OSError, httpx.HTTPError) as exc:
                log.warning(
                    "refill of SandboxWarmPool %s/%s failed: %s (resync retries)",
                    namespace,
                    pool,
                    exc,
                )

        context = contextvars.copy_context()  # kopf's event poster lives in context variables
        threading.Thread(
            target=context.run, args=(refill,), name=f"refill-{pool}", daemon=True
        ).start()

    def reconcile_warm_pool(self, namespace: str, name: str) -> None:
        body = self.warm_pools.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return
        with self._reconciling("SandboxWarmPool", namespace, name):
            body = self.warm_pools.get(namespace, name) or body
            try:
                pool = SandboxWarmPool.model_validate(body)
            except ValidationError as exc:
                self._invalid(self.warm_pools, body, exc, terminal_phase=None)
                return
            want_hash = wp.template_hash(wp.pool_template(pool, self.config))
            pods = [pod_view(p) for p in self.warm_pods.children(namespace, name)]
            with self._claim_lock:
                reserved = frozenset(n for ns, n in self._claiming if ns == namespace)
            plan = wp.plan_warm_pool(pool, pods, want_hash, reserved)
            for pod_name in plan.delete_pods:
                self._delete_idle_pod(namespace, pod_name)
            if plan.create and pool.spec.network == "none":
                self._ensure_network_policy(namespace)
            manifest = wp.build_warm_pod(pool, self.config) if plan.create else None
            for _ in range(min(plan.create, WARM_POOL_CREATE_BATCH)):
                assert manifest is not None
                created = self.kube.request("POST", self.kube.path_of(manifest), manifest)[1]
                CHILDREN_CREATED.labels("SandboxWarmPool", "Pod").inc()
                self.warm_pods.put(created)
            self._patch_status(self.warm_pools, body, plan.status_patch)
            self._emit(body, plan.events)
        if plan.create > WARM_POOL_CREATE_BATCH:
            self.request_pool_reconcile(namespace, name)

    def _delete_idle_pod(self, namespace: str, name: str) -> None:
        """Delete an idle pod only if it is still the version the cache saw: a pod claimed
        in the meantime (new resourceVersion) is refused with 409 and kept."""
        pod = self.warm_pods.get(namespace, name)
        rv = ((pod or {}).get("metadata") or {}).get("resourceVersion")
        body: dict[str, Any] = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "propagationPolicy": "Background",
        }
        if rv:
            body["preconditions"] = {"resourceVersion": rv}
        status, _ = self.kube.request(
            "DELETE", resource_path("v1", "pods", namespace, name), body, ok=(200, 202, 404, 409)
        )
        if status == 409:
            log.info("idle pod %s/%s changed before its deletion (claimed?); kept", namespace, name)

    def warm_pool_deleted(self, namespace: str, name: str) -> None:
        """Delete the idle pods of a deleted pool (the garbage collector does the same
        through ownerReferences where kube-controller-manager runs); claimed pods belong to
        their tasks and stay."""
        for pod in self.warm_pods.children(namespace, name):
            meta = pod["metadata"]
            if b.LABEL_TASK not in (meta.get("labels") or {}) and not meta.get("deletionTimestamp"):
                self._delete_idle_pod(namespace, meta["name"])
        self.forget("SandboxWarmPool", namespace, name)

    def _invalid(
        self, store: Store, body: Body, exc: Exception, terminal_phase: str | None
    ) -> None:
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
            # managedBy first, before even validating: another controller's run is not ours
            # to judge, change or report on (Kubeflow Trainer's and JobSet's rule).
            why = managed_elsewhere((body.get("spec") or {}).get("managedBy"))
            if why is not None:
                self._leave_alone(body, why)
                return
            try:
                run = TrainingRun.model_validate(body)
            except ValidationError as exc:
                self._invalid(self.runs, body, exc, terminal_phase="Failed")
                return
            annotations = run.metadata.annotations
            incarnation = int(annotations.get(ANNOTATION_INCARNATION, "0") or 0)
            pods = [pod_view(p) for p in self.trainer_pods.children(namespace, name)]
            clusters = self._ray_clusters_of(run, pods)
            kueue = self.kueue.gate(run)
            plan = plan_training_run(
                run, pods, incarnation, _now(), ray_clusters=clusters, kueue=kueue
            )
            for pod in plan.delete_pods:
                self.kube.delete("v1", "Pod", namespace, pod)
                self.trainer_pods.remove(namespace, pod)
            for cluster in plan.delete_ray_clusters:
                self.kube.delete(b.RAY_API_VERSION, "RayCluster", namespace, cluster)
                self.ray_clusters.remove(namespace, cluster)
            if plan.incarnation != incarnation:
                # Persist the new incarnation before its pods exist, so a restarted operator
                # continues this gang instead of recreating the old one.
                updated = self.kube.patch(
                    {
                        "apiVersion": body["apiVersion"],
                        "kind": "TrainingRun",
                        "metadata": body["metadata"],
                    },
                    {"metadata": {"annotations": {ANNOTATION_INCARNATION: str(plan.incarnation)}}},
                )
                self.runs.put(updated)
                body = updated
            if plan.create_workload or plan.workload_active is not None or plan.finish_workload:
                template = (
                    b.build_trainer_pod(run, self.config, plan.incarnation, 0)
                    if plan.create_workload
                    else None
                )
                self.kueue.apply(run, plan, template)
            if plan.ensure_children:
                self._ensure_run_children(run, ray_cluster=clusters is not None)
            creates = plan.create_ranks or plan.create_ray_cluster
            endpoints = self._rollout_endpoints(run) if creates else []
            if creates:
                run = self.kueue.placed(run, kueue)  # the admitted flavors' node labels
            if plan.create_ray_cluster:
                self._create_ray_cluster(run, plan.incarnation, endpoints)
            for rank in plan.create_ranks:
                manifest = b.build_trainer_pod(
                    run, self.config, plan.incarnation, rank, rollout_endpoints=endpoints
                )
                self.trainer_pods.put(self._create("TrainingRun", manifest))
            self._patch_status(self.runs, body, plan.status_patch)
            self._emit(body, plan.events)
            if plan.status_patch.get("phase") in TERMINAL and sandbox_runner.needs_own_runner(run):
                # The run's own runner has nothing left to verify (its Service and
                # NetworkPolicy cost nothing and go with the run).
                self.kube.delete(
                    "apps/v1", "Deployment", namespace, sandbox_runner.runner_name(run)
                )

    def _leave_alone(self, body: Body, why: str) -> None:
        """One Event per run (per operator process) saying why it is left alone."""
        uid = (body.get("metadata") or {}).get("uid", "")
        if uid in self._left_alone:
            return
        self._left_alone.add(uid)
        self._emit(body, [EventSpec("Normal", Reason.MANAGED_ELSEWHERE, why)])

    def on_workload(self, event_type: str | None, body: Body) -> None:
        """A run's Kueue Workload changed (Kueue admitted or evicted it): reconcile the run."""
        meta = body.get("metadata") or {}
        run = (meta.get("labels") or {}).get(b.LABEL_RUN)
        if run and self.observe(self.workloads, event_type, body):
            self.reconcile_run(meta.get("namespace", ""), run)

    def kuberay_installed(self, fresh: bool = False) -> bool:
        """Whether the apiserver serves rayclusters.ray.io, asked through API discovery at most
        once per ``kuberay_discovery_seconds`` (KubeRay installed later is picked up then).

        ``fresh`` asks discovery now: the choice of path for a gang that starts from nothing
        is made once and kept for the gang's life, so it must not rest on an answer that may
        predate the CRD (a cached "no" would put a whole gang on plain pods).
        """
        if not self.config.kuberay:
            return False
        with self._kuberay_lock:
            age = time.monotonic() - self._kuberay_checked_at
            if not fresh and age < self.config.kuberay_discovery_seconds:
                return self._kuberay_installed
        try:
            installed = self.kube.serves(b.RAY_API_VERSION, b.RAY_CLUSTER_PLURAL)
        except (KubeError, httpx.HTTPError) as exc:
            log.warning(
                "API discovery of %s failed (%s); keeping the last answer", b.RAY_API_VERSION, exc
            )
            installed = self._kuberay_installed
        with self._kuberay_lock:
            if installed != self._kuberay_installed:
                log.info(
                    "KubeRay RayCluster CRD %s: multi-node runs use %s",
                    "found" if installed else "not found",
                    "RayClusters" if installed else "plain head + worker pods",
                )
            self._kuberay_installed = installed
            self._kuberay_checked_at = time.monotonic()
        return installed

    def _forget_kuberay(self) -> None:
        """Ask discovery again at the next use (e.g. the CRD was removed under us)."""
        with self._kuberay_lock:
            self._kuberay_checked_at = float("-inf")

    def _ray_clusters_of(
        self, run: TrainingRun, pods: list[PodView]
    ) -> list[RayClusterView] | None:
        """The run's RayClusters when its gang is (or is about to be) a RayCluster, else None.

        A run keeps the path its live gang is on: RayClusters already exist -> KubeRay; plain
        trainer pods (no ``ray.io/node-type`` label, which KubeRay puts on its pods) are
        running -> pods, even if KubeRay was installed meanwhile. Only a gang started from
        nothing (new run, resume) follows discovery.
        """
        if run.spec.resources.nodes < 2:
            return None
        namespace, name = run.metadata.namespace, run.metadata.name
        clusters = [ray_cluster_view(c) for c in self.ray_clusters.children(namespace, name)]
        if clusters:
            return clusters
        live = [p for p in pods if not p.deleting]
        if any(b.RAY_NODE_TYPE_LABEL not in p.labels for p in live):
            return None
        if live:
            return []
        if run.spec.suspend or run.status.phase in TERMINAL:
            return None  # no gang will start: no discovery needed
        return [] if self.kuberay_installed(fresh=True) else None

    def _create_ray_cluster(self, run: TrainingRun, incarnation: int, endpoints: list[str]) -> None:
        manifest = b.build_ray_cluster(run, self.config, incarnation, rollout_endpoints=endpoints)
        try:
            self.ray_clusters.put(self._create("TrainingRun", manifest))
        except KubeError as exc:
            if exc.status == 404:
                self._forget_kuberay()  # the CRD went away: rediscover before the next try
            raise

    def refresh_ray_clusters(self) -> None:
        """Re-list the RayClusters of namespaces with multi-node runs (resync safety net).

        The kopf watch only serves RayClusters when the CRD existed at operator start; with
        KubeRay installed later this list keeps the cache right, one LIST per namespace.
        """
        namespaces = sorted(
            {ns for ns, name in self.runs.snapshot_keys() if _nodes(self.runs.get(ns, name)) > 1}
        )
        if not namespaces or not self.kuberay_installed():
            return
        selector = f"{b.LABEL_COMPONENT}={b.COMPONENT_TRAINER}"
        for namespace in namespaces:
            try:
                items = self.kube.list(b.RAY_API_VERSION, "RayCluster", namespace, selector)
            except (KubeError, httpx.HTTPError) as exc:
                log.warning("listing RayClusters in %s failed: %s", namespace, exc)
                continue
            seen = set()
            for item in items:
                self.ray_clusters.put(item)
                seen.add(item["metadata"]["name"])
            for ns, name in self.ray_clusters.snapshot_keys():
                if ns == namespace and name not in seen:
                    self.ray_clusters.remove(ns, name)

    def on_ray_cluster(self, event_type: str | None, body: Body) -> None:
        """A labelled RayCluster changed (KubeRay wrote its status): reconcile its run."""
        meta = body.get("metadata") or {}
        run = (meta.get("labels") or {}).get(b.LABEL_RUN)
        if run and self.observe(self.ray_clusters, event_type, body):
            self.reconcile_run(meta.get("namespace", ""), run)

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
            log.warning(
                "TrainingRun %s/%s: RolloutPool %r not found",
                run.metadata.namespace,
                run.metadata.name,
                pool_name,
            )
            return []
        return [b.pool_endpoint(RolloutPool.model_validate(body))]

    def _ensure_run_children(self, run: TrainingRun, ray_cluster: bool = False) -> None:
        """ConfigMap (refreshed to the current spec), trainer RBAC and head Service."""
        for manifest in b.build_trainer_children(run, self.config, ray_cluster=ray_cluster):
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
        self._emit(
            body,
            [
                EventSpec(
                    "Normal", Reason.STORAGE_DELETED, f"deleted {len(keys)} object(s) under {uri}"
                )
            ],
        )
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
            served = served_weight_versions(pods, pool.spec.port)
            plan = plan_rollout_pool(
                pool, desired, deployment, pods, selector, b.pool_endpoint(pool), served
            )
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

    def route_pod(
        self, event_type: str | None, body: Body
    ) -> tuple[Key | None, Callable[[], None] | None]:
        """Cache a pod event; return (the SandboxTask it calls to reconcile, other blocking
        work), each None when there is none (the echo of our own write needs nothing).
        The informer caches inline, reconciles the task on the loop when it can
        (handlers.py), and spends a thread only on the rest."""
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(b.LABEL_COMPONENT) != b.COMPONENT_SANDBOX:
            return None, lambda: self._on_other_pod(event_type, body)
        namespace = meta.get("namespace", "")
        pool, task = labels.get(wp.LABEL_WARM_POOL), labels.get(b.LABEL_TASK)
        if pool and self.observe(self.warm_pods, event_type, body):
            self.request_pool_reconcile(namespace, pool)  # coalesced, never blocks this event
        if task and self.observe(self.sandbox_pods, event_type, body):
            return (namespace, task), None
        return None, None

    def _on_other_pod(self, event_type: str | None, body: Body) -> None:
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        namespace = meta.get("namespace", "")
        component = labels.get(b.LABEL_COMPONENT)
        # An unchanged pod (the echo of our own create) needs no reconcile of its owner.
        if component == b.COMPONENT_TRAINER and b.LABEL_RUN in labels:
            if self.observe(self.trainer_pods, event_type, body):
                self.reconcile_run(namespace, labels[b.LABEL_RUN])
        elif component == b.COMPONENT_ROLLOUT and b.LABEL_POOL in labels:  # noqa: SIM102
            if self.observe(self.rollout_pods, event_type, body):
                self.reconcile_pool(namespace, labels[b.LABEL_POOL])

    def resync(self) -> None:
        """Reconcile everything known: time-based transitions (TTL, deadlines) and a safety
        net for missed events. Errors are logged per object so one bad object can't stop it."""
        self.refresh_ray_clusters()
        self.kueue.refresh(
            sorted(
                {
                    ns
                    for ns, name in self.runs.snapshot_keys()
                    if ((self.runs.get(ns, name) or {}).get("metadata") or {})
                    .get("labels", {})
                    .get("kueue.x-k8s.io/queue-name")
                }
            )
        )
        for store, reconcile in (
            (self.runs, self.reconcile_run),
            (self.pools, self.reconcile_pool),
            (self.tasks, self.reconcile_task),
            (self.warm_pools, self.reconcile_warm_pool),
        ):
            for namespace, name in store.snapshot_keys():
                try:
                    reconcile(namespace, name)
                except (KubeError, OSError, httpx.HTTPError) as exc:
                    log.warning("resync of %s/%s failed: %s", namespace, name, exc)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        self._forget_lock(kind, namespace, name)
