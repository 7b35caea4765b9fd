"""Where published policy weights live and how a rollout server fetches them.

The trainer publishes version ``N`` of the policy under ``<prefix>/vNNNNNNNN/`` (eight
digits, see ``api.rolloutpool.WeightUpdatePolicy.source_uri``) as safetensors. A prefix is
either a local directory / ``file://`` URI (single machine, tests) or ``s3://`` (clusters,
through :mod:`posttrain.storage`). A ``uri`` given to ``/v1/weights/load`` may also point
directly at one version's directory.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERSION_DIR = re.compile(r"^v(\d{8})$")
MANIFEST_NAME = "manifest.json"  # written last by posttrain.storage when a version commits


def version_dir_name(version: int) -> str:
    """Directory name of a published version.

    >>> version_dir_name(12)
    'v00000012'
    """
    if version < 0:
        raise ValueError(f"weight versions are >= 0, got {version}")
    return f"v{version:08d}"


def _local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).expanduser()


def has_weights(path: Path) -> bool:
    """Whether ``path`` is a directory with safetensors in it."""
    return path.is_dir() and any(path.glob("*.safetensors"))


def latest_version(prefix: str) -> int | None:
    """Highest complete version published under ``prefix`` (None when nothing is there)."""
    if prefix.startswith("s3://"):
        return _latest_version_s3(prefix)
    root = _local_path(prefix)
    if not root.is_dir():
        return None
    candidates = {
        int(match.group(1)): child
        for child in root.iterdir()
        if (match := VERSION_DIR.match(child.name)) and has_weights(child)
    }
    # posttrain.storage commits a version by writing manifest.json last; when any version
    # has one, only committed versions count (the others are uploads still in progress).
    committed = {v for v, d in candidates.items() if (d / MANIFEST_NAME).is_file()}
    versions = committed or set(candidates)
    return max(versions) if versions else None


def committed_versions(prefix: str) -> list[int]:
    """Every complete version under ``prefix``, newest first (the same rule as
    :func:`latest_version`: committed ones when any version has a manifest)."""
    if prefix.startswith("s3://"):
        return sorted((int(v) for v in registry_for(prefix).versions()), reverse=True)
    root = _local_path(prefix)
    if not root.is_dir():
        return []
    candidates = {
        int(match.group(1)): child
        for child in root.iterdir()
        if (match := VERSION_DIR.match(child.name)) and has_weights(child)
    }
    committed = {v for v, d in candidates.items() if (d / MANIFEST_NAME).is_file()}
    return sorted(committed or candidates, reverse=True)


def unusable_version_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean *this version* cannot be served (damaged, missing or incomplete
    files), as opposed to storage being unreachable: a replica skips such a version and
    keeps (or falls back to) an older one instead of retrying it forever."""
    from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError

    return (CorruptArtifactError, ArtifactNotFoundError, FileNotFoundError, ValueError)


def join_candidates(prefix: str, current: int, refused: set[int]) -> list[int]:
    """Versions a replica should try, newest first, to serve the newest one that verifies:
    committed versions above ``current`` it has not already refused.

    >>> import tempfile, pathlib
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> for v in (1, 2, 3):
    ...     (root / version_dir_name(v)).mkdir(); (root / version_dir_name(v) / "m.safetensors").touch()
    >>> join_candidates(str(root), 0, refused={3})
    [2, 1]
    >>> join_candidates(str(root), 2, refused=set())
    [3]
    """
    return [v for v in committed_versions(prefix) if v > current and v not in refused]


def check_uri(uri: str) -> None:
    """Refuse a weights URI that names no place (ValueError saying the accepted forms), so
    that every later failure to open an ``s3://`` store is this replica's configuration, not
    the caller's URI (see :func:`load_failure_status`).

    >>> check_uri("s3://bucket/runs/a/weights")
    >>> check_uri("s3:///weights")
    Traceback (most recent call last):
    ...
    ValueError: weights URI 's3:///weights' must be s3://BUCKET/PREFIX, a file:// URI or a directory
    """
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        names_a_place = bool(bucket and prefix.strip("/"))
    else:
        names_a_place = bool(uri.strip())
    if not names_a_place:
        raise ValueError(
            f"weights URI {uri!r} must be s3://BUCKET/PREFIX, a file:// URI or a directory"
        )


def load_failure_status(exc: BaseException) -> int | None:
    """The HTTP status of a ``/v1/weights/load`` that failed with ``exc``.

    503 when this replica cannot open or reach the store (no ``POSTTRAIN_S3_ENDPOINT``, bad
    credentials, storage down): the caller's request was fine, the deployment needs fixing or
    the storage time to come back. 400 when the request names weights that cannot be served
    (missing, damaged, a malformed URI). None for anything else: a server bug, answered 500.
    """
    from posttrain.errors import UsageError
    from posttrain.storage.errors import StorageAuthError, StorageError, StorageUnreachableError

    if isinstance(exc, UsageError | StorageUnreachableError | StorageAuthError):
        return 503
    if isinstance(exc, StorageError | FileNotFoundError | ValueError):
        return 400
    return None


def fetch_weights(uri: str, version: int, scratch: Path | None = None) -> tuple[Path, bool]:
    """A local directory holding version ``version``'s safetensors.

    Local prefixes are read in place; ``s3://`` is downloaded and verified through
    ``posttrain.storage.checkpoints.WeightRegistry``. Returns ``(path, is_temporary)``; the
    caller deletes temporary downloads once loaded.
    Raises FileNotFoundError naming what was looked for, so a wrong URI is obvious.
    """
    check_uri(uri)
    if uri.startswith("s3://"):
        return _fetch_s3(uri, version, scratch), True
    path = _local_path(uri)
    if has_weights(path):
        verify_local(path)
        return path, False
    versioned = path / version_dir_name(version)
    if has_weights(versioned):
        verify_local(versioned)
        return versioned, False
    raise FileNotFoundError(
        f"no *.safetensors in {path} nor in {versioned}; publish version {version} there "
        "first (the trainer writes <prefix>/vNNNNNNNN/)"
    )


def verify_local(path: Path) -> None:
    """Check a local version directory against its ``manifest.json``, when it has one.

    A registry on a local or shared filesystem (``file://`` store, ``posttrain run --local``
    with a checkpoint directory) is read in place, not downloaded, so the digests that
    ``download_dir`` checks for ``s3://`` are checked here: a version whose files were
    damaged after commit is refused (``CorruptArtifactError``) and the server keeps serving
    the previous one. Directories without a manifest (the trainer's tmpfs fast path, a
    hand-made directory) are trusted as they are.
    """
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return
    from posttrain.storage.checksums import new_hasher
    from posttrain.storage.commit import Manifest
    from posttrain.storage.errors import CorruptArtifactError

    manifest = Manifest.from_json(manifest_path.read_bytes(), str(manifest_path))
    for entry in manifest.files:
        local = path / entry.path
        if not local.is_file():
            raise CorruptArtifactError(f"{local} is listed in {manifest_path} but missing")
        if local.stat().st_size != entry.size:
            raise CorruptArtifactError(
                f"{local} has {local.stat().st_size} bytes, the manifest says {entry.size}"
            )
        hasher = new_hasher(entry.algorithm)
        with local.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                hasher.update(chunk)
        if hasher.hexdigest() != entry.digest:
            raise CorruptArtifactError(
                f"{local} does not match its {entry.algorithm} digest in {manifest_path}; "
                "refusing this weight version"
            )


def registry_for(uri: str) -> Any:
    """``posttrain.storage``'s WeightRegistry for a weights prefix URI.

    The trainer hands us ``store.uri("weights")`` (e.g. ``s3://bucket/runs/a/weights``): the
    last path component is the registry prefix inside the store rooted one level up.
    """
    try:
        from posttrain.storage.checkpoints import WeightRegistry
        from posttrain.storage.store import open_store
    except ImportError as exc:
        raise RuntimeError(
            f"cannot read {uri}: posttrain.storage is not importable ({exc})"
        ) from exc
    root, _, name = uri.rstrip("/").rpartition("/")
    if root.endswith(":/") or root.endswith(":"):  # "s3://bucket" has no prefix component
        root, name = uri.rstrip("/"), ""
    if not name:
        raise ValueError(f"{uri} names no weights prefix; use s3://BUCKET/PREFIX/weights")
    return WeightRegistry(open_store(root), name)


def _fetch_s3(uri: str, version: int, scratch: Path | None) -> Path:
    """Download + verify (manifest digests) one version into a fresh temporary directory."""
    # WeightRegistry.fetch swaps a verified copy in place of dest, so dest may pre-exist.
    dest = Path(tempfile.mkdtemp(prefix=f"weights-{version_dir_name(version)}-", dir=scratch))
    try:
        registry_for(uri).fetch(version, dest)
    except Exception:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    if not has_weights(dest):
        shutil.rmtree(dest, ignore_errors=True)
        raise FileNotFoundError(f"{uri} version {version} holds no *.safetensors")
    return dest


def _latest_version_s3(prefix: str) -> int | None:
    found = registry_for(prefix).latest_version()
    return None if found is None else int(found)


# --- delta versions (posttrain.rollout.deltas): a version may ship only its changed elements


@dataclass
class HeldWeights:
    """A replica's own copy of the version it serves (safetensors in a scratch directory it
    owns), kept so that the next delta version has its base without a download."""

    version: int
    directory: Path


def version_metadata(uri: str, version: int) -> dict[str, Any] | None:
    """The manifest metadata of ``version`` under the registry ``uri``; None when the
    version has no manifest (the trainer's shared-memory files, a hand-made directory)."""
    from posttrain.storage.commit import Manifest, read_manifest

    if uri.startswith("s3://"):
        registry = registry_for(uri)
        manifest = read_manifest(registry.store, registry.version_key(version))
        return None if manifest is None else dict(manifest.metadata)
    path = _local_path(uri)
    directory = path if has_weights(path) else path / version_dir_name(version)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    return dict(Manifest.from_json(manifest_path.read_bytes(), str(manifest_path)).metadata)


def delta_base(metadata: dict[str, Any] | None) -> int | None:
    """The base version a delta version applies to; None for a full version.

    >>> delta_base({"delta": {"base": 4}}), delta_base({"dtype": "bfloat16"}), delta_base(None)
    (4, None, None)
    """
    delta = (metadata or {}).get("delta")
    return int(delta["base"]) if isinstance(delta, dict) and "base" in delta else None


def fetch_version(
    uri: str, version: int, scratch: Path | None = None, held: HeldWeights | None = None
) -> tuple[Path, bool]:
    """A local directory holding version ``version``'s full safetensors, as
    :func:`fetch_weights` returns it, for full and delta versions alike.

    A delta version is rebuilt from the newest base on its chain this replica can get: the
    version it ``held`` when the chain reaches it, else the full version the chain starts
    from (a replica that missed versions or joins late), then every delta after it in order,
    each checked tensor by tensor against the digests of the full version's bytes. When the
    held copy does not give the published bytes (damaged on disk) the chain is replayed from
    its full version before the version is refused.
    """
    check_uri(uri)
    metadata = version_metadata(uri, version)
    if delta_base(metadata) is None:
        return fetch_weights(uri, version, scratch)
    try:
        return _rebuild(uri, version, scratch, held)
    except unusable_version_errors() as exc:
        if held is None:
            raise
        log.warning("rebuilding weights v%d on the held v%d failed (%s); replaying the delta "
                    "chain from its full version instead", version, held.version, exc)  # fmt: skip
        return _rebuild(uri, version, scratch, None)


def _rebuild(
    uri: str, version: int, scratch: Path | None, held: HeldWeights | None
) -> tuple[Path, bool]:
    from safetensors.torch import save_file

    from posttrain.rollout.deltas import apply_delta
    from posttrain.rollout.engine import read_safetensors_dir
    from posttrain.storage.errors import ArtifactNotFoundError

    chain: list[tuple[int, dict[str, Any]]] = []  # the deltas to apply, newest first
    current, metadata = version, version_metadata(uri, version)
    while (base := delta_base(metadata)) is not None:
        assert metadata is not None
        chain.append((current, metadata["delta"]))
        if held is not None and base == held.version:
            break
        if base >= current:
            raise ValueError(f"weights v{current} under {uri} names base v{base}, not older")
        current, metadata = base, version_metadata(uri, base)
        if metadata is None:
            raise ArtifactNotFoundError(
                f"weights v{version} under {uri} is a delta whose chain reaches v{base}, which "
                "is no longer published; a newer full version will follow"
            )
    start_version = chain[-1][1]["base"]
    if held is not None and start_version == held.version:
        state = read_safetensors_dir(held.directory)
    else:
        path, temporary = fetch_weights(uri, start_version, scratch)
        try:
            state = read_safetensors_dir(path)
        finally:
            if temporary:
                shutil.rmtree(path, ignore_errors=True)
    for number, delta in reversed(chain):
        path, temporary = fetch_weights(uri, number, scratch)
        try:
            state = apply_delta(state, path / "delta.safetensors", delta, f"{uri} v{number}")
        finally:
            if temporary:
                shutil.rmtree(path, ignore_errors=True)
    dest = Path(tempfile.mkdtemp(prefix=f"weights-{version_dir_name(version)}-", dir=scratch))
    save_file(state, str(dest / "model.safetensors"))
    log.info("rebuilt weights v%d from v%d and %d delta(s)", version, start_version, len(chain))
    return dest, True


def hold(version: int, path: Path, temporary: bool, root: Path | None) -> HeldWeights:
    """Keep the version just loaded as the base for the next delta, under ``root`` (None:
    the temporary directory): a temporary directory is moved there as it is; the files of
    one read in place (a local registry, which may prune them) are hard-linked where the
    filesystem allows, else copied. A link shares later damage to the registry's file,
    which the next rebuild's digests catch (and then replay the chain from its full
    version)."""
    if temporary:
        if root is None or path.parent == root:  # (fetched into the held root already)
            return HeldWeights(version, path)
        moved = root / path.name
        shutil.move(path, moved)
        return HeldWeights(version, moved)
    copy = new_held_dir(version, root)
    for file in path.glob("*.safetensors"):
        try:
            os.link(file, copy / file.name)
        except OSError:  # another filesystem, or links not supported
            shutil.copyfile(file, copy / file.name)
    return HeldWeights(version, copy)


def new_held_dir(version: int, root: Path | None) -> Path:
    """A fresh, empty directory under ``root`` for a held copy of ``version``."""
    return Path(tempfile.mkdtemp(prefix=f"held-{version_dir_name(version)}-", dir=root))


HELD_PREFIX = "posttrain-held-"


def scratch_dir() -> Path:
    """Where a replica stages and holds weights: the pod's ``weights-scratch`` volume
    (``$POSTTRAIN_WEIGHTS_SCRATCH``, set by the operator), else the temporary directory."""
    from posttrain.api.env import WEIGHTS_SCRATCH

    return Path(os.environ.get(WEIGHTS_SCRATCH) or tempfile.gettempdir())


def held_root(scratch: Path) -> Path:
    """This process's directory for its held copies under ``scratch``
    (``posttrain-held-<pid>-<start time>``), after removing those of processes that are
    gone: a replica killed mid-run (SIGKILL runs no cleanup), or a container restarted on
    the same emptyDir, where the new process may well have the old one's pid (its start
    time differs). Servers in one process (``ServerThread``s) share the directory, each
    with copies of its own inside.

    """
    me = _process_tag(os.getpid())
    for old in scratch.glob(HELD_PREFIX + "*"):
        if old.name != HELD_PREFIX + me and _held_by_gone_process(old.name):
            shutil.rmtree(old, ignore_errors=True)
    root = scratch / f"{HELD_PREFIX}{me}"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _process_tag(pid: int) -> str:
    """``<pid>-<start time>``: a process's identity that survives pid reuse (the start time
    in clock ticks since boot, from /proc; just the pid where there is no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return str(pid)
    # The command name (field 2) may hold spaces and parentheses: fields count from its ")".
    return f"{pid}-{stat.rsplit(')', 1)[1].split()[19]}"


def _held_by_gone_process(name: str) -> bool:
    """Whether the held directory ``name`` belongs to a process that no longer runs."""
    tag = name.removeprefix(HELD_PREFIX)
    pid = tag.split("-", 1)[0]
    if not pid.isdigit():
        return False  # not one of ours
    if int(pid) == os.getpid():
        return True  # our pid, another start time (or none): a restarted container's
    return not _process_alive(int(pid)) or ("-" in tag and _process_tag(int(pid)) != tag)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
