"""Presigned S3 URLs for a sandbox attempt's log and snapshot (the operator signs, pods upload).

A sandbox pod gets no credentials: it PUTs its log (and snapshot) to URLs good for one object
each and GETs the snapshot it restores from one, all signed here with the operator's own
credentials.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

import urllib3
from minio.error import MinioException

from posttrain.api import SandboxTask
from posttrain.api.env import OPERATOR_SANDBOX_ARTIFACTS_URI
from posttrain.errors import UsageError

from ..config import OperatorConfig
from ..metrics import SANDBOX_ARTIFACT_URLS
from ..shared.builders import BuildError
from ..shared.sandbox_namespace import SandboxNamespaces
from . import builders

if TYPE_CHECKING:
    from posttrain.storage.store import S3Store

log = logging.getLogger(__name__)

# S3's longest presigned lifetime.
MAX_URL_SECONDS = 7 * 24 * 3600


class SandboxArtifactSigner:
    """Signs the URLs of sandbox_artifacts_uri; the bucket's store is opened on first use."""

    def __init__(self, config: OperatorConfig, namespaces: SandboxNamespaces) -> None:
        self.config = config
        self.namespaces = namespaces
        self._store: S3Store | None = None

    def _artifact_store(self) -> S3Store:
        """The S3 store of sandbox_artifacts_uri's bucket, opened once (with the operator's own
        credentials from its environment, like deleting a run's storage)."""
        if self._store is None:
            from posttrain.storage.store import s3_store_from_env

            bucket = self.config.sandbox_artifacts_uri[len("s3://") :].partition("/")[0]
            self._store = s3_store_from_env(bucket, create_bucket=True)
        return self._store

    def sign(self, task: SandboxTask, attempt: int) -> builders.SandboxArtifacts | None:
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
                raise BuildError(
                    "spec.snapshot / spec.restoreFrom need sandbox artifact storage, which this "
                    f"operator has not got: set {OPERATOR_SANDBOX_ARTIFACTS_URI} "
                    "(s3://bucket/prefix) or drop those fields"
                )
            return None
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        namespace_prefix = "/".join(p for p in (prefix.strip("/"), task.metadata.namespace) if p)
        if spec.restore_from and not spec.restore_from.startswith(
            f"s3://{bucket}/{namespace_prefix}/"
        ):
            raise BuildError(
                f"spec.restoreFrom {spec.restore_from!r} is not a sandbox snapshot of this "
                f"namespace; use a status.snapshotUri under s3://{bucket}/{namespace_prefix}/"
            )
        expires = timedelta(
            seconds=min(
                spec.timeout_seconds + self.config.sandbox_upload_grace_seconds + 3600,
                MAX_URL_SECONDS,
            )
        )
        self.namespaces.ensure_entrypoint(task.metadata.namespace)
        try:
            client = self._artifact_store().client
            logs_key = builders.sandbox_artifact_key(prefix, task, attempt, "logs.txt")
            artifacts = builders.SandboxArtifacts(
                logs_uri=f"s3://{bucket}/{logs_key}",
                logs_url=client.presigned_put_object(bucket, logs_key, expires=expires),
            )
            if spec.snapshot:
                key = builders.sandbox_artifact_key(prefix, task, attempt, "snapshot.tar")
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
