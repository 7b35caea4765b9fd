"""The operator's reconcilers wired over one state, and where each watch event goes.

Every watch event (the informers in informer.py, their callbacks in handlers.py) is
cached in :class:`~.shared.state.OperatorState` first; an event that told the cache
something new then reconciles its object, or its owner for a child (a pod reconciles its
SandboxTask, TrainingRun or RolloutPool). The reconcilers themselves live one per kind, each in its kind's package
(``trainingrun/``, ``rolloutpool/``, ``sandboxtask/``, ``warmpool/``: ``reconciler.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from posttrain.api.labels import (
    COMPONENT_ROLLOUT,
    COMPONENT_SANDBOX,
    COMPONENT_TRAINER,
    LABEL_COMPONENT,
    LABEL_POOL,
    LABEL_RUN,
    LABEL_TASK,
    LABEL_WARM_POOL,
)
from posttrain.storage.errors import StorageError

from .config import OperatorConfig
from .kube import KubeClient, KubeError
from .rolloutpool.reconciler import RolloutPoolReconciler
from .sandboxtask.artifacts import SandboxArtifactSigner
from .sandboxtask.reconciler import SandboxTaskReconciler
from .shared.sandbox_namespace import SandboxNamespaces
from .shared.state import Body, EventPoster, Key, OperatorState, Store, observe
from .shared.workqueue import WorkQueue
from .storage_credentials import StorageCredentials
from .trainingrun.reconciler import TrainingRunReconciler
from .warmpool.reconciler import WarmPoolReconciler

log = logging.getLogger(__name__)


class Controller:
    """The four reconcilers and their shared state; one instance per operator process."""

    def __init__(self, config: OperatorConfig, kube: KubeClient, post_event: EventPoster) -> None:
        self.state = OperatorState(config, kube, post_event)
        namespaces = SandboxNamespaces(self.state)
        self.credentials = StorageCredentials(self.state)
        self.training_runs = TrainingRunReconciler(self.state, self.credentials)
        self.rollout_pools = RolloutPoolReconciler(self.state, self.credentials)
        self.warm_pools = WarmPoolReconciler(self.state, namespaces)
        self.sandbox_tasks = SandboxTaskReconciler(
            self.state, namespaces, SandboxArtifactSigner(config, namespaces), self.warm_pools
        )
        # Every kind's reconciles go through one queue once the runtime binds it to its pool.
        self.queue = WorkQueue(self._reconcile_key)
        self.warm_pools.enqueue = lambda namespace, pool: self.queue.add(
            "SandboxWarmPool", namespace, pool
        )

    def _reconcile_key(self, kind: str, namespace: str, name: str) -> None:
        self.reconciler_of(kind)(namespace, name)

    def enqueue(self, kind: str, namespace: str, name: str) -> None:
        """Reconcile the object through the work queue; inline when the queue is not bound
        (a Controller used without the runtime)."""
        if not self.queue.add(kind, namespace, name):
            self.reconciler_of(kind)(namespace, name)

    def reconciler_of(self, kind: str) -> Callable[[str, str], None]:
        """The (blocking) reconcile of ``kind``, e.g. for a requeued object."""
        return {
            "TrainingRun": self.training_runs.reconcile,
            "RolloutPool": self.rollout_pools.reconcile,
            "SandboxTask": self.sandbox_tasks.reconcile,
            "SandboxWarmPool": self.warm_pools.reconcile,
        }[kind]

    def observe(self, store: Store, event_type: str | None, body: Body) -> bool:
        """Apply a watch event to ``store``; False when it told the cache nothing new."""
        return observe(store, event_type, body)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """An object is gone: drop its per-object lock and its pending retry."""
        self.state.forget_lock(kind, namespace, name)

    # ------------------------------------------------------------ children's events

    def route_pod(self, event_type: str | None, body: Body) -> Key | None:
        """Cache a pod event (on the loop; never blocks); return the SandboxTask it calls to
        reconcile, None when there is none (the echo of our own write needs nothing). The
        informer reconciles the task on the loop when it can (handlers.py); a trainer's or
        rollout pod's owner is queued."""
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(LABEL_COMPONENT) != COMPONENT_SANDBOX:
            self._on_other_pod(event_type, body)
            return None
        namespace = meta.get("namespace", "")
        pool, task = labels.get(LABEL_WARM_POOL), labels.get(LABEL_TASK)
        state = self.state
        if pool and observe(state.warm_pods, event_type, body):
            self.warm_pools.request_reconcile(namespace, pool)  # coalesced, never blocks
        if task and observe(state.sandbox_pods, event_type, body):
            return namespace, task
        return None

    def _on_other_pod(self, event_type: str | None, body: Body) -> None:
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        namespace = meta.get("namespace", "")
        component = labels.get(LABEL_COMPONENT)
        # An unchanged pod (the echo of our own create) needs no reconcile of its owner.
        if component == COMPONENT_TRAINER and LABEL_RUN in labels:
            if observe(self.state.trainer_pods, event_type, body):
                self.enqueue("TrainingRun", namespace, labels[LABEL_RUN])
        elif component == COMPONENT_ROLLOUT and LABEL_POOL in labels:  # noqa: SIM102
            if observe(self.state.rollout_pods, event_type, body):
                self.enqueue("RolloutPool", namespace, labels[LABEL_POOL])

    def on_deployment(self, event_type: str | None, body: Body) -> None:
        """A pool's Deployment changed (replica counts): reconcile the pool."""
        meta = body.get("metadata") or {}
        pool = (meta.get("labels") or {}).get(LABEL_POOL)
        if observe(self.state.deployments, event_type, body) and pool:
            self.enqueue("RolloutPool", meta.get("namespace", ""), pool)

    def on_workload(self, event_type: str | None, body: Body) -> None:
        """A run's Kueue Workload changed (Kueue admitted or evicted it): reconcile the run."""
        meta = body.get("metadata") or {}
        run = (meta.get("labels") or {}).get(LABEL_RUN)
        if run and observe(self.state.workloads, event_type, body):
            self.enqueue("TrainingRun", meta.get("namespace", ""), run)

    def on_ray_cluster(self, event_type: str | None, body: Body) -> None:
        """A labelled RayCluster changed (KubeRay wrote its status): reconcile its run."""
        meta = body.get("metadata") or {}
        run = (meta.get("labels") or {}).get(LABEL_RUN)
        if run and observe(self.state.ray_clusters, event_type, body):
            self.enqueue("TrainingRun", meta.get("namespace", ""), run)

    # ------------------------------------------------------------ resync

    def discover(self) -> None:
        """Ask API discovery (each answer cached for its period) whether KubeRay's RayClusters
        and Kueue's Workloads are served: a CRD found starts that kind's informers
        (runtime.OptionalInformers), at start-up or whenever it is installed later."""
        self.training_runs.kuberay.installed()
        self.training_runs.kueue.installed()

    def resync(self) -> None:
        """Reconcile everything known: time-based transitions (TTL, deadlines) and a safety
        net for missed events. Each object is queued (an object already queued or being
        reconciled is not queued twice); inline without the queue, where errors are logged
        per object so one bad object can't stop it."""
        state = self.state
        self.discover()
        stores: list[tuple[Store, str]] = [
            (state.runs, "TrainingRun"),
            (state.pools, "RolloutPool"),
            (state.tasks, "SandboxTask"),
            (state.warm_pools, "SandboxWarmPool"),
        ]
        for store, kind in stores:
            for namespace, name in store.snapshot_keys():
                if self.queue.add(kind, namespace, name):
                    continue
                try:
                    self.reconciler_of(kind)(namespace, name)
                except (KubeError, OSError) as exc:
                    log.warning("resync of %s/%s failed: %s", namespace, name, exc)
        try:
            self.credentials.collect()  # revoke what deleted runs and pools held
        except (KubeError, OSError, StorageError) as exc:
            log.warning("collecting scoped storage credentials failed: %s", exc)
