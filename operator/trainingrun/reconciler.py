"""TrainingRun reconciler: the trainer gang (plain pods or a KubeRay RayCluster), its
ConfigMap/RBAC/Service, Kueue admission, restarts by incarnation, and the run's status.

plan (:func:`.plan.plan_training_run`) → build (:func:`.builders.build_trainer_pod`,
:func:`.raycluster.build_ray_cluster`, :func:`.builders.build_trainer_children`) → apply
(here). ``spec.managedBy`` is checked first: another controller's run is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from posttrain.api import API_VERSION, RolloutPool, TrainingRun
from posttrain.api.labels import ANNOTATION_INCARNATION
from posttrain.api.reasons import Reason
from posttrain.storage.errors import StorageError

from ..config import OperatorConfig
from ..kube import KubeError, controller_uid
from ..rolloutpool import builders as pool_builders
from ..shared.builders import BuildError
from ..shared.requeue import RetryLater
from ..shared.state import Body, OperatorState, now
from ..shared.views import TERMINAL, EventSpec, PodView, pod_view
from ..storage_credentials import StorageCredentials
from . import builders, finalizer, names, raycluster
from .admission import KueueAdmission
from .builders import build_trainer_children
from .gang import RayClusterView, ray_cluster_view
from .kuberay import KubeRayDiscovery
from .plan import KueueGate, RunPlan, managed_elsewhere, plan_training_run

log = logging.getLogger(__name__)

KIND = "TrainingRun"


class TrainingRunReconciler:
    """Reconciles TrainingRuns (on event threads and at resync)."""

    def __init__(self, state: OperatorState, credentials: StorageCredentials) -> None:
        self.state = state
        self.credentials = credentials
        self.kuberay = KubeRayDiscovery(state)
        self.kueue = KueueAdmission(state.config, state.kube, state.workloads)
        self._left_alone: set[str] = set()  # uids of runs managed elsewhere, already told

    def reconcile(self, namespace: str, name: str) -> None:
        state = self.state
        body = state.runs.get(namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            # Its RayCluster goes with it: nobody waits for its head's outcome any more.
            self._release_heads(namespace, state.trainer_pods.children(namespace, name), True)
            if body is not None and finalizer.has_finalizer(body):
                with state.reconciling(KIND, namespace, name):
                    self._finalize(state.runs.get(namespace, name) or body)
            return
        with state.reconciling(KIND, namespace, name):
            body = state.runs.get(namespace, name) or body
            # managedBy first, before even validating: another controller's run is not ours
            # to judge, change or report on (Kubeflow Trainer's and JobSet's rule).
            why = managed_elsewhere((body.get("spec") or {}).get("managedBy"))
            if why is not None:
                self._leave_alone(body, why)
                return
            try:
                run = TrainingRun.model_validate(body)
            except ValidationError as exc:
                state.invalid(state.runs, body, exc, terminal_phase="Failed")
                return
            # Before the gang can write anything: the finalizer that deletes it all later.
            body = self._set_finalizer(body, finalizer.deletes_storage(body))
            try:
                config = self.credentials.config_for_run(run)  # its own storage credentials
            except StorageError as exc:
                self.credentials.failed(body, exc)  # raises RetryLater: requeued
            annotations = run.metadata.annotations
            incarnation = int(annotations.get(ANNOTATION_INCARNATION, "0") or 0)
            pods = [pod_view(p) for p in self._own_pods(run)]
            clusters = self._ray_clusters_of(run, pods)
            kueue = self.kueue.gate(run)
            plan = plan_training_run(
                run, pods, incarnation, now(), ray_clusters=clusters, kueue=kueue
            )
            self._apply(run, body, config, plan, incarnation, clusters is not None, kueue)

    def _apply(
        self,
        run: TrainingRun,
        body: Body,
        config: OperatorConfig,
        plan: RunPlan,
        incarnation: int,
        on_kuberay: bool,
        kueue: KueueGate | None,
    ) -> None:
        """Execute the plan: deletes first, then the new incarnation (persisted before its
        pods exist), the Workload, the children and the gang, then status and Events."""
        state = self.state
        namespace = run.metadata.namespace
        for pod in plan.delete_pods:
            state.kube.delete("v1", "Pod", namespace, pod)
            state.trainer_pods.remove(namespace, pod)
        for cluster in plan.delete_ray_clusters:
            state.kube.delete(raycluster.RAY_API_VERSION, "RayCluster", namespace, cluster)
            state.ray_clusters.remove(namespace, cluster)
        if plan.incarnation != incarnation:
            # Persist the new incarnation before its pods exist, so a restarted operator
            # continues this gang instead of recreating the old one.
            updated = state.kube.patch(
                {
                    "apiVersion": body["apiVersion"],
                    "kind": KIND,
                    "metadata": body["metadata"],
                },
                {"metadata": {"annotations": {ANNOTATION_INCARNATION: str(plan.incarnation)}}},
            )
            state.runs.put(updated)
            body = updated
        if plan.create_workload or plan.workload_active is not None or plan.finish_workload:
            # The pod Kueue admits holds the colocated replicas too: their requests count.
            template = (
                self._trainer_pod(
                    run, config, plan.incarnation, 0, colocated_pool=self._colocated_pool(run)
                )
                if plan.create_workload
                else None
            )
            self.kueue.apply(run, plan, template)
        if plan.ensure_children:
            self._ensure_children(run, config, plan.incarnation, ray_cluster=on_kuberay)
        if plan.create_ranks or plan.create_ray_cluster:
            self._create_gang(run, config, plan, kueue)
        state.patch_status(state.runs, body, plan.status_patch)
        state.emit(body, plan.events)
        for api_version, kind, child in plan.release:
            state.kube.delete(api_version, kind, namespace, child)
        # After the status patch: the outcome a terminating head showed is recorded now.
        finished = (state.runs.get(namespace, run.metadata.name) or body).get("status", {})
        self._release_heads(
            namespace,
            state.trainer_pods.children(namespace, run.metadata.name),
            (finished or {}).get("phase") in TERMINAL,
        )

    def _release_heads(self, namespace: str, pods: list[Body], run_finished: bool) -> None:
        """Remove :data:`raycluster.HEAD_OUTCOME_FINALIZER` from deleted head pods once the
        kubelet has moved them to a terminal phase (the plan has then seen rank 0's outcome),
        or whatever their phase once the run is finished or gone (a head whose node went
        away never gets one)."""
        for pod in pods:
            meta = pod.get("metadata") or {}
            finalizers = meta.get("finalizers") or []
            if raycluster.HEAD_OUTCOME_FINALIZER not in finalizers or not meta.get(
                "deletionTimestamp"
            ):
                continue
            if not run_finished and (pod.get("status") or {}).get("phase") not in TERMINAL:
                continue
            keep = [f for f in finalizers if f != raycluster.HEAD_OUTCOME_FINALIZER]
            ref = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": meta["name"], "namespace": namespace}}  # fmt: skip
            try:
                self.state.kube.patch(ref, {"metadata": {"finalizers": keep or None}})
            except KubeError as exc:  # gone already, or the next event retries
                log.debug("releasing %s/%s: %s", namespace, meta["name"], exc)

    def _create_gang(
        self, run: TrainingRun, config: OperatorConfig, plan: RunPlan, kueue: KueueGate | None
    ) -> None:
        """The gang of ``plan.incarnation``: its RayCluster or its missing ranks' pods, told
        where the run's rollout pool serves and in which dtype."""
        state = self.state
        colocated = self._colocated_pool(run)
        pool = colocated or self._rollout_pool(run)
        endpoints = [pool_builders.pool_endpoint(pool)] if pool is not None else []
        dtype = pool_builders.pool_serving_dtype(pool) if pool is not None else None
        run = self.kueue.placed(run, kueue)  # the admitted flavors' node labels
        if plan.create_ray_cluster:
            self._create_ray_cluster(run, config, plan.incarnation, endpoints, dtype)
        for rank in plan.create_ranks:
            manifest = self._trainer_pod(
                run,
                config,
                plan.incarnation,
                rank,
                rollout_endpoints=endpoints,
                rollout_dtype=dtype,
                colocated_pool=colocated,
            )
            state.trainer_pods.put(state.create(KIND, manifest))

    def _leave_alone(self, body: Body, why: str) -> None:
        """One Event per run (per operator process) saying why it is left alone."""
        uid = (body.get("metadata") or {}).get("uid", "")
        if uid in self._left_alone:
            return
        self._left_alone.add(uid)
        self.state.emit(body, [EventSpec("Normal", Reason.MANAGED_ELSEWHERE, why)])

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
        clusters = [ray_cluster_view(c) for c in self.state.ray_clusters.children(namespace, name)]
        if clusters:
            return clusters
        live = [p for p in pods if not p.deleting]
        if any(raycluster.RAY_NODE_TYPE_LABEL not in p.labels for p in live):
            return None
        if live:
            return []
        if run.spec.suspend or run.status.phase in TERMINAL:
            return None  # no gang will start: no discovery needed
        return [] if self.kuberay.installed(fresh=True) else None

    def _create_ray_cluster(
        self,
        run: TrainingRun,
        config: OperatorConfig,
        incarnation: int,
        endpoints: list[str],
        dtype: str | None,
    ) -> None:
        state = self.state
        manifest = raycluster.build_ray_cluster(
            run, config, incarnation, rollout_endpoints=endpoints, rollout_dtype=dtype
        )
        try:
            state.ray_clusters.put(state.create(KIND, manifest))
        except KubeError as exc:
            if exc.status == 404:
                self.kuberay.forget()  # the CRD went away: rediscover before the next try
            raise

    def _rollout_pool(self, run: TrainingRun) -> RolloutPool | None:
        """spec.rollout.pool, when the run samples from one and it exists (else None: the
        trainer then fails with a message that names the missing endpoints). Its Service
        URL and serving dtype go into the trainer pods' environment."""
        pool_name = run.spec.rollout.pool
        if not pool_name or run.spec.rollout.endpoints:
            return None
        body = self.state.pools.get(run.metadata.namespace, pool_name) or self.state.kube.get(
            API_VERSION, "RolloutPool", run.metadata.namespace, pool_name
        )
        if body is None:
            log.warning(
                "TrainingRun %s/%s: RolloutPool %r not found",
                run.metadata.namespace,
                run.metadata.name,
                pool_name,
            )
            return None
        return RolloutPool.model_validate(body)

    def _trainer_pod(
        self, run: TrainingRun, config: OperatorConfig, incarnation: int, rank: int, **kw: Any
    ) -> Body:
        """:func:`.builders.build_trainer_pod`; a spec it cannot build (colocated replicas
        whose ports clash with the trainer's) is said in a Warning Event and retried with
        backoff, as the pool it depends on may be fixed meanwhile."""
        try:
            return builders.build_trainer_pod(run, config, incarnation, rank, **kw)
        except BuildError as exc:
            raise self._warn_and_retry(run, Reason.INVALID_SPEC, str(exc)) from exc

    def _colocated_pool(self, run: TrainingRun) -> RolloutPool | None:
        """spec.rollout.pool when the run colocates its replicas (None when it does not).

        Its pods cannot be built without the pool (the replicas' template): a missing
        pool is said in a Warning Event and the reconcile retried with backoff, so the run
        starts once the pool is created.
        """
        if run.spec.rollout.colocated is None:
            return None
        pool = self._rollout_pool(run)
        if pool is None:
            message = (
                f"rollout.colocated: RolloutPool {run.spec.rollout.pool!r} (the template of "
                "the replicas in the trainer pod) does not exist; the trainer starts once it "
                "does (replicas: 0 makes a pool only a template)"
            )
            raise self._warn_and_retry(run, Reason.ROLLOUT_POOL_NOT_FOUND, message)
        return pool

    def _warn_and_retry(self, run: TrainingRun, reason: str, message: str) -> RetryLater:
        """A Warning Event on the run saying ``message``, and the RetryLater to raise: the
        reconcile is retried with backoff until what it waits for is fixed."""
        body = self.state.runs.get(run.metadata.namespace, run.metadata.name)
        if body is not None:
            self.state.emit(body, [EventSpec("Warning", reason, message)])
        return RetryLater(message)

    def _own_pods(self, run: TrainingRun) -> list[Body]:
        """The trainer pods of this run *object*. Pods of a deleted run of the same name
        (another uid; they carry the same label) are not its gang, whatever their phase:
        they are deleted, as the garbage collector would, so a run deleted and applied again
        neither takes the old run's finished rank 0 for its own nor waits on its names."""
        namespace, name = run.metadata.namespace, run.metadata.name
        # KubeRay's pods are controlled by their RayCluster, not by the run: those of the
        # run's own clusters are its gang; those of another cluster are left to the garbage
        # collector (their cluster belongs to an earlier run and goes with it).
        clusters = self.state.ray_clusters.children(namespace, name)
        own_clusters = {c["metadata"]["uid"] for c in clusters
                        if controller_uid(c) == run.metadata.uid}  # fmt: skip
        own = []
        for pod in self.state.trainer_pods.children(namespace, name):
            controller = controller_uid(pod)
            if controller in (None, run.metadata.uid) or controller in own_clusters:
                own.append(pod)
                continue
            if _controller_kind(pod) == "RayCluster":
                self._release_heads(namespace, [pod], True)  # an earlier run's: not waited on
                continue
            pod_name = pod["metadata"]["name"]
            log.info(
                "TrainingRun %s/%s: deleting %s of an earlier run of that name",
                namespace,
                name,
                pod_name,
            )
            self.state.kube.delete("v1", "Pod", namespace, pod_name)
            self.state.trainer_pods.remove(namespace, pod_name)
        return own

    def _ensure_children(
        self,
        run: TrainingRun,
        config: OperatorConfig,
        incarnation: int,
        ray_cluster: bool = False,
    ) -> None:
        """ConfigMap (refreshed to the current spec), trainer RBAC and head Service (its
        selector moved to gang ``incarnation`` before that gang's pods exist)."""
        children = build_trainer_children(run, config, incarnation, ray_cluster=ray_cluster)
        for manifest in children:
            obj = self.state.create(KIND, manifest)
            if manifest["kind"] == "ConfigMap" and obj.get("data") != manifest["data"]:
                # The spec changed since the ConfigMap was made: new pods get the new config.
                self.state.kube.patch(manifest, {"data": manifest["data"]})
            selector = manifest["spec"].get("selector") if manifest["kind"] == "Service" else None
            if selector and (obj.get("spec") or {}).get("selector") != selector:
                # A new gang: the head Service must stop resolving to the old gang's rank 0.
                self.state.kube.patch(manifest, {"spec": {"selector": selector}})

    def _set_finalizer(self, body: Body, present: bool) -> Body:
        """Add or remove the storage finalizer (finalizer.py); the run as it is now."""
        patch = finalizer.finalizer_patch(body, present)
        if patch is None:
            return body
        updated = self.state.kube.patch(body, patch)
        self.state.runs.put(updated)
        return updated

    def _finalize(self, body: Body) -> None:
        """A deleting run with the storage finalizer: its storage deleted if it still asks
        for that, then the finalizer removed, which lets the apiserver delete the run. A
        failure leaves the finalizer on and requeues the run."""
        if finalizer.deletes_storage(body):
            self.delete_storage(body)
        self._set_finalizer(body, present=False)

    def delete_storage(self, body: Body) -> int:
        """Delete every object under the run's storage URI (only with deleteOnRunDeletion)."""
        from posttrain.storage.store import open_store

        run = TrainingRun.model_validate(body)
        uri = names.run_storage_uri(run, self.state.config)
        store = open_store(uri, create_bucket=False)
        keys = store.list("")
        for key in keys:
            store.delete(key)
        self.state.emit(
            body,
            [
                EventSpec(
                    "Normal", Reason.STORAGE_DELETED, f"deleted {len(keys)} object(s) under {uri}"
                )
            ],
        )
        return len(keys)


def _controller_kind(obj: Body) -> str | None:
    """The kind of ``obj``'s controlling owner, if any.

    >>> _controller_kind({"metadata": {"ownerReferences": [{"kind": "RayCluster", "controller": True}]}})
    'RayCluster'
    """
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("kind"))
    return None
