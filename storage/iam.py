"""Scoped object-storage credentials: one MinIO user and policy per owner (a TrainingRun, a
RolloutPool) that reach the owner's own prefixes and nothing else.

The operator holds the store's root credentials (in its own namespace); pods never get them.
For each owner it mints a user whose access key derives from the owner's uid, attaches a
policy naming exactly the owner's grants (read-write for a run's storage prefix, read-only
for a pool's), and hands the keys to the owner's pods through a Secret the owner owns. When
the owner is gone, :meth:`ScopedCredentials.revoke` removes user and policy, so the keys stop
working even if someone kept a copy. MinIO's admin API does this (``minio.MinioAdmin``);
stores without it (AWS S3: use IAM roles or STS) keep the shared Secret, with the operator's
``s3ScopedCredentials`` off.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.storage.errors import StorageError

POLICY_PREFIX = "posttrain-scoped."
"""Policies (and through them users) this module manages; nothing else is touched."""


@dataclass(frozen=True)
class Grant:
    """Access to everything under ``s3://bucket/prefix/``."""

    bucket: str
    prefix: str
    write: bool

    @classmethod
    def for_uri(cls, uri: str, *, write: bool) -> Grant:
        """
        >>> Grant.for_uri("s3://posttrain/runs/ns/demo/", write=True)
        Grant(bucket='posttrain', prefix='runs/ns/demo', write=True)
        """
        if not uri.startswith("s3://"):
            raise ValueError(f"scoped credentials need an s3:// URI, got {uri!r}")
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket or not prefix.strip("/"):
            raise ValueError(
                f"{uri!r} names no prefix inside a bucket: a grant would be the bucket"
            )
        return cls(bucket, prefix.strip("/"), write)


def policy_document(grants: Iterable[Grant]) -> dict[str, Any]:
    """An S3 policy allowing exactly ``grants`` (objects under each prefix, listing only there).

    >>> doc = policy_document([Grant("b", "runs/ns/a", True), Grant("b", "runs/ns/", False)])
    >>> [s["Action"] for s in doc["Statement"]][:2]
    [['s3:GetObject', 's3:PutObject', 's3:DeleteObject', 's3:AbortMultipartUpload', 's3:ListMultipartUploadParts'], ['s3:ListBucket']]
    >>> doc["Statement"][1]["Condition"]
    {'StringLike': {'s3:prefix': ['runs/ns/a/', 'runs/ns/a/*']}}
    >>> doc["Statement"][2]["Action"], doc["Statement"][2]["Resource"]
    (['s3:GetObject'], ['arn:aws:s3:::b/runs/ns/*'])
    """
    statements: list[dict[str, Any]] = []
    buckets = set()
    for grant in grants:
        grant = Grant(grant.bucket, grant.prefix.strip("/"), grant.write)
        buckets.add(grant.bucket)
        actions = ["s3:GetObject"]
        if grant.write:
            actions += [
                "s3:PutObject",
                "s3:DeleteObject",
                "s3:AbortMultipartUpload",
                "s3:ListMultipartUploadParts",
            ]
        statements.append(
            {
                "Effect": "Allow",
                "Action": actions,
                "Resource": [f"arn:aws:s3:::{grant.bucket}/{grant.prefix}/*"],
            }
        )
        statements.append(
            {
                "Effect": "Allow",
                "Action": ["s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{grant.bucket}"],
                "Condition": {
                    "StringLike": {"s3:prefix": [f"{grant.prefix}/", f"{grant.prefix}/*"]}
                },
            }
        )
    statements += [
        {"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": [f"arn:aws:s3:::{b}"]}
        for b in sorted(buckets)
    ]
    return {"Version": "2012-10-17", "Statement": statements}


def access_key_for(owner_uid: str) -> str:
    """The owner's access key: 20 characters (MinIO's limit), stable for its uid.

    >>> access_key_for("0f8e-uid"), len(access_key_for("x"))
    ('ptaf94a715bb27cf43ab', 20)
    """
    return "pt" + hashlib.sha256(owner_uid.encode()).hexdigest()[:18]


def policy_name(namespace: str, owner_uid: str) -> str:
    """
    >>> policy_name("ml", "1234-abcd")
    'posttrain-scoped.ml.1234-abcd'
    """
    return f"{POLICY_PREFIX}{namespace}.{owner_uid}"


class ScopedCredentials:
    """MinIO's admin API, with the root credentials of the process that holds them."""

    def __init__(
        self,
        admin: Any,
        root_secret: Callable[[], str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.admin = admin  # minio.MinioAdmin
        self._root_secret = root_secret
        self._env = env  # the root keys' environment (buckets are created with them)
        self._buckets: set[str] = set()

    def keys_for(self, owner_uid: str) -> tuple[str, str]:
        """The owner's (access key, secret key): a pure function of its uid and the root
        secret key, so whoever holds the root key can re-derive them and nobody else can.
        Rotating the root key changes them (the next grant sets the new ones)."""
        digest = hmac.new(
            self._root_secret().encode(), f"posttrain-scoped/{owner_uid}".encode(), "sha256"
        ).digest()
        return access_key_for(owner_uid), base64.urlsafe_b64encode(digest).decode().rstrip("=")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ScopedCredentials:
        """The admin client for the store ``posttrain.storage.store.s3_store_from_env`` opens
        (same endpoint, TLS and credentials settings)."""
        from minio.credentials.providers import StaticProvider
        from minio.minioadmin import MinioAdmin

        from posttrain.storage.store import s3_connection_from_env

        env = os.environ if env is None else env
        connection = s3_connection_from_env(env)
        credentials = connection.credentials or StaticProvider(
            connection.access_key or "", connection.secret_key or ""
        )
        admin = MinioAdmin(
            endpoint=connection.endpoint, credentials=credentials, secure=connection.secure
        )
        return cls(admin, lambda: credentials.retrieve().secret_key, dict(env))

    def grant(
        self, namespace: str, owner_uid: str, secret_key: str, grants: Iterable[Grant]
    ) -> str:
        """Create or update the owner's policy and user (idempotent); returns the access key."""
        access_key = access_key_for(owner_uid)
        name = policy_name(namespace, owner_uid)
        grants = list(grants)
        for bucket in sorted({g.bucket for g in grants if g.write}):
            self.ensure_bucket(bucket)  # scoped keys cannot create it
        try:
            self.admin.policy_add(name, policy=policy_document(grants))
            self.admin.user_add(access_key, secret_key)
            self.admin.attach_policy([name], user=access_key)
        except Exception as exc:
            if "already" in str(exc).lower() and "attached" in str(exc).lower():
                return access_key  # the policy was attached by an earlier grant
            raise StorageError(f"cannot grant scoped storage credentials {name}: {exc}") from exc
        return access_key

    def ensure_bucket(self, bucket: str) -> None:
        """Create ``bucket`` with the root keys if it is missing (once per process)."""
        if bucket in self._buckets:
            return
        from posttrain.storage.store import s3_store_from_env

        s3_store_from_env(bucket, env=self._env, create_bucket=True)
        self._buckets.add(bucket)

    def revoke(self, namespace: str, owner_uid: str) -> None:
        """Remove the owner's user and policy; already gone is fine."""
        removals: list[tuple[Callable[[], object], str]] = [
            (lambda: self.admin.user_remove(access_key_for(owner_uid)), "user"),
            (lambda: self.admin.policy_remove(policy_name(namespace, owner_uid)), "policy"),
        ]
        for remove, what in removals:
            try:
                remove()
            except Exception as exc:
                if not _not_found(exc):
                    raise StorageError(f"cannot revoke the {what} of {owner_uid}: {exc}") from exc

    def owners(self) -> list[tuple[str, str]]:
        """(namespace, owner uid) of every scoped policy in the store."""
        found = []
        for name in json.loads(self.admin.policy_list() or "{}"):
            if name.startswith(POLICY_PREFIX):
                namespace, _, uid = name[len(POLICY_PREFIX) :].partition(".")
                found.append((namespace, uid))
        return found


def _not_found(exc: Exception) -> bool:
    text = str(exc).lower()
    return "not found" in text or "does not exist" in text or "nosuch" in text
