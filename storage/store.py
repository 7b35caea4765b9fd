"""Artifact stores: one small interface over MinIO/S3 and over a local directory.

Everything durable in a run (checkpoints, published weights, trajectories, eval reports)
goes through :class:`ArtifactStore`, so the same code runs against MinIO in a cluster and
against a plain directory on a laptop or in tests. Both implementations share the
semantics the higher layers rely on:

* a put is atomic: readers see the old object, or the whole new one, never a prefix of it
  (S3 guarantees this per object; :class:`LocalStore` writes a temp file and renames);
* ``list(prefix)`` is a plain string-prefix match over keys, recursive, sorted;
* deleting a missing key is not an error (as in S3);
* ``put_file``/``get_file`` return the size and checksum (xxh3-128 by default, sha256 on
  request; see :mod:`~posttrain.storage.checksums`) of the bytes that went through, hashed
  while they stream, so callers get checksums without a second pass over multi-GB files.

Only :class:`S3Store` talks to a network; its calls retry transient failures with bounded
exponential backoff (:class:`~posttrain.storage.retry.RetryPolicy`) and turn the rest into
errors that name the endpoint and bucket and never contain the secret key.
"""

from __future__ import annotations

import copy
import io
import logging
import mimetypes
import os
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar, cast, runtime_checkable
from urllib.parse import urlsplit

import certifi
import urllib3
from minio import Minio
from minio.credentials.credentials import Credentials
from minio.credentials.providers import Provider, StaticProvider
from minio.error import InvalidResponseError, S3Error, ServerError

from posttrain.api.env import S3_CA_BUNDLE, S3_CREDENTIALS_DIR, S3_ENDPOINT, S3_REGION, S3_SECURE
from posttrain.errors import UsageError
from posttrain.storage.checksums import DEFAULT_CHECKSUM, StreamHasher, checksum
from posttrain.storage.errors import (
    ArtifactNotFoundError,
    BucketNotFoundError,
    StorageAuthError,
    StorageError,
    StorageUnreachableError,
)
from posttrain.storage.metrics import (
    BYTES_DOWNLOADED,
    BYTES_UPLOADED,
    DOWNLOAD_SECONDS,
    UPLOAD_SECONDS,
)
from posttrain.storage.progress import HashingReader, TransferProgress
from posttrain.storage.retry import RetryPolicy, call_with_retry, short_error

log = logging.getLogger(__name__)
T = TypeVar("T")

# Multipart settings for large files: 16 MiB parts, 4 in flight (64 MiB of buffers per file).
DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_PARALLEL_PARTS = 4
# Downloads of objects larger than this are split into ranges of this size, fetched in parallel
# when the store uses more than one download stream.
DEFAULT_RANGE_SIZE = 32 * 1024 * 1024
_COPY_CHUNK = 4 * 1024 * 1024
_STREAM_CHUNK = 1024 * 1024
# Temp files LocalStore writes before renaming; never listed as keys.
_TMP_MARKER = ".tmp-"

# S3 error codes that mean "try again later" rather than "you asked for something wrong".
_TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "XMinioServerNotInitialized",
        "ServerNotInitialized",
        "XMinioReadQuorum",
        "XMinioWriteQuorum",
        "OperationTimedOut",
    }
)
_AUTH_S3_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "AuthorizationHeaderMalformed",
        "AllAccessDisabled",
    }
)


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


@dataclass(frozen=True)
class Digest:
    """Size and checksum (hex digest of ``algorithm``) of the bytes one transfer moved."""

    size: int
    checksum: str
    algorithm: str = DEFAULT_CHECKSUM


@runtime_checkable
class ArtifactStore(Protocol):
    """Keys are relative, ``/``-separated paths like ``runs/ns/name/checkpoints/latest.json``."""

    def put_bytes(self, key: str, data: bytes) -> Digest: ...

    def get_bytes(self, key: str) -> bytes: ...

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest: ...

    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest: ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object from ``offset`` (fewer only past its end).

        For readers that need part of a large object (one rank's slices of a sharded
        checkpoint); the caller verifies what it reads (block digests), the store does not.
        """
        ...

    def stream(self, key: str) -> Iterator[bytes]:
        """The whole object's bytes in order, as they arrive, without a local copy.

        For readers that consume an object once, front to back (a rollout replica streaming
        a weight version into its engine); the caller hashes what it reads against the
        manifest, the store does not. Raises :class:`ArtifactNotFoundError` when there is no
        such object; closing the iterator early cancels what is still in flight.
        """
        ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def uri(self, key: str = "") -> str: ...

    def with_retry(self, policy: RetryPolicy) -> ArtifactStore:
        """The same store with another retry policy (a no-op for local directories)."""
        ...


def check_key(key: str) -> str:
    """Validate an object key and return it; keys never escape their store.

    >>> check_key("checkpoints/step-00000012/model.safetensors")
    'checkpoints/step-00000012/model.safetensors'
    >>> check_key("../etc/passwd")
    Traceback (most recent call last):
    ...
    ValueError: invalid storage key '../etc/passwd': use a relative path of non-empty parts, no '.' or '..'
    """
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"invalid storage key {key!r}: use a relative path of non-empty parts, no '.' or '..'"
        )
    return key


def join_key(*parts: str) -> str:
    """Join key fragments with single slashes, skipping empty ones.

    >>> join_key("runs/ns/a/", "/checkpoints", "", "latest.json")
    'runs/ns/a/checkpoints/latest.json'
    """
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def run_prefix(namespace: str, name: str) -> str:
    """Where every TrainingRun object of this name keeps its artifacts inside the bucket, each
    below its own ``<uid>/`` (the operator's default storage; see docs/storage.md).

    >>> run_prefix("team-a", "grpo-math-1")
    'runs/team-a/grpo-math-1'
    """
    for what, value in (("namespace", namespace), ("run name", name)):
        if not _NAME_RE.match(value):
            raise UsageError(
                f"{what} {value!r} is not a Kubernetes name (lower-case letters, digits, '-', '.'); "
                "use the TrainingRun's metadata.namespace and metadata.name"
            )
    return f"runs/{namespace}/{name}"


# --------------------------------------------------------------------------- local


class LocalStore:
    """An :class:`ArtifactStore` in a local (or NFS/PVC-mounted) directory.

    Writes go to a temp file in the destination directory, are fsynced, then renamed over
    the key, so a crash never leaves a half-written object under a real key.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_bytes(self, key: str, data: bytes) -> Digest:
        return self._write_atomic(
            self._path(key), io.BytesIO(data), None, "bytes", DEFAULT_CHECKSUM
        )

    def get_bytes(self, key: str) -> bytes:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFoundError(f"no object at {self.uri(key)}") from None
        BYTES_DOWNLOADED.labels(store="local").inc(len(data))
        return data

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest:
        with open(path, "rb") as src:
            return self._write_atomic(self._path(key), src, progress, "file", algorithm)

    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest:
        start = time.monotonic()
        try:
            src = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFoundError(f"no object at {self.uri(key)}") from None
        with src:
            digest = _write_chunks_atomic(
                _read_chunks(src), Path(path), progress, fsync=False, algorithm=algorithm
            )
        BYTES_DOWNLOADED.labels(store="local").inc(digest.size)
        DOWNLOAD_SECONDS.labels(kind="file").observe(time.monotonic() - start)
        return digest

    def stream(self, key: str) -> Iterator[bytes]:
        try:
            src = open(self._path(key), "rb")  # noqa: SIM115 - closed by the generator
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFoundError(f"no object at {self.uri(key)}") from None
        return self._stream_open(src)

    @staticmethod
    def _stream_open(src: BinaryIO) -> Iterator[bytes]:
        with src:
            for chunk in _read_chunks(src):
                BYTES_DOWNLOADED.labels(store="local").inc(len(chunk))
                yield chunk

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            src = open(self._path(key), "rb")  # noqa: SIM115 - closed below
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ArtifactNotFoundError(f"no object at {self.uri(key)}") from None
        with src:
            src.seek(offset)
            data = src.read(length)
        BYTES_DOWNLOADED.labels(store="local").inc(len(data))
        return data

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        # Walk only the deepest directory the prefix fully names, then string-match the rest.
        base_dir = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / base_dir if base_dir else self.root
        keys: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(start):
            for filename in filenames:
                if _TMP_MARKER in filename:
                    continue
                key = Path(dirpath, filename).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        # Tidy empty parent directories so listings and `ls` match the S3 view.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def uri(self, key: str = "") -> str:
        return f"file://{self.root}/{key}" if key else f"file://{self.root}"

    def with_retry(self, policy: RetryPolicy) -> LocalStore:
        return self

    def _write_atomic(
        self,
        dest: Path,
        src: _Readable,
        progress: TransferProgress | None,
        kind: str,
        algorithm: str,
    ) -> Digest:
        start = time.monotonic()
        digest = _write_chunks_atomic(
            _read_chunks(src), dest, progress, fsync=True, algorithm=algorithm
        )
        BYTES_UPLOADED.labels(store="local").inc(digest.size)
        UPLOAD_SECONDS.labels(kind=kind).observe(time.monotonic() - start)
        return digest


def _read_chunks(src: _Readable, size: int = _COPY_CHUNK) -> Iterator[bytes]:
    """``src`` as a stream of chunks of at most ``size`` bytes."""
    while chunk := src.read(size):
        yield chunk


def _write_chunks_atomic(
    chunks: Iterable[bytes],
    dest: Path,
    progress: TransferProgress | None,
    *,
    fsync: bool,
    algorithm: str = DEFAULT_CHECKSUM,
) -> Digest:
    """Write ``chunks`` into ``dest`` via a sibling temp file + rename, hashing on the way.

    One thread writes sequentially and hashes each chunk as it passes: a single pass over
    the bytes and one writer per file (parallel ``pwrite``s into one file plus an mmap
    re-read, as an earlier version did, cost more CPU and varied more; docs/storage.md).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}{_TMP_MARKER}{uuid.uuid4().hex[:12]}")
    hasher = StreamHasher(algorithm)
    size = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for chunk in chunks:
                _write_all(fd, chunk)
                hasher.update(chunk)
                size += len(chunk)
                if progress is not None:
                    progress.update(len(chunk))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        digest = hasher.hexdigest()
        os.replace(tmp, dest)
        if fsync:
            fsync_dir(dest.parent)
    finally:
        hasher.close()
        tmp.unlink(missing_ok=True)
    return Digest(size=size, checksum=digest, algorithm=algorithm)


def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until all of ``data`` is written (a write may be partial)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    """Make a rename durable: the directory entry lives in the parent's metadata."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- S3


class SecretDirCredentials(Provider):
    """Credentials read from a mounted Kubernetes Secret (files ``accesskey`` and ``secretkey``).

    Re-read every ``refresh_s`` seconds, so a rotated Secret takes effect without a restart.
    """

    def __init__(self, directory: str | os.PathLike[str], refresh_s: float = 30.0) -> None:
        self.directory = Path(directory)
        self._refresh_s = refresh_s
        self._cached: Credentials | None = None
        self._read_at = 0.0
        self.retrieve()  # fail at construction time, not on the first upload

    def retrieve(self) -> Credentials:
        now = time.monotonic()
        if self._cached is None or now - self._read_at > self._refresh_s:
            self._cached = Credentials(self._read("accesskey"), self._read("secretkey"))
            self._read_at = now
        return self._cached

    def _read(self, name: str) -> str:
        path = self.directory / name
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise UsageError(
                f"cannot read S3 credential file {path} ({exc.strerror}); "
                f"{S3_CREDENTIALS_DIR} must hold files 'accesskey' and 'secretkey' "
                "(mount the MinIO credentials Secret there)"
            ) from None
        if not value:
            raise UsageError(f"S3 credential file {path} is empty")
        return value


class S3Store:
    """An :class:`ArtifactStore` in one bucket (under an optional key prefix) of MinIO/S3.

    Construction checks the bucket (creating it when ``create_bucket``), so a wrong endpoint,
    wrong credentials or a missing bucket fail at start-up with a message that names them,
    not at the first checkpoint an hour later.
    """

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        prefix: str = "",
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        credentials: Provider | None = None,
        secure: bool = False,
        ca_bundle: str | None = None,
        region: str | None = None,
        retry: RetryPolicy | None = None,
        create_bucket: bool = True,
        part_size: int = DEFAULT_PART_SIZE,
        parallel_parts: int = DEFAULT_PARALLEL_PARTS,
        download_range_size: int = DEFAULT_RANGE_SIZE,
        download_streams: int | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise UsageError(
                f"bucket name {bucket!r} is not valid for S3: use 3-63 lower-case letters, "
                "digits, '.' and '-', starting and ending with a letter or digit"
            )
        if credentials is None:
            if not access_key or not secret_key:
                raise UsageError(
                    f"no credentials for S3 endpoint {endpoint}: pass access_key and secret_key, "
                    f"or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or {S3_CREDENTIALS_DIR}"
                )
            credentials = StaticProvider(access_key, secret_key)
        self.endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.secure = secure
        self._provider = credentials
        self._retry = retry or RetryPolicy()
        self._part_size = part_size
        self._parallel_parts = parallel_parts
        self._range_size = download_range_size
        # Parallel ranged GETs per large download; None picks by CPU count (1 on small hosts).
        self._download_streams = (
            default_download_streams() if download_streams is None else download_streams
        )
        if self._download_streams < 1:
            raise UsageError(f"download_streams must be >= 1, got {download_streams}")
        # Retries live in our layer (bounded, logged, counted), so urllib3's are switched off.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=connect_timeout_s, read=read_timeout_s),
            maxsize=32,
            cert_reqs="CERT_REQUIRED",
            ca_certs=ca_bundle or os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=False,
        )
        self._client = Minio(
            endpoint, credentials=credentials, secure=secure, region=region, http_client=http
        )
        self._ensure_bucket(create_bucket)

    def __repr__(self) -> str:
        return f"S3Store({self.uri()!r} at {self.endpoint})"

    @property
    def download_streams(self) -> int:
        """Parallel ranged GETs per large download (1: one streaming GET)."""
        return self._download_streams

    @property
    def client(self) -> Minio:
        """The underlying minio client (the benchmark uses it as the raw baseline)."""
        return self._client

    def with_retry(self, policy: RetryPolicy) -> S3Store:
        clone = copy.copy(self)  # shares the client and its connection pool
        clone._retry = policy
        return clone

    def _name(self, key: str) -> str:
        return join_key(self.prefix, check_key(key))

    def uri(self, key: str = "") -> str:
        return "s3://" + join_key(self.bucket, self.prefix, key)

    # -- operations

    def put_bytes(self, key: str, data: bytes) -> Digest:
        name = self._name(key)
        start = time.monotonic()
        self._call(
            "put",
            key,
            lambda: self._client.put_object(
                self.bucket, name, io.BytesIO(data), len(data), content_type=_content_type(key)
            ),
        )
        BYTES_UPLOADED.labels(store="s3").inc(len(data))
        UPLOAD_SECONDS.labels(kind="bytes").observe(time.monotonic() - start)
        return Digest(size=len(data), checksum=checksum(data))

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """The object's bytes as they arrive, one streaming GET (datasets read line by line
        without holding the whole file). Opening is retried; a failure mid-stream raises."""
        name = self._name(key)
        response = self._call("get", key, lambda: self._client.get_object(self.bucket, name))
        try:
            for chunk in response.stream(chunk_size):
                BYTES_DOWNLOADED.labels(store="s3").inc(len(chunk))
                yield chunk
        finally:
            response.close()
            response.release_conn()

    def get_bytes(self, key: str) -> bytes:
        return self._read_object(key, 0, 0)

    def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest:
        name = self._name(key)
        size = os.path.getsize(path)
        start = time.monotonic()

        def attempt() -> Digest:
            with open(path, "rb") as fh:
                reader = HashingReader(fh, progress, algorithm)
                try:
                    self._client.put_object(
                        self.bucket,
                        name,
                        cast(BinaryIO, reader),  # file-like: read() is all put_object uses
                        size,
                        content_type=_content_type(key),
                        part_size=self._part_size,
                        num_parallel_uploads=self._parallel_parts,
                    )
                except BaseException:
                    if progress is not None:
                        progress.update(-reader.size)  # this attempt's bytes will be re-sent
                    raise
            return Digest(reader.size, reader.hasher.hexdigest(), algorithm)

        digest = self._call("put", key, attempt)
        BYTES_UPLOADED.labels(store="s3").inc(digest.size)
        UPLOAD_SECONDS.labels(kind="file").observe(time.monotonic() - start)
        return digest

    def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> Digest:
        """Download to ``path`` atomically, hashing while the bytes stream in.

        With more than one download stream, objects over ``download_range_size`` are
        fetched as parallel ranged GETs (like multipart uploads in reverse) and written in
        order by this thread.
        """
        name = self._name(key)
        dest = Path(path)
        start = time.monotonic()
        stat = self._call("stat", key, lambda: self._client.stat_object(self.bucket, name))
        size = int(stat.size or 0)
        if self._ranged(size):
            chunks = self._ranged_chunks(key, name, str(stat.etag or ""), size)
            try:
                digest = _write_chunks_atomic(
                    chunks, dest, progress, fsync=False, algorithm=algorithm
                )
            finally:
                chunks.close()  # cancels ranges still queued if writing failed
        else:
            digest = self._call(
                "get", key, lambda: self._get_stream(name, dest, progress, algorithm)
            )
        BYTES_DOWNLOADED.labels(store="s3").inc(digest.size)
        DOWNLOAD_SECONDS.labels(kind="file").observe(time.monotonic() - start)
        return digest

    def _ranged(self, size: int) -> bool:
        """Whether an object of ``size`` bytes is read as parallel ranged GETs."""
        return size > self._range_size and self._download_streams > 1

    def stream(self, key: str) -> Iterator[bytes]:
        """The object's bytes in order: parallel ranged GETs above ``download_range_size``
        (as :meth:`get_file` downloads, memory bounded the same way), else one GET."""
        name = self._name(key)
        stat = self._call("stat", key, lambda: self._client.stat_object(self.bucket, name))
        size = int(stat.size or 0)
        if self._ranged(size):
            return self._counted(self._ranged_chunks(key, name, str(stat.etag or ""), size))
        return self.iter_chunks(key, _STREAM_CHUNK)

    @staticmethod
    def _counted(chunks: Generator[bytes, None, None]) -> Iterator[bytes]:
        try:
            for chunk in chunks:
                BYTES_DOWNLOADED.labels(store="s3").inc(len(chunk))
                yield chunk
        finally:
            chunks.close()  # cancels ranges still queued when the reader stops early

    def _get_stream(
        self, name: str, dest: Path, progress: TransferProgress | None, algorithm: str
    ) -> Digest:
        """One GET streamed to a temp file and renamed into place."""
        response = self._client.get_object(self.bucket, name)
        tracker = _RewindingProgress(progress)
        try:
            # urllib3's stream() is markedly faster than read(n) loops for large bodies.
            return _write_chunks_atomic(
                response.stream(_STREAM_CHUNK),
                dest,
                tracker,  # type: ignore[arg-type]
                fsync=False,
                algorithm=algorithm,
            )
        except BaseException:
            tracker.rewind()
            raise
        finally:
            response.close()
            response.release_conn()

    def _ranged_chunks(
        self, key: str, name: str, etag: str, size: int
    ) -> Generator[bytes, None, None]:
        """The object's bytes in order, fetched as parallel ranged GETs.

        At most ``download_streams`` ranges are in flight or waiting to be consumed, so
        memory stays bounded at ``(download_streams + 1) * download_range_size``. Each range
        retries on its own. ``If-Match`` pins every range to the object version that was
        stat'ed, so an overwrite mid-download fails instead of mixing versions.
        """
        ranges = deque(
            (offset, min(self._range_size, size - offset))
            for offset in range(0, size, self._range_size)
        )
        headers: dict[str, str | list[str] | tuple[str]] | None = (
            {"If-Match": f'"{etag}"'} if etag else None
        )

        def attempt(offset: int, length: int) -> list[bytes]:
            response = self._client.get_object(
                self.bucket, name, offset=offset, length=length, request_headers=headers
            )
            try:
                chunks = list(response.stream(_STREAM_CHUNK))
            finally:
                response.close()
                response.release_conn()
            received = sum(len(chunk) for chunk in chunks)
            if received != length:  # connection cut short: retry the range
                raise urllib3.exceptions.ProtocolError(
                    f"range {offset}+{length} ended after {received} bytes"
                )
            return chunks

        def fetch(offset: int, length: int) -> list[bytes]:
            return self._call("get", key, lambda: attempt(offset, length))

        pending: deque[Future[list[bytes]]] = deque()
        with ThreadPoolExecutor(max_workers=self._download_streams) as pool:

            def top_up() -> None:
                while ranges and len(pending) < self._download_streams:
                    pending.append(pool.submit(fetch, *ranges.popleft()))

            try:
                top_up()
                while pending:
                    chunks = pending.popleft().result()
                    top_up()  # keep every stream busy while this range is written
                    yield from chunks
                    del chunks  # free the range before waiting for the next one
            finally:
                for future in pending:
                    future.cancel()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self._read_object(key, offset, length)

    def _read_object(self, key: str, offset: int, length: int) -> bytes:
        """One GET into memory: the whole object when ``length`` is 0, else a range."""
        name = self._name(key)

        def attempt() -> bytes:
            try:
                response = self._client.get_object(self.bucket, name, offset=offset, length=length)
            except S3Error as exc:
                if exc.code == "InvalidRange":  # wholly past the end (a truncated object)
                    return b""
                raise
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        data = self._call("get", key, attempt)
        BYTES_DOWNLOADED.labels(store="s3").inc(len(data))
        return data

    def exists(self, key: str) -> bool:
        name = self._name(key)

        def attempt() -> bool:
            try:
                self._client.stat_object(self.bucket, name)
            except S3Error as exc:
                if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                    return False
                raise
            return True

        return self._call("stat", key, attempt)

    def list(self, prefix: str = "") -> list[str]:
        full = join_key(self.prefix, prefix)
        # join_key drops a trailing slash; keep "dir/" meaning "inside dir" (and the store prefix).
        if full and (prefix.endswith("/") or not prefix):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def attempt() -> list[str]:
            objects = self._client.list_objects(self.bucket, prefix=full or None, recursive=True)
            return sorted(obj.object_name[strip:] for obj in objects if obj.object_name)

        return self._call("list", prefix, attempt)

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call("delete", key, lambda: self._client.remove_object(self.bucket, name))

    # -- plumbing

    def _bucket_exists(self) -> bool:
        """Whether the bucket exists, asked as narrowly as the store works: credentials scoped
        to a prefix (storage/iam.py) may list under it but not HEAD the bucket."""
        if not self.prefix:
            return bool(self._client.bucket_exists(self.bucket))
        try:
            listing = self._client.list_objects(self.bucket, prefix=f"{self.prefix}/")
            next(iter(listing), None)
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                return False
            raise
        return True

    def _ensure_bucket(self, create: bool) -> None:
        if self._call("check-bucket", "", self._bucket_exists):
            return
        if not create:
            raise BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist at S3 endpoint {self.endpoint}; create "
                "it (for example `mc mb`), or let posttrain create it (create_bucket=True)"
            )

        def make() -> None:
            try:
                self._client.make_bucket(self.bucket)
            except S3Error as exc:  # another pod created it between our check and now
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._call("create-bucket", "", make)
        log.info("created bucket %r at %s", self.bucket, self.endpoint)

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        """Run one S3 call with retries, translating SDK errors into actionable ones."""
        where = self.uri(key)

        def exhausted(exc: BaseException, attempts: int, elapsed: float) -> StorageError:
            return StorageUnreachableError(
                f"S3 endpoint {self.endpoint} is unreachable: {op} {where} failed {attempts} "
                f"time(s) over {elapsed:.1f}s (last error: {short_error(exc)}); check that MinIO is "
                f"running and that {S3_ENDPOINT}/{S3_SECURE} are right"
            )

        try:
            return call_with_retry(
                fn,
                policy=self._retry,
                is_transient=_is_transient,
                describe=f"{op} {where}",
                on_exhausted=exhausted,
            )
        except S3Error as exc:
            raise self._translate(exc, op, key) from None
        except urllib3.exceptions.HTTPError as exc:
            if not _is_tls_error(exc):
                raise
            raise StorageError(
                f"TLS to S3 endpoint {self.endpoint} failed ({short_error(exc)}); if MinIO uses a "
                f"private CA, point {S3_CA_BUNDLE} at its PEM certificate, or set "
                f"{S3_SECURE}=false if it serves plain HTTP"
            ) from None
        except InvalidResponseError as exc:
            raise StorageError(
                f"S3 endpoint {self.endpoint} answered {op} {where} with a non-S3 response "
                f"({short_error(exc)}); is {S3_ENDPOINT} pointing at MinIO?"
            ) from None

    def _translate(self, exc: S3Error, op: str, key: str) -> StorageError:
        where = self.uri(key)
        if exc.code in _AUTH_S3_CODES:
            access_key = _access_key_of(self._provider)
            return StorageAuthError(
                f"S3 endpoint {self.endpoint} rejected {op} on bucket {self.bucket!r} "
                f"({exc.code}) for access key {access_key!r}: the credentials are wrong or lack "
                "permission on this bucket; check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the "
                f"files in {S3_CREDENTIALS_DIR}"
            )
        if exc.code == "NoSuchBucket":
            return BucketNotFoundError(
                f"bucket {self.bucket!r} does not exist at S3 endpoint {self.endpoint} ({op} "
                f"{where}); it was deleted while in use, or create it (for example `mc mb`)"
            )
        if exc.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
            return ArtifactNotFoundError(f"no object at {where} (endpoint {self.endpoint})")
        return StorageError(
            f"S3 endpoint {self.endpoint} refused {op} {where}: {exc.code}: {exc.message}"
        )


def default_download_streams(cpu_count: int | None = None) -> int:
    """Parallel ranged GETs per download: one stream per 4 CPUs, 1 to 4.

    On a 2-core machine a single stream is fastest: the client, MinIO and verification
    share the cores, and extra streams only add switching. Hosts with more cores use
    more streams to overlap per-connection latency (a remote S3 endpoint, TLS).

    >>> default_download_streams(2), default_download_streams(8), default_download_streams(64)
    (1, 2, 4)
    """
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(4, cpus // 4))


def _access_key_of(provider: Provider) -> str:
    """The access key id (not secret; it names which credential was used), or '?'."""
    try:
        return provider.retrieve().access_key
    except Exception:
        return "?"


def _is_transient(exc: BaseException) -> bool:
    """Connection-level failures and server-side 5xx are worth retrying; everything else is not.

    TLS failures are not: a certificate that does not verify will not start verifying.
    """
    if _is_tls_error(exc):
        return False
    if isinstance(exc, urllib3.exceptions.HTTPError | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, socket.timeout):
        return True
    if isinstance(exc, ServerError):
        return exc.status_code >= 500
    if isinstance(exc, S3Error):
        return exc.code in _TRANSIENT_S3_CODES
    if isinstance(exc, InvalidResponseError):
        return str(exc).split("Response code: ", 1)[-1][:1] == "5"
    return False


def _is_tls_error(exc: BaseException) -> bool:
    if isinstance(exc, urllib3.exceptions.MaxRetryError):
        exc = exc.reason or exc
    return isinstance(exc, urllib3.exceptions.SSLError)


def _content_type(key: str) -> str:
    """Content type from the key's suffix, so reports and plots render in the MinIO console."""
    if key.endswith(".jsonl.zst") or key.endswith(".safetensors"):
        return "application/octet-stream"
    return mimetypes.guess_type(key)[0] or "application/octet-stream"


class _RewindingProgress:
    """Counts this attempt's bytes so a retried download does not double-count progress."""

    def __init__(self, progress: TransferProgress | None) -> None:
        self._progress = progress
        self.done = 0

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._progress is not None:
            self._progress.update(nbytes)

    def rewind(self) -> None:
        if self._progress is not None and self.done:
            self._progress.update(-self.done)
        self.done = 0


# --------------------------------------------------------------------------- open_store


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"{name}={value!r} is not a boolean; use true or false")


@dataclass(frozen=True)
class S3Connection:
    """Where and as whom a posttrain process reaches S3, from its environment."""

    endpoint: str
    secure: bool
    ca_bundle: str | None
    region: str | None
    credentials: Provider | None
    access_key: str | None
    secret_key: str | None


def s3_connection_from_env(env: Mapping[str, str], bucket: str = "") -> S3Connection:
    """``POSTTRAIN_S3_ENDPOINT`` (``host:port``, or a URL whose scheme sets TLS),
    ``POSTTRAIN_S3_SECURE`` (default false: MinIO in-cluster/loopback speaks plain HTTP),
    ``POSTTRAIN_S3_CA_BUNDLE`` (PEM file for a private CA), ``POSTTRAIN_S3_REGION``, and
    credentials from ``POSTTRAIN_S3_CREDENTIALS_DIR`` (a mounted Secret, preferred) or
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``."""
    endpoint = env.get(S3_ENDPOINT, "").strip()
    if not endpoint:
        needs = f"s3://{bucket}" if bucket else "S3 storage"
        raise UsageError(
            f"{needs} needs {S3_ENDPOINT} (host:port of MinIO/S3, for example "
            "minio.posttrain-system.svc:9000); it is not set"
        )
    secure = _env_flag(env, S3_SECURE, False)
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"{S3_ENDPOINT}={endpoint!r} is not host:port or an http(s) URL")
        secure, endpoint = parts.scheme == "https", parts.netloc
    ca_bundle = env.get(S3_CA_BUNDLE) or None
    if ca_bundle and not Path(ca_bundle).is_file():
        raise UsageError(f"{S3_CA_BUNDLE}={ca_bundle!r} is not a readable file")
    credentials_dir = env.get(S3_CREDENTIALS_DIR)
    return S3Connection(
        endpoint=endpoint,
        secure=secure,
        ca_bundle=ca_bundle,
        region=env.get(S3_REGION) or None,
        credentials=SecretDirCredentials(credentials_dir) if credentials_dir else None,
        access_key=None if credentials_dir else env.get("AWS_ACCESS_KEY_ID"),
        secret_key=None if credentials_dir else env.get("AWS_SECRET_ACCESS_KEY"),
    )


def s3_store_from_env(
    bucket: str,
    prefix: str = "",
    *,
    env: Mapping[str, str] | None = None,
    retry: RetryPolicy | None = None,
    create_bucket: bool = True,
) -> S3Store:
    """Build an :class:`S3Store` from the environment a posttrain pod is given
    (:func:`s3_connection_from_env`)."""
    connection = s3_connection_from_env(os.environ if env is None else env, bucket)
    return S3Store(
        connection.endpoint,
        bucket,
        prefix,
        access_key=connection.access_key,
        secret_key=connection.secret_key,
        credentials=connection.credentials,
        secure=connection.secure,
        ca_bundle=connection.ca_bundle,
        region=connection.region,
        retry=retry,
        create_bucket=create_bucket,
    )


def open_store(
    uri: str,
    *,
    env: Mapping[str, str] | None = None,
    retry: RetryPolicy | None = None,
    create_bucket: bool = True,
) -> ArtifactStore:
    """Open the store a URI names: ``s3://bucket/prefix``, ``file:///abs/dir`` or a plain path.

    >>> open_store("/tmp/posttrain-doctest-store").uri("a/b")
    'file:///tmp/posttrain-doctest-store/a/b'
    """
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        if not bucket:
            raise UsageError(f"storage URI {uri!r} has no bucket; use s3://BUCKET[/PREFIX]")
        return s3_store_from_env(bucket, prefix, env=env, retry=retry, create_bucket=create_bucket)
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise UsageError(f"storage URI {uri!r} must be absolute: file:///ABSOLUTE/PATH")
        return LocalStore(path)
    if "://" in uri:
        raise UsageError(
            f"storage URI {uri!r} has an unsupported scheme; use s3://BUCKET[/PREFIX], "
            "file:///ABSOLUTE/PATH or a plain directory path"
        )
    if not uri:
        raise UsageError("storage URI is empty; use s3://BUCKET[/PREFIX] or a directory path")
    return LocalStore(uri)
