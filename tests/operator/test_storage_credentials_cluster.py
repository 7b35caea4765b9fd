"""Scoped storage credentials against the real apiserver and the real MinIO: a run's pods
get keys for the run's own prefix, a pool's for reading its namespace's runs, and deleting
the owner revokes them (posttrain/storage/iam.py, storage_credentials.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import Any

import pytest
from minio import Minio
from minio.error import S3Error

from posttrain.devenv.minio import MinioServer
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import cr_path, create_cr, run_body, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.minio]


@pytest.fixture
def scoped_operator(
    crds_installed: None,
    operator_config: OperatorConfig,
    minio_server: MinioServer,
    minio_env: dict[str, str],
    namespace: str,
) -> Iterator[tuple[OperatorThread, str]]:
    """The operator holding MinIO's root keys (its environment), minting scoped ones."""
    bucket = f"scoped-{namespace}"[:63]
    minio_server.client().make_bucket(bucket)
    config = operator_config.model_copy(
        update={
            "s3_endpoint": minio_server.endpoint,
            "s3_bucket": bucket,
            "s3_scoped_credentials": True,
        }
    )
    op = OperatorThread(config).start()
    yield op, bucket
    op.stop()


def keys_of(kube: KubeClient, namespace: str, secret: str) -> tuple[str, str]:
    body = wait_for(lambda: kube.get("v1", "Secret", namespace, secret), what=secret)
    data = body["data"]
    return tuple(  # type: ignore[return-value]
        base64.b64decode(data[k]).decode() for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    )


def client(server: MinioServer, keys: tuple[str, str]) -> Minio:
    return Minio(server.endpoint, access_key=keys[0], secret_key=keys[1], secure=False)


def denied(call: Any) -> str:
    try:
        call()
    except S3Error as exc:
        return exc.code
    return "allowed"


def test_runs_and_pools_reach_only_their_prefixes_and_lose_access_when_deleted(
    scoped_operator: tuple[OperatorThread, str],
    kube: KubeClient,
    namespace: str,
    minio_server: MinioServer,
) -> None:
    _, bucket = scoped_operator
    root = minio_server.client()
    root.put_object(bucket, f"runs/{namespace}/other/checkpoint", io.BytesIO(b"theirs"), 6)
    run = create_cr(kube, "trainingruns", namespace, run_body("mine"))
    keys = keys_of(kube, namespace, "mine-run-s3")
    assert keys[0] != minio_server.access_key
    secret = kube.get("v1", "Secret", namespace, "mine-run-s3")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "mine-g0-0"), what="trainer pod")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "mine-run-s3"

    # As the trainer opens its store (the bucket check included) with these keys.
    from posttrain.storage.errors import StorageAuthError
    from posttrain.storage.store import S3Store

    def store(prefix: str) -> S3Store:
        return S3Store(minio_server.endpoint, bucket, prefix, access_key=keys[0],
                       secret_key=keys[1], secure=False)  # fmt: skip

    uid = run["metadata"]["uid"]
    store(f"runs/{namespace}/mine/{uid}").put_bytes("probe", b"ok")  # the object's own prefix
    for elsewhere in (f"runs/{namespace}/other", f"runs/{namespace}/mine/an-earlier-uid"):
        with pytest.raises(StorageAuthError):
            store(elsewhere)
    mine = client(minio_server, keys)
    own = f"runs/{namespace}/mine/{uid}/checkpoint"
    mine.put_object(bucket, own, io.BytesIO(b"ours"), 4)
    assert mine.get_object(bucket, own).read() == b"ours"
    other = f"runs/{namespace}/other/checkpoint"
    assert denied(lambda: mine.get_object(bucket, other)) == "AccessDenied"
    assert denied(lambda: mine.put_object(bucket, other, io.BytesIO(b"x"), 1)) == "AccessDenied"
    assert denied(lambda: list(mine.list_objects(bucket, prefix="runs/", recursive=True))) == (
        "AccessDenied"
    )

    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "gen"},
            "spec": {"model": "m", "engine": "cpu"},
        },
    )
    pool = client(minio_server, keys_of(kube, namespace, "gen-pool-s3"))
    # The Secret is written just before its user is granted (the pool's pods wait for both).
    wait_for(lambda: denied(lambda: pool.get_object(bucket, own)) == "allowed", what="pool keys")
    assert pool.get_object(bucket, own).read() == b"ours"  # the weights it serves
    assert denied(lambda: pool.put_object(bucket, own, io.BytesIO(b"x"), 1)) == "AccessDenied"

    kube.request("DELETE", cr_path("trainingruns", namespace, "mine"))
    wait_for(
        lambda: denied(lambda: mine.get_object(bucket, own)) == "InvalidAccessKeyId",
        what="the deleted run's keys revoked",
        timeout_s=60,
    )
    assert pool.get_object(bucket, own).read() == b"ours"  # the pool's still work


def test_a_task_mode_runs_keys_read_its_namespaces_sandbox_logs_as_its_trainer_does(
    crds_installed: None,
    operator_config: OperatorConfig,
    minio_server: MinioServer,
    minio_env: dict[str, str],
    namespace: str,
    kube: KubeClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In sandbox.mode task the trainer reads each SandboxTask's output from status.logsUri
    with its own scoped keys (sandboxes/tasks.py, read_s3_text): they read the sandbox logs
    of the run's namespace, not another namespace's, and a run in another mode gets no such
    grant. Before, the keys had no grant there and the read checked the bucket with a HEAD
    the keys may not send: every execution of a task-mode run was "unavailable"."""
    from posttrain.sandboxes.tasks import read_s3_text
    from posttrain.storage.errors import StorageAuthError

    bucket = f"sblogs-{namespace}"[:63]
    root = minio_server.client()
    root.make_bucket(bucket)
    config = operator_config.model_copy(
        update={
            "s3_endpoint": minio_server.endpoint,
            "s3_bucket": bucket,
            "s3_scoped_credentials": True,
            "sandbox_artifacts_uri": f"s3://{bucket}/sandboxes",
        }
    )
    ours = f"sandboxes/{namespace}/tk-verify-0123/1/logs.txt"
    theirs = "sandboxes/elsewhere/tk-verify-0123/1/logs.txt"
    for key in (ours, theirs):
        root.put_object(bucket, key, io.BytesIO(b"all tests passed\n"), 17)
    op = OperatorThread(config).start()
    try:
        create_cr(kube, "trainingruns", namespace, run_body("tk", sandbox={"mode": "task"}))
        local = create_cr(
            kube, "trainingruns", namespace, run_body("lc", sandbox={"mode": "local"})
        )
        task_keys = keys_of(kube, namespace, "tk-run-s3")
        local_keys = keys_of(kube, namespace, "lc-run-s3")

        def read_as(keys: tuple[str, str], key: str) -> str:
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[0])
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[1])
            try:
                return read_s3_text(f"s3://{bucket}/{key}")
            except StorageAuthError as exc:
                return f"denied: {exc}"

        # The Secret is written just before its user is granted.
        wait_for(
            lambda: not read_as(task_keys, ours).startswith("denied"),
            what="the task-mode run's keys",
        )
        assert read_as(task_keys, ours) == "all tests passed\n"
        assert read_as(task_keys, theirs).startswith("denied"), "another namespace's logs"
        own = f"runs/{namespace}/lc/{local['metadata']['uid']}/probe.txt"
        root.put_object(bucket, own, io.BytesIO(b"ok"), 2)
        wait_for(lambda: read_as(local_keys, own) == "ok", what="the local-mode run's keys")
        assert read_as(local_keys, ours).startswith("denied"), "a run that creates no tasks"
    finally:
        op.stop()
