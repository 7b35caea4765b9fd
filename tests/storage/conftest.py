"""Fixtures for storage tests: a real MinIO server (no fakes) and a store per backend.

A missing MinIO binary is built (``tools/ensure-binaries.sh`` via ``go_binary``), never
skipped: storage is only tested against the real server.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.binaries import go_binary
from posttrain.devenv.minio import MinioServer
from posttrain.storage.retry import RetryPolicy
from posttrain.storage.store import ArtifactStore, LocalStore, S3Store

# Short backoff so tests that hit a dead endpoint finish in seconds.
FAST_RETRY = RetryPolicy(max_attempts=3, initial_delay_s=0.05, max_delay_s=0.2, max_elapsed_s=5)


@pytest.fixture
def minio_binary_path() -> Path:
    """The built MinIO binary (tests that run it with unusual flags, such as TLS)."""
    return go_binary("minio")


@pytest.fixture(scope="session")
def s3_server(minio_server: MinioServer) -> MinioServer:
    """The session MinIO; tests isolate themselves with a bucket each."""
    return minio_server


@pytest.fixture
def own_s3_server() -> Iterator[MinioServer]:
    """A MinIO this test may stop and restart (outage tests)."""
    server = MinioServer().start()
    yield server
    server.destroy()


def make_s3_store(
    server: MinioServer, bucket: str | None = None, prefix: str = "", **kwargs: Any
) -> S3Store:
    """An S3Store on ``server`` in a fresh bucket (unless one is named)."""
    return S3Store(
        server.endpoint,
        bucket or f"t-{uuid.uuid4().hex[:12]}",
        prefix,
        access_key=server.access_key,
        secret_key=server.secret_key,
        **kwargs,
    )


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return FAST_RETRY


@pytest.fixture
def s3_store_factory() -> Callable[..., S3Store]:
    """``make_s3_store`` for tests that need several stores or unusual options."""
    return make_s3_store


@pytest.fixture
def s3_store(s3_server: MinioServer) -> S3Store:
    return make_s3_store(s3_server, retry=FAST_RETRY)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.minio)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    """The same assertions run against LocalStore and S3Store on a real MinIO."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    # Small parts and ranges, several streams: multi-MiB test files exercise the parallel
    # multipart upload and the parallel ranged download (a 2-core default is one stream).
    return make_s3_store(
        server,
        retry=FAST_RETRY,
        part_size=5 * 1024 * 1024,
        download_range_size=5 * 1024 * 1024,
        download_streams=3,
    )


def _write_v1_directory(store: ArtifactStore, prefix: str, files: dict[str, bytes]) -> None:
    """Commit ``files`` exactly as posttrain wrote directories before manifest v2: sha256
    digests in a ``posttrain.manifest/v1`` manifest, built here by hand rather than by the
    code under test."""
    for rel, data in files.items():
        store.put_bytes(f"{prefix}/{rel}", data)
    body = {
        "format": "posttrain.manifest/v1",
        "created": "2026-11-30T12:00:00Z",
        "total_bytes": sum(map(len, files.values())),
        "metadata": {"step": 7},
        "files": [
            {"path": rel, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for rel, data in sorted(files.items())
        ],
    }
    store.put_bytes(f"{prefix}/manifest.json", json.dumps(body, indent=2, sort_keys=True).encode())


@pytest.fixture
def write_v1_directory() -> Callable[[ArtifactStore, str, dict[str, bytes]], None]:
    """Writes a directory as an older posttrain did (manifest v1, sha256)."""
    return _write_v1_directory
