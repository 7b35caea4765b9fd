"""Committed directories: upload a directory so that readers see all of it or none of it.

Object stores have no multi-object transactions, so a directory (a checkpoint, a published
weight version) is made atomic by a commit record: every file is uploaded first, then
``manifest.json`` is written **last** with each file's size and sha256. A prefix without a
manifest does not exist as far as readers are concerned, so a crash mid-upload leaves only
garbage that retention cleans up, never a half checkpoint that a resume would load.

Downloads verify every file against the manifest, which catches truncation, bit rot and a
file replaced behind our back (:class:`~posttrain.storage.errors.CorruptArtifactError`).
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
from pathlib import Path
from typing import Any, TypeVar

from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.metrics import DOWNLOAD_SECONDS, UPLOAD_SECONDS
from posttrain.storage.progress import TransferProgress, format_bytes
from posttrain.storage.store import ArtifactStore, Digest, check_key, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)
T = TypeVar("T")

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "posttrain.manifest/v1"
# Files moved concurrently; each large file also uploads several parts in parallel.
DEFAULT_FILE_WORKERS = 3


@dataclass(frozen=True)
class ManifestFile:
    """One file of a committed directory; ``path`` is relative, ``/``-separated."""

    path: str
    size: int
    sha256: str


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
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return json.dumps(body, indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse a manifest; anything malformed is a :class:`CorruptArtifactError` naming ``where``.

        >>> m = Manifest((ManifestFile("a.bin", 3, "ab" * 32),), {"step": 1}, "2026-01-01T00:00:00Z")
        >>> Manifest.from_json(m.to_json(), "mem").files[0].path
        'a.bin'
        """
        try:
            body = json.loads(data)
            if body.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {body.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            files = tuple(
                ManifestFile(
                    path=check_key(str(f["path"])), size=int(f["size"]), sha256=str(f["sha256"])
                )
                for f in body["files"]
            )
            metadata = body.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("metadata is not an object")
            return cls(files=files, metadata=metadata, created=str(body.get("created", "")))
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


def upload_dir(
    store: ArtifactStore,
    prefix: str,
    local_dir: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    file_workers: int = DEFAULT_FILE_WORKERS,
) -> Manifest:
    """Upload every file of ``local_dir`` under ``prefix``, then commit it with ``manifest.json``.

    Re-uploading an existing prefix first removes its manifest, so readers never pair the
    old manifest with new files; files left over from an earlier attempt that are not in
    the new manifest are deleted after the commit.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"cannot upload {root}: not a directory")
    files = local_files(root)
    if any(rel == MANIFEST_NAME for rel, _ in files):
        raise ValueError(
            f"{root} contains {MANIFEST_NAME}, which is reserved for the commit record; rename it"
        )
    try:  # fail before moving gigabytes, not at the commit point
        json.dumps(metadata or {})
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"metadata for {store.uri(prefix)} is not JSON-serialisable ({exc}); pass plain "
            "numbers, strings, lists and dicts"
        ) from None
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

        def upload(rel: str, path: Path) -> Digest:
            digest = store.put_file(join_key(prefix, rel), path, progress=progress)
            if digest.size != sizes[rel]:
                raise RuntimeError(
                    f"{path} changed size during upload ({sizes[rel]} -> {digest.size} bytes); "
                    "finish writing the directory before uploading it"
                )
            return digest

        # Largest first, so the long transfers overlap with the many small ones.
        ordered = sorted(files, key=lambda item: -sizes[item[0]])
        digests = _run_parallel(
            [(rel, lambda rel=rel, path=path: upload(rel, path)) for rel, path in ordered],
            file_workers,
        )
        manifest = Manifest(
            files=tuple(
                ManifestFile(rel, digests[rel].size, digests[rel].sha256) for rel, _ in files
            ),
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


def download_dir(
    store: ArtifactStore,
    prefix: str,
    dest: str | os.PathLike[str],
    *,
    file_workers: int = DEFAULT_FILE_WORKERS,
) -> Manifest:
    """Download the committed directory at ``prefix`` into ``dest`` and verify every file.

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
        span.set_attribute("storage.files", len(manifest.files))
        span.set_attribute("storage.bytes", manifest.total_bytes)
        root = Path(dest)
        root.mkdir(parents=True, exist_ok=True)
        progress = TransferProgress(f"download {source}", manifest.total_bytes)

        def fetch(entry: ManifestFile) -> None:
            local = root / entry.path
            where = f"{source}/{entry.path}"
            try:
                digest = store.get_file(join_key(prefix, entry.path), local, progress=progress)
            except ArtifactNotFoundError:
                raise CorruptArtifactError(
                    f"{where} is listed in the manifest but missing from the store"
                ) from None
            if digest.size != entry.size:
                local.unlink(missing_ok=True)
                raise CorruptArtifactError(
                    f"{where} is truncated or padded: {digest.size} bytes, manifest says "
                    f"{entry.size}"
                )
            if digest.sha256 != entry.sha256:
                local.unlink(missing_ok=True)
                raise CorruptArtifactError(
                    f"{where} fails its checksum: sha256 {digest.sha256[:16]}..., manifest says "
                    f"{entry.sha256[:16]}..."
                )

        ordered = sorted(manifest.files, key=lambda f: -f.size)
        _run_parallel([(f.path, lambda f=f: fetch(f)) for f in ordered], file_workers)
        progress.finish()
        elapsed = time.monotonic() - start
        DOWNLOAD_SECONDS.labels(kind="dir").observe(elapsed)
        log.info(
            "fetched and verified %s: %d files, %s in %.1fs",
            source,
            len(manifest.files),
            format_bytes(manifest.total_bytes),
            elapsed,
        )
        return manifest


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
