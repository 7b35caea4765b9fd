"""Committed directories: upload a directory so that readers see all of it or none of it.

Object stores have no multi-object transactions, so a directory (a checkpoint, a published
weight version) is made atomic by a commit record: every file is uploaded first, then
``manifest.json`` is written **last** with each file's size and checksum. A prefix without a
manifest does not exist as far as readers are concerned, so a crash mid-upload leaves only
garbage that retention cleans up, never a half checkpoint that a resume would load.

Downloads verify every file against the manifest, which catches truncation, bit rot and a
file replaced behind our back (:class:`~posttrain.storage.errors.CorruptArtifactError`).

Manifest formats: ``posttrain.manifest/v2`` (written now) records each file as
``{"path", "size", "digest": "<algorithm>:<hex>"}``, xxh3-128 by default;
``posttrain.manifest/v1`` (written before) records ``{"path", "size", "sha256"}``. Both are
read and verified, so checkpoints saved by earlier versions still load.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from posttrain.storage.checksums import DEFAULT_CHECKSUM, SHA256, check_hex_digest, new_hasher
from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.metrics import DOWNLOAD_SECONDS, UPLOAD_SECONDS
from posttrain.storage.progress import TransferProgress, format_bytes
from posttrain.storage.store import ArtifactStore, Digest, check_key, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)
T = TypeVar("T")

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT_V1 = "posttrain.manifest/v1"  # sha256 only; still read
MANIFEST_FORMAT = "posttrain.manifest/v2"  # checksum algorithm named per file
# Files moved concurrently; each large file also uploads several parts in parallel.
DEFAULT_FILE_WORKERS = 3


@dataclass(frozen=True)
class ManifestFile:
    """One file of a committed directory; ``path`` is relative, ``/``-separated.

    ``digest`` is the hex checksum of the file's bytes under ``algorithm``.
    """

    path: str
    size: int
    digest: str
    algorithm: str = DEFAULT_CHECKSUM

    def to_entry(self, manifest_format: str) -> dict[str, Any]:
        """This file as a manifest JSON entry.

        >>> ManifestFile("a.bin", 3, "ab" * 16).to_entry(MANIFEST_FORMAT)["digest"][:12]
        'xxh3-128:aba'
        """
        if manifest_format == MANIFEST_FORMAT_V1:
            if self.algorithm != SHA256:
                raise ValueError(f"{MANIFEST_FORMAT_V1} holds only sha256, not {self.algorithm}")
            return {"path": self.path, "size": self.size, "sha256": self.digest}
        return {"path": self.path, "size": self.size, "digest": f"{self.algorithm}:{self.digest}"}

    @classmethod
    def from_entry(cls, entry: dict[str, Any], manifest_format: str) -> ManifestFile:
        """Parse one manifest entry of ``manifest_format``; raise ValueError when malformed.

        >>> ManifestFile.from_entry({"path": "a", "size": 1, "sha256": "0" * 64},
        ...                         MANIFEST_FORMAT_V1).algorithm
        'sha256'
        """
        if manifest_format == MANIFEST_FORMAT_V1:
            algorithm, digest = SHA256, str(entry["sha256"])
        else:
            algorithm, _, digest = str(entry["digest"]).partition(":")
        return cls(
            path=check_key(str(entry["path"])),
            size=int(entry["size"]),
            digest=check_hex_digest(algorithm, digest),
            algorithm=algorithm,
        )


@dataclass(frozen=True)
class Manifest:
    """The commit record of a directory: its files, caller metadata and creation time."""

    files: tuple[ManifestFile, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format: str = MANIFEST_FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = {
            "format": self.format,
            "created": self.created,
            "total_bytes": self.total_bytes,
            "metadata": self.metadata,
            "files": [f.to_entry(self.format) for f in self.files],
        }
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse a manifest; anything malformed is a :class:`CorruptArtifactError` naming ``where``.

        >>> m = Manifest((ManifestFile("a.bin", 3, "ab" * 16),), {"step": 1}, "2026-01-01T00:00:00Z")
        >>> Manifest.from_json(m.to_json(), "mem").files[0].path
        'a.bin'
        """
        try:
            body = json.loads(data)
            manifest_format = body.get("format")
            if manifest_format not in (MANIFEST_FORMAT, MANIFEST_FORMAT_V1):
                raise ValueError(
                    f"format is {manifest_format!r}, expected {MANIFEST_FORMAT!r} or "
                    f"{MANIFEST_FORMAT_V1!r} (written by a newer posttrain? upgrade this one)"
                )
            files = tuple(ManifestFile.from_entry(f, manifest_format) for f in body["files"])
            metadata = body.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("metadata is not an object")
            return cls(
                files=files,
                metadata=metadata,
                created=str(body.get("created", "")),
                format=manifest_format,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptArtifactError(
                f"manifest {where} is unreadable ({exc}); the directory cannot be verified and "
                "will not be used"
            ) from None


def manifest_key(prefix: str) -> str:
    return join_key(prefix, MANIFEST_NAME)


def read_manifest(store: ArtifactStore, prefix: str) -> Manifest | None:
    """The manifest under ``prefix``; None when the directory was never committed."""
    key = manifest_key(prefix)
    try:
        data = store.get_bytes(key)
    except ArtifactNotFoundError:
        return None
    return Manifest.from_json(data, store.uri(key))


def local_files(local_dir: Path) -> list[tuple[str, Path]]:
    """Regular files under ``local_dir`` as sorted ``(relative posix path, absolute path)``."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(local_dir):
        for filename in filenames:
            path = Path(dirpath, filename)
            if path.is_file():
                found.append((path.relative_to(local_dir).as_posix(), path))
    return sorted(found)


def upload_part(
    store: ArtifactStore,
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    file_workers: int = DEFAULT_FILE_WORKERS,
    algorithm: str = DEFAULT_CHECKSUM,
) -> tuple[ManifestFile, ...]:
    """Upload ``local_dir``'s files under ``prefix`` **without** committing them.

    For directories written by several processes (each trainer rank's checkpoint shards):
    every writer uploads its part, and one of them commits the whole directory with
    ``upload_dir(..., extra_files=<the other parts' entries>)``, manifest last as always.
    """
    root = Path(local_dir)
    files = local_files(root)
    if any(rel == MANIFEST_NAME for rel, _ in files):
        raise ValueError(f"{root} contains {MANIFEST_NAME}, which is reserved; rename it")

    def upload(rel: str, path: Path) -> Digest:
        return store.put_file(join_key(prefix, rel), path, algorithm=algorithm)

    digests = _run_parallel(
        [(rel, partial(upload, rel, path)) for rel, path in files],
        file_workers,
    )
    return tuple(
        ManifestFile(rel, digests[rel].size, digests[rel].checksum, digests[rel].algorithm)
        for rel, _ in files
    )


def upload_dir(
    store: ArtifactStore,
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    file_workers: int = DEFAULT_FILE_WORKERS,
    algorithm: str = DEFAULT_CHECKSUM,
    extra_files: tuple[ManifestFile, ...] = (),
) -> Manifest:
    """Upload every file of ``local_dir`` under ``prefix``, then commit it with ``manifest.json``.

    Each file's checksum (``algorithm``, xxh3-128 by default) is computed while it uploads.
    ``extra_files`` are entries other writers already uploaded (:func:`upload_part`); the
    manifest commits them together with this directory's files.

    Re-uploading an existing prefix first removes its manifest, so readers never pair the
    old manifest with new files; files left over from an earlier attempt that are not in
    the new manifest are deleted after the commit.
    """
    files = _files_to_upload(store, prefix, Path(local_dir), metadata, algorithm)
    sizes = {rel: path.stat().st_size for rel, path in files}
    total = sum(sizes.values())
    target = store.uri(prefix)
    with tracer.start_as_current_span("storage.upload_dir") as span:
        span.set_attribute("storage.uri", target)
        span.set_attribute("storage.files", len(files))
        span.set_attribute("storage.bytes", total)
        start = time.monotonic()
        previous = set(store.list(join_key(prefix) + "/"))
        if manifest_key(prefix) in previous:
            store.delete(manifest_key(prefix))  # uncommit before overwriting files
        progress = TransferProgress(f"upload {target}", total)
        digests = _upload_checking_sizes(
            store, prefix, files, sizes, progress, algorithm, file_workers
        )
        clashing = sorted({rel for rel, _ in files} & {f.path for f in extra_files})
        if clashing:
            raise ValueError(f"files uploaded by two writers under {target}: {clashing}")
        manifest = Manifest(
            files=tuple(
                ManifestFile(rel, digests[rel].size, digests[rel].checksum, digests[rel].algorithm)
                for rel, _ in files
            )
            + tuple(sorted(extra_files, key=lambda f: f.path)),
            metadata=dict(metadata or {}),
            created=datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        )
        store.put_bytes(manifest_key(prefix), manifest.to_json())  # the commit point
        stale = (
            previous - {join_key(prefix, f.path) for f in manifest.files} - {manifest_key(prefix)}
        )
        for key in sorted(stale):
            store.delete(key)
        progress.finish()
        elapsed = time.monotonic() - start
        UPLOAD_SECONDS.labels(kind="dir").observe(elapsed)
        log.info(
            "committed %s: %d files, %s in %.1fs (%s/s)",
            target,
            len(files),
            format_bytes(total),
            elapsed,
            format_bytes(total / max(elapsed, 1e-9)),
        )
        return manifest


def _files_to_upload(
    store: ArtifactStore,
    prefix: str,
    root: Path,
    metadata: dict[str, Any] | None,
    algorithm: str,
) -> list[tuple[str, Path]]:
    """``root``'s files, after every check that can fail before a byte moves: the directory
    exists, no file takes the manifest's name, the algorithm is known, metadata is JSON."""
    if not root.is_dir():
        raise FileNotFoundError(f"cannot upload {root}: not a directory")
    files = local_files(root)
    if any(rel == MANIFEST_NAME for rel, _ in files):
        raise ValueError(
            f"{root} contains {MANIFEST_NAME}, which is reserved for the commit record; rename it"
        )
    new_hasher(algorithm)  # an unknown algorithm fails here, before any upload
    try:  # fail before moving gigabytes, not at the commit point
        json.dumps(metadata or {})
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"metadata for {store.uri(prefix)} is not JSON-serialisable ({exc}); pass plain "
            "numbers, strings, lists and dicts"
        ) from None
    return files


def _upload_checking_sizes(
    store: ArtifactStore,
    prefix: str,
    files: list[tuple[str, Path]],
    sizes: dict[str, int],
    progress: TransferProgress,
    algorithm: str,
    file_workers: int,
) -> dict[str, Digest]:
    """Upload ``files`` in parallel, largest first (the long transfers overlap with the
    many small ones); a file whose size changed since it was listed fails the upload."""

    def upload(rel: str, path: Path) -> Digest:
        digest = store.put_file(join_key(prefix, rel), path, progress=progress, algorithm=algorithm)
        if digest.size != sizes[rel]:
            raise RuntimeError(
                f"{path} changed size during upload ({sizes[rel]} -> {digest.size} bytes); "
                "finish writing the directory before uploading it"
            )
        return digest

    ordered = sorted(files, key=lambda item: -sizes[item[0]])
    return _run_parallel([(rel, partial(upload, rel, path)) for rel, path in ordered], file_workers)


def download_dir(
    store: ArtifactStore,
    prefix: str,
    dest: str | os.PathLike[str],
    *,
    file_workers: int = DEFAULT_FILE_WORKERS,
    include: Callable[[str], bool] | None = None,
) -> Manifest:
    """Download the committed directory at ``prefix`` into ``dest`` and verify every file.

    ``include(path)`` False leaves a file in the store (a reader fetches it later, in part,
    with :func:`fetch_file` or by ranges); such a file must still exist, so a directory
    missing one is refused here as it would be by a full download.

    Raises :class:`ArtifactNotFoundError` when ``prefix`` has no manifest (never committed)
    and :class:`CorruptArtifactError` naming the file when a size or checksum differs or a
    listed file is missing. On error ``dest`` may hold some of the files.
    """
    source = store.uri(prefix)
    with tracer.start_as_current_span("storage.download_dir") as span:
        span.set_attribute("storage.uri", source)
        start = time.monotonic()
        manifest = read_manifest(store, prefix)
        if manifest is None:
            raise ArtifactNotFoundError(
                f"{source} has no {MANIFEST_NAME}: it is not a committed directory (its upload "
                "never finished, or the prefix is wrong)"
            )
        wanted = [f for f in manifest.files if include is None or include(f.path)]
        deferred = [f for f in manifest.files if include is not None and not include(f.path)]
        wanted_bytes = sum(f.size for f in wanted)
        span.set_attribute("storage.files", len(wanted))
        span.set_attribute("storage.bytes", wanted_bytes)
        span.set_attribute("storage.deferred_files", len(deferred))
        for entry in deferred:
            if not store.exists(join_key(prefix, entry.path)):
                raise CorruptArtifactError(
                    f"{source}/{entry.path} is listed in the manifest but missing from the store"
                )
        root = Path(dest)
        root.mkdir(parents=True, exist_ok=True)
        progress = TransferProgress(f"download {source}", wanted_bytes)
        ordered = sorted(wanted, key=lambda f: -f.size)
        _run_parallel(
            [(f.path, partial(fetch_file, store, prefix, f, root, progress)) for f in ordered],
            file_workers,
        )
        progress.finish()
        elapsed = time.monotonic() - start
        DOWNLOAD_SECONDS.labels(kind="dir").observe(elapsed)
        log.info(
            "fetched and verified %s: %d files, %s in %.1fs%s",
            source,
            len(wanted),
            format_bytes(wanted_bytes),
            elapsed,
            f" ({len(deferred)} left for on-demand reads)" if deferred else "",
        )
        return manifest


def fetch_file(
    store: ArtifactStore,
    prefix: str,
    entry: ManifestFile,
    root: Path,
    progress: TransferProgress | None = None,
) -> None:
    """Download one file of a committed directory to ``root / entry.path`` and verify it
    against its manifest entry (:class:`CorruptArtifactError` naming it otherwise)."""
    local = root / entry.path
    where = f"{store.uri(prefix)}/{entry.path}"
    try:
        digest = store.get_file(
            join_key(prefix, entry.path), local, progress=progress, algorithm=entry.algorithm
        )
    except ArtifactNotFoundError:
        raise CorruptArtifactError(
            f"{where} is listed in the manifest but missing from the store"
        ) from None
    if digest.size != entry.size:
        local.unlink(missing_ok=True)
        raise CorruptArtifactError(
            f"{where} is truncated or padded: {digest.size} bytes, manifest says {entry.size}"
        )
    if digest.checksum != entry.digest:
        local.unlink(missing_ok=True)
        raise CorruptArtifactError(
            f"{where} fails its checksum: {entry.algorithm} {digest.checksum[:16]}..., "
            f"manifest says {entry.digest[:16]}..."
        )


def delete_dir(store: ArtifactStore, prefix: str) -> int:
    """Delete a directory, manifest first so it disappears for readers in one step.

    Returns the number of objects removed.
    """
    store.delete(manifest_key(prefix))
    keys = store.list(join_key(prefix) + "/")
    for key in keys:
        store.delete(key)
    return len(keys) + 1


def _run_parallel(tasks: list[tuple[str, Callable[[], T]]], workers: int) -> dict[str, T]:
    """Run named tasks on a thread pool; the first failure cancels the rest and is raised."""
    if not tasks:
        return {}
    results: dict[str, T] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks)))) as pool:
        futures: dict[Future[T], str] = {pool.submit(fn): name for name, fn in tasks}
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        wait(pending)
        for future in done:
            exc = future.exception()
            if exc is not None:
                raise exc
            results[futures[future]] = future.result()
    return results
