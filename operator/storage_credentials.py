"""Each TrainingRun and RolloutPool gets object-storage credentials for its own prefixes
(posttrain/storage/iam.py); the store's root credentials stay in the operator's namespace.

With ``OperatorConfig.s3_scoped_credentials`` on, the first reconcile that builds an owner's
pods mints its user and policy and writes the keys into a Secret the owner owns
(``<run>-run-s3``, ``<pool>-pool-s3``); the owner's pods then reference that Secret where they
would reference the shared ``s3_credentials_secret``. A run may read and write its storage
prefix (checkpoints, trajectories, reports, weights) and read a run it resumes from; a pool
may read its namespace's runs (the weight versions it serves) and its ``sourceUri``. Every
resync revokes the users of owners that are gone (``collect``), in the namespaces this
operator watches only: operators of other namespaces may share the store.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, NoReturn

from posttrain.api import RolloutPool, TrainingRun
from posttrain.api.reasons import Reason
from posttrain.errors import UsageError
from posttrain.storage.errors import StorageError
from posttrain.storage.iam import Grant, ScopedCredentials

from .config import OperatorConfig
from .kube import KubeError
from .shared.builders import child_metadata
from .shared.requeue import RetryLater
from .shared.state import OperatorState
from .shared.views import EventSpec
from .trainingrun.names import resume_source_uri, run_storage_uri

log = logging.getLogger(__name__)

KIND_CREDENTIALS = "ScopedCredentials"  # the parent label of count_child's metric


def run_grants(run: TrainingRun, config: OperatorConfig) -> list[Grant]:
    """What a run's pods may touch: its own storage prefix (read-write; the object's, by uid),
    what spec.resumeFrom names (read), an ``s3://`` model (read) and, in ``sandbox.mode:
    task``, the sandbox logs of its namespace (read): the trainer reads each SandboxTask's
    output from ``status.logsUri`` with these keys. Sandbox artifacts are keyed by namespace
    (``<sandbox_artifacts_uri>/<ns>/<task>/...``); the task names are not known in advance,
    and the namespace is the boundary its SandboxTasks already share.

    >>> from posttrain.api import TrainingRun
    >>> run = TrainingRun.model_validate({"metadata": {"name": "demo", "namespace": "ns",
    ...     "uid": "u1"}, "spec": {"model": "m", "resumeFrom": {"run": "demo"}, "domains": [
    ...     {"name": "d", "dataset": "builtin:arithmetic", "verifier": {"kind": "numeric"}}]}})
    >>> run_grants(run, OperatorConfig(s3_bucket="b"))
    [Grant(bucket='b', prefix='runs/ns/demo/u1', write=True), Grant(bucket='b', prefix='runs/ns/demo', write=False)]
    >>> run.spec.sandbox.mode = "task"
    >>> run_grants(run, OperatorConfig(s3_bucket="b", sandbox_artifacts_uri="s3://art/sb/"))[-1]
    Grant(bucket='art', prefix='sb/ns', write=False)
    """
    grants = [Grant.for_uri(run_storage_uri(run, config), write=True)]
    source = resume_source_uri(run, config)
    if source is not None and source.startswith("s3://"):
        grants.append(Grant.for_uri(source, write=False))
    if run.spec.model.startswith("s3://"):
        grants.append(Grant.for_uri(run.spec.model, write=False))
    artifacts = config.sandbox_artifacts_uri
    if run.spec.sandbox.mode == "task" and artifacts:
        namespace = run.metadata.namespace
        grants.append(Grant.for_uri(f"{artifacts.rstrip('/')}/{namespace}", write=False))
    return grants


def pool_grants(pool: RolloutPool, config: OperatorConfig) -> list[Grant]:
    """What a pool's replicas may read: its namespace's runs, and its ``sourceUri``.

    >>> from posttrain.api import RolloutPool
    >>> pool = RolloutPool.model_validate({"metadata": {"name": "p", "namespace": "ns"},
    ...                                   "spec": {"model": "m"}})
    >>> pool_grants(pool, OperatorConfig(s3_bucket="b"))
    [Grant(bucket='b', prefix='runs/ns', write=False)]
    """
    grants = [Grant(config.s3_bucket, f"runs/{pool.metadata.namespace}", write=False)]
    source = pool.spec.weight_update.source_uri
    if source and source.startswith("s3://"):
        grants.append(Grant.for_uri(source, write=False))
    return grants


def credentials_secret(
    owner: TrainingRun | RolloutPool, suffix: str, access_key: str, secret_key: str
) -> dict[str, Any]:
    """The owner's Secret with its keys (the owner's pods reference it by name)."""
    from posttrain.api.env import S3_CREDENTIAL_KEYS

    access_name, secret_name = S3_CREDENTIAL_KEYS
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(owner, f"{owner.metadata.name}-{suffix}", {}),
        "type": "Opaque",
        "stringData": {access_name: access_key, secret_name: secret_key},
    }


class StorageCredentials:
    """Mints, hands out and revokes the scoped credentials of runs and pools."""

    def __init__(self, state: OperatorState, iam: ScopedCredentials | None = None) -> None:
        self.state = state
        self.enabled = state.config.s3_scoped_credentials and bool(state.config.s3_endpoint)
        self._iam = iam
        self._granted: set[str] = set()  # owner uids granted by this process
        self._lock = threading.Lock()

    @property
    def iam(self) -> ScopedCredentials:
        if self._iam is None:
            try:
                self._iam = ScopedCredentials.from_env()
            except UsageError as exc:  # the operator's own S3 settings are missing
                raise StorageError(
                    f"the operator cannot reach the store's admin API: {exc}"
                ) from None
        return self._iam

    def config_for_run(self, run: TrainingRun) -> OperatorConfig:
        """The config the run's builders use: its own credentials Secret when scoped."""
        if not self.enabled:
            return self.state.config
        secret = self._ensure(run, "run-s3", run_grants(run, self.state.config))
        return self.state.config.model_copy(update={"s3_credentials_secret": secret})

    def config_for_pool(self, pool: RolloutPool) -> OperatorConfig:
        if not self.enabled:
            return self.state.config
        secret = self._ensure(pool, "pool-s3", pool_grants(pool, self.state.config))
        return self.state.config.model_copy(update={"s3_credentials_secret": secret})

    def _ensure(self, owner: TrainingRun | RolloutPool, suffix: str, grants: list[Grant]) -> str:
        """The owner's Secret name, after its user and policy exist (once per process).

        The keys derive from the owner's uid and the operator's own secret key
        (:meth:`ScopedCredentials.keys_for`), so a restarted operator knows them without
        reading the Secret back: it may create Secrets, never read them."""
        uid = owner.metadata.uid
        if not uid:
            raise StorageError(f"{owner.kind} {owner.metadata.name} has no uid yet")
        name = f"{owner.metadata.name}-{suffix}"
        with self._lock:
            if uid in self._granted:
                return name
        access_key, secret_key = self.iam.keys_for(uid)
        manifest = credentials_secret(owner, suffix, access_key, secret_key)
        self.iam.grant(owner.metadata.namespace, uid, secret_key, grants)
        self.state.kube.create_if_absent(manifest)
        log.info(
            "%s %s/%s: scoped storage credentials %s for %s",
            owner.kind,
            owner.metadata.namespace,
            owner.metadata.name,
            access_key,
            ", ".join(f"s3://{g.bucket}/{g.prefix}/ ({'rw' if g.write else 'r'})" for g in grants),
        )
        with self._lock:
            self._granted.add(uid)
        return name

    def collect(self) -> list[str]:
        """Revoke the credentials of runs and pools that are gone; the uids revoked."""
        if not self.enabled:
            return []
        state = self.state
        cached = {
            str((body.get("metadata") or {}).get("uid"))
            for store in (state.runs, state.pools)
            for namespace, name in store.snapshot_keys()
            if (body := store.get(namespace, name) or {})
        }
        watched = state.config.watched_namespaces  # empty: every namespace
        listed: dict[str, set[str] | None] = {}  # namespace -> the apiserver's uids, once
        revoked = []
        for namespace, uid in self.iam.owners():
            if uid in cached or (watched and namespace not in watched):
                continue
            if namespace not in listed:
                listed[namespace] = self._live_uids(namespace)
            live = listed[namespace]
            if live is None or uid in live:
                continue
            self.iam.revoke(namespace, uid)
            with self._lock:
                self._granted.discard(uid)
            log.info(
                "revoked the scoped storage credentials of %s/%s (owner deleted)", namespace, uid
            )
            revoked.append(uid)
        return revoked

    def _live_uids(self, namespace: str) -> set[str] | None:
        """The uids of the runs and pools the apiserver has in ``namespace`` (the caches may
        lag a fresh object); None when it cannot say, and nothing is revoked."""
        from posttrain.api import API_VERSION

        uids: set[str] = set()
        for kind in ("TrainingRun", "RolloutPool"):
            try:
                listed = self.state.kube.list(API_VERSION, kind, namespace)
            except KubeError as exc:
                log.info("cannot list %s in %s to collect credentials: %s", kind, namespace, exc)
                return None
            uids.update(str((o.get("metadata") or {}).get("uid")) for o in listed)
        return uids

    def failed(self, body: dict[str, Any], exc: Exception) -> NoReturn:
        """Say on the object why its pods wait, and end its reconcile with a retry (the
        object is requeued with backoff)."""
        meta = body.get("metadata") or {}
        log.warning(
            "%s %s/%s: cannot mint scoped storage credentials: %s",
            body.get("kind"),
            meta.get("namespace"),
            meta.get("name"),
            exc,
        )
        message = f"cannot mint scoped storage credentials (retrying): {exc}"[:1000]
        self.state.emit(body, [EventSpec("Warning", Reason.STORAGE_CREDENTIALS_FAILED, message)])
        raise RetryLater(f"cannot mint scoped storage credentials: {exc}") from exc
