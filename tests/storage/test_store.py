"""ArtifactStore semantics on LocalStore and on S3Store against a real MinIO server."""

from __future__ import annotations

import doctest
import hashlib
import importlib
import os
import ssl
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from prometheus_client import REGISTRY

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.process import free_port
from posttrain.errors import UsageError
from posttrain.storage.errors import (
    ArtifactNotFoundError,
    BucketNotFoundError,
    StorageAuthError,
    StorageError,
    StorageUnreachableError,
)
from posttrain.storage.progress import TransferProgress
from posttrain.storage.retry import RetryPolicy
from posttrain.storage.store import (
    ArtifactStore,
    Digest,
    LocalStore,
    S3Store,
    open_store,
    run_prefix,
)

FAST_RETRY = RetryPolicy(max_attempts=3, initial_delay_s=0.05, max_delay_s=0.2, max_elapsed_s=5)


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_128(data).hexdigest()


def test_every_operation_round_trips(store: ArtifactStore, tmp_path: Path) -> None:
    assert isinstance(store, ArtifactStore)
    digest = store.put_bytes("a/b/small.json", b'{"x": 1}')
    assert digest == Digest(8, _xxh(b'{"x": 1}'), "xxh3-128")
    assert store.get_bytes("a/b/small.json") == b'{"x": 1}'

    # Overwrite replaces the whole object.
    store.put_bytes("a/b/small.json", b"{}")
    assert store.get_bytes("a/b/small.json") == b"{}"

    # A 12 MiB file: on S3 this is a parallel multipart upload (5 MiB parts).
    payload = os.urandom(12 * 1024 * 1024 + 17)
    src = tmp_path / "big.bin"
    src.write_bytes(payload)
    up = store.put_file("a/big.bin", src)
    assert up == Digest(len(payload), _xxh(payload), "xxh3-128")
    out = tmp_path / "out" / "big.bin"
    down = store.get_file("a/big.bin", out)
    assert down == up
    assert out.read_bytes() == payload
    assert [p.name for p in out.parent.iterdir()] == ["big.bin"]  # no temp files left
    # sha256 on request (manifests written before xxh3-128 became the default).
    up_sha = store.put_file("a/big.bin", src, algorithm="sha256")
    assert up_sha == Digest(len(payload), hashlib.sha256(payload).hexdigest(), "sha256")
    assert store.get_file("a/big.bin", out, algorithm="sha256") == up_sha

    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert store.put_file("a/empty", empty).size == 0
    assert store.get_bytes("a/empty") == b""

    store.put_bytes("ab/other", b"1")
    store.put_bytes("z", b"2")
    assert store.exists("a/big.bin")
    assert not store.exists("a/nope")
    # String-prefix semantics, recursive, sorted; "a/" excludes "ab/".
    assert store.list("a/") == ["a/b/small.json", "a/big.bin", "a/empty"]
    assert store.list("a") == ["a/b/small.json", "a/big.bin", "a/empty", "ab/other"]
    assert store.list("a/b/sm") == ["a/b/small.json"]
    assert store.list() == ["a/b/small.json", "a/big.bin", "a/empty", "ab/other", "z"]
    assert store.list("nothing/") == []

    store.delete("a/big.bin")
    store.delete("a/big.bin")  # deleting a missing key is not an error, as in S3
    assert not store.exists("a/big.bin")
    with pytest.raises(ArtifactNotFoundError, match=r"a/big\.bin"):
        store.get_bytes("a/big.bin")
    with pytest.raises(ArtifactNotFoundError, match=r"a/big\.bin"):
        store.get_file("a/big.bin", tmp_path / "never")
    assert not (tmp_path / "never").exists()

    assert store.uri("a/empty").endswith("/a/empty")
    assert store.uri("a/empty").startswith(("s3://", "file:///"))
    with pytest.raises(ValueError, match="invalid storage key"):
        store.put_bytes("../escape", b"x")


@pytest.mark.minio
@pytest.mark.parametrize("streams", [1, 3])
def test_s3_large_download_single_stream_and_parallel_ranges_agree(
    s3_server: MinioServer, tmp_path: Path, streams: int
) -> None:
    """One streaming GET and parallel ranged GETs (written in order by one thread) give the
    same bytes, digest and progress count; a ragged last range is handled."""
    store = S3Store(
        s3_server.endpoint,
        f"t-{uuid.uuid4().hex[:12]}",
        access_key=s3_server.access_key,
        secret_key=s3_server.secret_key,
        retry=FAST_RETRY,
        download_range_size=4 * 1024 * 1024,
        download_streams=streams,
    )
    payload = os.urandom(13 * 1024 * 1024 + 5)
    (tmp_path / "src").write_bytes(payload)
    uploaded = store.put_file("big", tmp_path / "src")
    progress = TransferProgress("download", len(payload))
    out = tmp_path / "dst" / "big"
    assert store.get_file("big", out, progress=progress) == uploaded
    assert out.read_bytes() == payload and progress.done_bytes == len(payload)
    assert [p.name for p in out.parent.iterdir()] == ["big"]
    with pytest.raises(UsageError, match="download_streams must be >= 1"):
        S3Store(
            s3_server.endpoint, store.bucket, access_key="k", secret_key="s", download_streams=0
        )


def test_local_store_writes_atomically_and_hides_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    # A temp file a crashed writer left behind is not an object.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".x.tmp-deadbeef").write_bytes(b"partial")
    store.put_bytes("d/x", b"whole")
    assert store.list("d/") == ["d/x"]
    store.delete("d/x")
    assert store.list() == []


@pytest.mark.minio
def test_s3_prefixes_isolate_stores_in_one_bucket(
    s3_server: MinioServer, s3_store_factory: Callable[..., S3Store]
) -> None:
    make_s3_store = s3_store_factory
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    run_a = make_s3_store(s3_server, bucket, prefix="runs/ns/a")
    run_ab = make_s3_store(s3_server, bucket, prefix="runs/ns/ab")
    run_a.put_bytes("x", b"a")
    run_ab.put_bytes("x", b"ab")
    assert run_a.list() == ["x"] and run_ab.list() == ["x"]
    assert run_a.get_bytes("x") == b"a"
    assert run_a.uri("x") == f"s3://{bucket}/runs/ns/a/x"


@pytest.mark.minio
def test_s3_store_counts_uploaded_bytes(s3_store: S3Store) -> None:
    before = REGISTRY.get_sample_value("posttrain_storage_uploaded_bytes_total", {"store": "s3"})
    s3_store.put_bytes("m", b"12345")
    after = REGISTRY.get_sample_value("posttrain_storage_uploaded_bytes_total", {"store": "s3"})
    assert after == (before or 0) + 5


@pytest.mark.minio
def test_wrong_credentials_name_endpoint_and_bucket_but_never_the_secret(
    s3_server: MinioServer, tmp_path: Path
) -> None:
    secret = "definitely-not-the-secret-9f3a"
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    with pytest.raises(StorageAuthError) as info:
        S3Store(
            s3_server.endpoint,
            bucket,
            access_key=s3_server.access_key,
            secret_key=secret,
            retry=FAST_RETRY,
        )
    message = str(info.value)
    assert s3_server.endpoint in message and bucket in message
    assert secret not in message and secret not in repr(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__

    # Same through a mounted Secret directory: the error names the files to check.
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "accesskey").write_text("nobody\n")
    (creds / "secretkey").write_text(secret + "\n")
    env = {"POSTTRAIN_S3_ENDPOINT": s3_server.endpoint, "POSTTRAIN_S3_CREDENTIALS_DIR": str(creds)}
    with pytest.raises(StorageAuthError) as info:
        open_store(f"s3://{bucket}/runs", env=env, retry=FAST_RETRY)
    assert "POSTTRAIN_S3_CREDENTIALS_DIR" in str(info.value)
    assert secret not in str(info.value)


def test_unreachable_endpoint_fails_fast_and_names_it() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens here
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError) as info:
        S3Store(
            endpoint,
            "bucket",
            access_key="k",
            secret_key="secret-value-xyz",
            retry=RetryPolicy(max_attempts=3, initial_delay_s=0.05, max_elapsed_s=5),
        )
    assert time.monotonic() - started < 5
    assert endpoint in str(info.value) and "3 time(s)" in str(info.value)
    assert "secret-value-xyz" not in str(info.value)


@pytest.mark.minio
def test_missing_bucket_is_created_or_reported(
    s3_server: MinioServer, s3_store_factory: Callable[..., S3Store]
) -> None:
    make_s3_store = s3_store_factory
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    with pytest.raises(BucketNotFoundError, match=bucket):
        make_s3_store(s3_server, bucket, create_bucket=False)
    created = make_s3_store(s3_server, bucket)  # create_bucket defaults to True
    assert created.client.bucket_exists(bucket)
    make_s3_store(s3_server, bucket)  # already there: fine


@pytest.mark.minio
def test_open_store_reads_endpoint_and_credentials_from_env(
    s3_server: MinioServer, tmp_path: Path
) -> None:
    bucket = f"t-{uuid.uuid4().hex[:12]}"
    store = open_store(f"s3://{bucket}/runs/ns/a", env=s3_server.env())
    assert isinstance(store, S3Store) and store.prefix == "runs/ns/a" and not store.secure
    store.put_bytes("k", b"v")

    creds = tmp_path / "secret"
    creds.mkdir()
    (creds / "accesskey").write_text(s3_server.access_key)
    (creds / "secretkey").write_text(s3_server.secret_key)
    env = {
        "POSTTRAIN_S3_ENDPOINT": f"http://{s3_server.endpoint}",
        "POSTTRAIN_S3_CREDENTIALS_DIR": str(creds),
    }
    again = open_store(f"s3://{bucket}/runs/ns/a", env=env)
    assert again.get_bytes("k") == b"v"


def test_open_store_local_uris_and_usage_errors(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "plain")), LocalStore)
    local = open_store(f"file://{tmp_path}/uri")
    assert isinstance(local, LocalStore) and local.root == tmp_path / "uri"
    with pytest.raises(UsageError, match="absolute"):
        open_store("file://relative/dir")
    with pytest.raises(UsageError, match="unsupported scheme"):
        open_store("gs://bucket")
    with pytest.raises(UsageError, match="POSTTRAIN_S3_ENDPOINT"):
        open_store("s3://bucket", env={})
    with pytest.raises(UsageError, match="no bucket"):
        open_store("s3:///x", env={})
    with pytest.raises(UsageError, match="AWS_ACCESS_KEY_ID"):
        open_store("s3://bucket", env={"POSTTRAIN_S3_ENDPOINT": "127.0.0.1:1"})
    with pytest.raises(UsageError, match="accesskey"):
        open_store(
            "s3://b",
            env={
                "POSTTRAIN_S3_ENDPOINT": "127.0.0.1:1",
                "POSTTRAIN_S3_CREDENTIALS_DIR": str(tmp_path / "none"),
            },
        )
    with pytest.raises(UsageError, match="bucket name 'B' is not valid"):
        open_store(
            "s3://B/x",
            env={
                "POSTTRAIN_S3_ENDPOINT": "h:1",
                "AWS_ACCESS_KEY_ID": "k",
                "AWS_SECRET_ACCESS_KEY": "s",
            },
        )
    with pytest.raises(UsageError, match="POSTTRAIN_S3_SECURE"):
        open_store("s3://b", env={"POSTTRAIN_S3_ENDPOINT": "h:1", "POSTTRAIN_S3_SECURE": "maybe"})


def test_run_prefix() -> None:
    assert run_prefix("team-a", "grpo-1") == "runs/team-a/grpo-1"
    with pytest.raises(UsageError, match="Kubernetes name"):
        run_prefix("team-a", "../x")


@pytest.mark.parametrize(
    "module",
    [
        "store",
        "retry",
        "progress",
        "commit",
        "checkpoints",
        "trajectories",
        "checksums",
        "blocks",
        "iam",
    ],
)
def test_docstring_examples(module: str) -> None:
    """The worked examples in the helpers' docstrings are true."""
    result = doctest.testmod(importlib.import_module(f"posttrain.storage.{module}"))
    assert result.failed == 0 and (result.attempted > 0 or module == "retry")


@pytest.mark.minio
def test_tls_with_a_private_ca_bundle(tmp_path: Path, minio_binary_path: Path) -> None:
    """MinIO serving HTTPS with a private CA: trusted via the CA bundle, refused without it."""
    from posttrain.devenv.certs import make_pki
    from posttrain.devenv.process import ManagedProcess, http_ok

    pki = make_pki(tmp_path / "pki")
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "public.crt").write_bytes(pki.serving_cert.read_bytes())
    (certs / "private.key").write_bytes(pki.serving_key.read_bytes())
    endpoint = f"127.0.0.1:{free_port()}"
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    server = ManagedProcess(
        name="minio-tls",
        command=[
            str(minio_binary_path),
            "server",
            str(tmp_path / "data"),
            "--address",
            endpoint,
            "--console-address",
            f"127.0.0.1:{free_port()}",
            "--certs-dir",
            str(certs),
            "--quiet",
        ],
        log_path=tmp_path / "minio.log",
        ready=lambda: http_ok(f"https://{endpoint}/minio/health/ready", context),
        env={
            "MINIO_ROOT_USER": "tlsuser",
            "MINIO_ROOT_PASSWORD": "tls-secret-123",
            "MINIO_BROWSER": "off",
        },
    )
    server.start(60)
    try:
        env = {
            "POSTTRAIN_S3_ENDPOINT": endpoint,
            "POSTTRAIN_S3_SECURE": "true",
            "POSTTRAIN_S3_CA_BUNDLE": str(pki.ca_cert),
            "AWS_ACCESS_KEY_ID": "tlsuser",
            "AWS_SECRET_ACCESS_KEY": "tls-secret-123",
        }
        store = open_store("s3://tls-bucket/runs", env=env)
        assert isinstance(store, S3Store) and store.secure
        store.put_bytes("k", b"over tls")
        assert store.get_bytes("k") == b"over tls"

        without_ca = {k: v for k, v in env.items() if k != "POSTTRAIN_S3_CA_BUNDLE"}
        started = time.monotonic()
        with pytest.raises(StorageError, match="POSTTRAIN_S3_CA_BUNDLE") as info:
            open_store("s3://tls-bucket/runs", env=without_ca)
        assert endpoint in str(info.value) and "tls-secret-123" not in str(info.value)
        assert time.monotonic() - started < 5  # not retried: a bad certificate stays bad
    finally:
        server.stop()


def test_emptying_minios_trash_frees_deleted_objects_and_keeps_live_ones(
    s3_server: MinioServer,
) -> None:
    """Deleted objects wait in MinIO's trash; the suite empties it between modules."""
    store = S3Store(s3_server.endpoint, f"t-{uuid.uuid4().hex[:12]}",
                    access_key=s3_server.access_key, secret_key=s3_server.secret_key)  # fmt: skip
    store.put_bytes("gone", os.urandom(3 << 20))
    store.put_bytes("kept", b"still here")
    store.delete("gone")
    assert s3_server.empty_trash() >= 3 << 20
    assert store.get_bytes("kept") == b"still here"
