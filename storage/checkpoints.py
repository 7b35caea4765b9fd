"""Checkpoints and published weight versions: numbered committed directories + a pointer.

Layout under a run prefix (see docs/storage.md)::

    checkpoints/step-00000012/{model.safetensors, optimizer.pt, ..., manifest.json}
    checkpoints/latest.json          {"step": 12, "dir": "step-00000012", "manifest_sha256": ...}
    weights/v00000003/{...,manifest.json}
    weights/latest.json              {"version": 3, "dir": "v00000003", ...}

``latest.json`` is written with one put **after** the directory's manifest, so resolving the
newest checkpoint is a single GET, never a listing. A reader that finds the pointer missing,
unreadable or pointing at a directory that fails verification falls back to listing the
committed manifests and takes the newest one that verifies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from posttrain.storage.commit import (
    MANIFEST_NAME,
    Manifest,
    ManifestFile,
    delete_dir,
    download_dir,
    manifest_key,
    read_manifest,
    upload_dir,
    upload_part,
)
from posttrain.storage.errors import ArtifactNotFoundError, CorruptArtifactError
from posttrain.storage.metrics import CHECKPOINTS_DELETED, CHECKPOINTS_SAVED, CORRUPT_ARTIFACTS
from posttrain.storage.store import ArtifactStore, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

POINTER_NAME = "latest.json"


@dataclass(frozen=True)
class _SeriesLayout:
    """How one kind of numbered directory is named (``step-00000012``, ``v00000003``)."""

    kind: str  # "checkpoint" | "weights": used in messages, spans and metrics
    dir_prefix: str  # "step-" | "v"
    number_field: str  # "step" | "version": the pointer's field

    def dir_name(self, number: int) -> str:
        """
        >>> _SeriesLayout("checkpoint", "step-", "step").dir_name(12)
        'step-00000012'
        """
        if number < 0:
            raise ValueError(f"{self.number_field} must be >= 0, got {number}")
        return f"{self.dir_prefix}{number:08d}"

    def parse_number(self, name: str) -> int | None:
        """
        >>> _SeriesLayout("weights", "v", "version").parse_number("v00000003")
        3
        >>> _SeriesLayout("weights", "v", "version").parse_number("latest.json") is None
        True
        """
        match = re.fullmatch(re.escape(self.dir_prefix) + r"(\d{8,})", name)
        return int(match.group(1)) if match else None


_CHECKPOINTS = _SeriesLayout("checkpoint", "step-", "step")
_WEIGHTS = _SeriesLayout("weights", "v", "version")


class _CommittedSeries:
    """Numbered committed directories under ``prefix`` with a ``latest.json`` pointer."""

    def __init__(self, store: ArtifactStore, prefix: str, layout: _SeriesLayout) -> None:
        self.store = store
        self.prefix = prefix.strip("/")
        self.layout = layout
        # Corruption messages from the last fetch_latest, newest first (for callers to surface).
        self.last_refused: list[str] = []

    def dir_key(self, number: int) -> str:
        return join_key(self.prefix, self.layout.dir_name(number))

    @property
    def pointer_key(self) -> str:
        return join_key(self.prefix, POINTER_NAME)

    def numbers(self) -> list[int]:
        """Committed numbers (directories with a manifest), ascending."""
        found = []
        for key in self.store.list(self.prefix + "/"):
            parts = key[len(self.prefix) + 1 :].split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                number = self.layout.parse_number(parts[0])
                if number is not None:
                    found.append(number)
        return sorted(found)

    def uncommitted_numbers(self) -> list[int]:
        """Directories holding files but no manifest: interrupted uploads (or one in flight)."""
        seen: dict[int, bool] = {}
        for key in self.store.list(self.prefix + "/"):
            parts = key[len(self.prefix) + 1 :].split("/")
            number = self.layout.parse_number(parts[0]) if len(parts) >= 2 else None
            if number is not None:
                seen[number] = seen.get(number, False) or parts[1:] == [MANIFEST_NAME]
        return sorted(n for n, committed in seen.items() if not committed)

    def commit(
        self,
        number: int,
        local_dir: str | os.PathLike[str],
        metadata: dict[str, Any],
        extra_files: tuple[ManifestFile, ...] = (),
    ) -> Manifest:
        """Upload + manifest, then move the pointer (a single put) to this directory."""
        manifest = upload_dir(
            self.store, self.dir_key(number), local_dir, metadata=metadata, extra_files=extra_files
        )
        pointer = {
            self.layout.number_field: number,
            "dir": self.layout.dir_name(number),
            "manifest_sha256": hashlib.sha256(manifest.to_json()).hexdigest(),
            "updated": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        }
        self.store.put_bytes(self.pointer_key, json.dumps(pointer, indent=2).encode())
        return manifest

    def read_pointer(self) -> tuple[int, str] | None:
        """``(number, manifest_sha256)`` from ``latest.json``; None if absent or unreadable."""
        try:
            body = json.loads(self.store.get_bytes(self.pointer_key))
            return int(body[self.layout.number_field]), str(body.get("manifest_sha256", ""))
        except ArtifactNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "%s is unreadable (%s); finding the newest %s by listing manifests instead",
                self.store.uri(self.pointer_key),
                exc,
                self.layout.kind,
            )
            return None

    def fetch(
        self,
        number: int,
        dest: str | os.PathLike[str],
        expected_manifest_sha256: str = "",
        include: Callable[[str], bool] | None = None,
    ) -> Manifest:
        """Download + verify into a staging directory, then swap it in place of ``dest``.

        ``dest`` is replaced only by a fully verified copy, so a corrupt download never
        leaves a mix of old and new files behind. Files ``include`` rejects stay in the store
        (checked to exist) for on-demand reads.
        """
        target = Path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.incoming-{uuid.uuid4().hex[:8]}")
        try:
            if expected_manifest_sha256:
                self._check_manifest_digest(number, expected_manifest_sha256)
            manifest = download_dir(self.store, self.dir_key(number), staging, include=include)
            if target.exists():
                retired = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
                target.rename(retired)
                staging.rename(target)
                shutil.rmtree(retired, ignore_errors=True)
            else:
                staging.rename(target)
            return manifest
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _check_manifest_digest(self, number: int, expected: str) -> None:
        """The pointer records the manifest's sha256: a mismatch means the manifest changed."""
        key = manifest_key(self.dir_key(number))
        try:
            actual = hashlib.sha256(self.store.get_bytes(key)).hexdigest()
        except ArtifactNotFoundError:
            return  # download_dir reports the missing manifest
        if actual != expected:
            raise CorruptArtifactError(
                f"{self.store.uri(key)} does not match the sha256 recorded in "
                f"{self.store.uri(self.pointer_key)} ({actual[:16]}... vs {expected[:16]}...)"
            )

    def fetch_latest(
        self,
        dest: str | os.PathLike[str],
        include: Callable[[str], bool] | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> tuple[int, Manifest] | None:
        """Fetch the newest directory that verifies; None when nothing was ever committed.

        ``exclude``: numbers a reader already refused (damage found after the fetch, in a
        file left for on-demand reads); they are skipped as if they had failed here.
        """
        self.last_refused = []
        tried: set[int] = set(exclude)
        pointer = self.read_pointer()
        if pointer is not None and pointer[0] not in exclude:  # one GET, no listing
            tried.add(pointer[0])
            result = self._try_fetch(pointer[0], dest, pointer[1], include)
            if result is not None:
                return pointer[0], result
        # Pointer absent, unreadable or bad: the newest committed directory that verifies.
        listed = [n for n in reversed(self.numbers()) if n not in tried]
        if not tried and not listed:
            return None
        for number in listed:
            result = self._try_fetch(number, dest, "", include)
            if result is not None:
                if self.last_refused:
                    log.warning(
                        "loaded %s %s %d after refusing %d newer one(s)",
                        self.layout.kind,
                        self.layout.number_field,
                        number,
                        len(self.last_refused),
                    )
                return number, result
        refused = list(self.last_refused)
        if exclude:
            refused.append(f"{self.layout.number_field}(s) {sorted(exclude)} refused by the reader")
        raise CorruptArtifactError(
            f"no {self.layout.kind} under {self.store.uri(self.prefix)} passes verification: "
            + "; ".join(refused)
        )

    def _try_fetch(
        self,
        number: int,
        dest: str | os.PathLike[str],
        expected_sha: str,
        include: Callable[[str], bool] | None,
    ) -> Manifest | None:
        """Fetch one directory; on damage, record and log why and return None."""
        try:
            return self.fetch(number, dest, expected_sha, include)
        except (CorruptArtifactError, ArtifactNotFoundError) as exc:
            CORRUPT_ARTIFACTS.labels(kind=self.layout.kind).inc()
            self.last_refused.append(str(exc))
            log.error(
                "refusing %s %s %d: %s; falling back to the previous complete one",
                self.layout.kind,
                self.layout.number_field,
                number,
                exc,
            )
            return None

    def prune(self, keep: Iterable[int], newest_committed: int) -> list[int]:
        """Delete committed directories not in ``keep`` and interrupted uploads older than
        ``newest_committed`` (a newer uncommitted one may be an upload in flight)."""
        keep_set = set(keep)
        removed = []
        for number in self.numbers():
            if number not in keep_set:
                delete_dir(self.store, self.dir_key(number))
                removed.append(number)
        for number in self.uncommitted_numbers():
            if number < newest_committed:
                delete_dir(self.store, self.dir_key(number))
                log.info("removed interrupted upload %s", self.store.uri(self.dir_key(number)))
        return removed


def select_retained(
    steps: list[int], scores: dict[int, float], keep_last: int, *, higher_is_better: bool = True
) -> set[int]:
    """Steps to keep: the newest ``keep_last`` plus the best-scoring one.

    >>> sorted(select_retained([1, 2, 3, 4, 5], {2: 0.9, 4: 0.5}, keep_last=2))
    [2, 4, 5]
    >>> sorted(select_retained([1, 2, 3], {1: 0.1, 3: 0.1}, keep_last=1, higher_is_better=False))
    [3]
    """
    keep = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    scored = [(s, scores[s]) for s in steps if s in scores]
    if scored:
        sign = 1.0 if higher_is_better else -1.0
        # Ties go to the newer step: it carries more training for the same score.
        best = max(scored, key=lambda item: (sign * item[1], item[0]))[0]
        keep.add(best)
    return keep


class CheckpointManager:
    """Save, retain and resume training checkpoints under ``<prefix>/step-NNNNNNNN/``.

    The trainer serialises tensors into a local directory; this class only moves files.
    Retention keeps the newest ``keep_last`` checkpoints plus the best by ``eval_score``,
    and every ``pinned`` step (a pipeline's RL stage reloads its KL anchor from one).
    """

    def __init__(
        self,
        store: ArtifactStore,
        prefix: str = "checkpoints",
        *,
        keep_last: int = 3,
        higher_is_better: bool = True,
        pinned: frozenset[int] = frozenset(),
    ) -> None:
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}"
            )
        self._series = _CommittedSeries(store, prefix, _CHECKPOINTS)
        self.keep_last = keep_last
        self.higher_is_better = higher_is_better
        self.pinned = pinned
        self._scores: dict[int, float | None] = {}  # step -> eval score, read once per step

    @property
    def store(self) -> ArtifactStore:
        return self._series.store

    @property
    def last_refused(self) -> list[str]:
        """Why checkpoints were skipped by the last :meth:`load_latest` (empty if none were)."""
        return self._series.last_refused

    def step_prefix(self, step: int) -> str:
        return self._series.dir_key(step)

    def upload_part(self, step: int, local_dir: str | os.PathLike[str]) -> tuple[ManifestFile, ...]:
        """Upload one writer's files of checkpoint ``step`` without committing it; pass the
        result to the committing writer's :meth:`save` as ``extra_files``."""
        return upload_part(self.store, self.step_prefix(step), local_dir)

    def save(
        self,
        step: int,
        local_dir: str | os.PathLike[str],
        metadata: dict[str, Any] | None = None,
        eval_score: float | None = None,
        extra_files: tuple[ManifestFile, ...] = (),
    ) -> Manifest:
        """Commit ``local_dir`` (plus ``extra_files`` other writers uploaded) as the checkpoint
        of ``step``, move ``latest.json``, prune."""
        with tracer.start_as_current_span("checkpoint.save") as span:
            span.set_attribute("checkpoint.step", step)
            start = time.monotonic()
            meta = {**(metadata or {}), "step": step, "eval_score": eval_score}
            manifest = self._series.commit(step, local_dir, meta, extra_files)
            self._scores[step] = eval_score
            span.set_attribute("storage.files", len(manifest.files))
            span.set_attribute("storage.bytes", manifest.total_bytes)
            CHECKPOINTS_SAVED.inc()
            removed = self._apply_retention(step)
            span.set_attribute("checkpoint.pruned", len(removed))
            log.info(
                "checkpoint step %d saved to %s in %.1fs%s",
                step,
                self.store.uri(self.step_prefix(step)),
                time.monotonic() - start,
                f"; pruned steps {removed}" if removed else "",
            )
            return manifest

    def load_latest(
        self,
        dest: str | os.PathLike[str],
        *,
        include: Callable[[str], bool] | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> tuple[int, Manifest] | None:
        """Fetch the newest checkpoint that verifies into ``dest``; None if there is none.

        A corrupt or truncated checkpoint is refused (logged with the file at fault, listed
        in :attr:`last_refused`) and the previous complete one is used instead. Files
        ``include`` rejects are left in the store for the caller to read in part
        (:mod:`posttrain.storage.blocks`); steps in ``exclude`` are skipped.
        """
        with tracer.start_as_current_span("checkpoint.load") as span:
            result = self._series.fetch_latest(dest, include, exclude)
            if result is not None:
                span.set_attribute("checkpoint.step", result[0])
                span.set_attribute("storage.files", len(result[1].files))
                span.set_attribute("storage.bytes", result[1].total_bytes)
            span.set_attribute("checkpoint.refused", len(self.last_refused))
            return result

    def load(
        self,
        step: int,
        dest: str | os.PathLike[str],
        *,
        include: Callable[[str], bool] | None = None,
    ) -> Manifest:
        """Fetch one specific checkpoint (no fallback: asking for step N means step N);
        ``include`` as in :meth:`load_latest` (readers of the weights alone skip the rest)."""
        with tracer.start_as_current_span("checkpoint.load") as span:
            span.set_attribute("checkpoint.step", step)
            return self._series.fetch(step, dest, include=include)

    def list_steps(self) -> list[int]:
        """Committed checkpoint steps, ascending."""
        return self._series.numbers()

    def latest_step(self) -> int | None:
        """The step ``latest.json`` names (one GET), else the newest committed one."""
        pointer = self._series.read_pointer()
        if pointer is not None:
            return pointer[0]
        steps = self.list_steps()
        return steps[-1] if steps else None

    def _score(self, step: int) -> float | None:
        if step not in self._scores:
            try:
                manifest = read_manifest(self.store, self.step_prefix(step))
            except CorruptArtifactError:
                manifest = None
            score = manifest.metadata.get("eval_score") if manifest else None
            self._scores[step] = float(score) if isinstance(score, int | float) else None
        return self._scores[step]

    def _apply_retention(self, just_saved: int) -> list[int]:
        steps = self.list_steps()
        scores = {s: sc for s in steps if (sc := self._score(s)) is not None}
        keep = select_retained(
            steps, scores, self.keep_last, higher_is_better=self.higher_is_better
        )
        keep.add(just_saved)  # latest.json points here, whatever its number
        keep |= self.pinned
        removed = self._series.prune(keep, newest_committed=max(steps, default=just_saved))
        for step in removed:
            self._scores.pop(step, None)
        CHECKPOINTS_DELETED.inc(len(removed))
        return removed


class WeightRegistry:
    """Published policy weights for rollout servers: ``<prefix>/vNNNNNNNN/`` + ``latest.json``.

    The trainer publishes after each optimizer step it wants sampled from; rollout servers
    poll :meth:`latest_version` (one small GET) and :meth:`fetch` when it changes. The newest
    ``keep_last`` versions are retained so a slow server can finish downloading.

    A version may be a *delta* (manifest metadata ``delta.base``: the version it applies to,
    see :mod:`posttrain.rollout.deltas`). Retention keeps every version a retained delta's
    chain passes through down to its full version, so a replica can always rebuild a
    retained version; deltas go with their base, never before it.
    """

    def __init__(
        self, store: ArtifactStore, prefix: str = "weights", *, keep_last: int = 3
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self._series = _CommittedSeries(store, prefix, _WEIGHTS)
        self.keep_last = keep_last
        self._bases: dict[int, int | None] = {}  # version -> delta base (versions are immutable)

    @property
    def store(self) -> ArtifactStore:
        return self._series.store

    @property
    def last_refused(self) -> list[str]:
        return self._series.last_refused

    def version_key(self, version: int) -> str:
        """The store key of one version's directory."""
        return self._series.dir_key(version)

    def delta_base(self, version: int) -> int | None:
        """The version ``version`` is a delta over; None for a full (or unreadable) one."""
        if version not in self._bases:
            try:
                manifest = read_manifest(self.store, self.version_key(version))
            except CorruptArtifactError:
                manifest = None
            delta = manifest.metadata.get("delta") if manifest else None
            base = delta.get("base") if isinstance(delta, dict) else None
            self._bases[version] = int(base) if isinstance(base, int) else None
        return self._bases[version]

    def retained(self, versions: list[int], newest: int) -> set[int]:
        """The versions to keep: the newest ``keep_last`` and ``newest``, plus every base
        their delta chains pass through (so pruning never breaks a chain).

        A delta whose base is gone (a chain already broken) is not a reason to keep more.
        """
        present = set(versions)
        keep = {*sorted(versions)[-self.keep_last :], newest}
        for version in list(keep):
            while (base := self.delta_base(version)) is not None and base in present:
                keep.add(base)
                version = base
        return keep

    def publish(
        self,
        version: int,
        local_dir: str | os.PathLike[str],
        metadata: dict[str, Any] | None = None,
    ) -> Manifest:
        """Commit ``local_dir`` as ``version`` (a delta when ``metadata["delta"]`` names its
        base), move ``latest.json``, prune what no retained chain needs."""
        with tracer.start_as_current_span("weights.publish") as span:
            span.set_attribute("weights.version", version)
            meta = {**(metadata or {}), "version": version}
            delta = meta.get("delta")
            if isinstance(delta, dict) and delta.get("base") not in self.versions():
                raise ValueError(
                    f"weights v{version} is a delta over v{delta.get('base')}, which is not "
                    f"published under {self.store.uri(self._series.prefix)}; publish it full"
                )
            manifest = self._series.commit(version, local_dir, meta)
            span.set_attribute("storage.bytes", manifest.total_bytes)
            span.set_attribute("weights.delta", isinstance(delta, dict))
            self._bases[version] = int(delta["base"]) if isinstance(delta, dict) else None
            versions = self._series.numbers()
            removed = self._series.prune(
                self.retained(versions, version),
                newest_committed=max(versions, default=version),
            )
            for number in removed:
                self._bases.pop(number, None)
            return manifest

    def latest_version(self) -> int | None:
        pointer = self._series.read_pointer()
        if pointer is not None:
            return pointer[0]
        versions = self._series.numbers()
        return versions[-1] if versions else None

    def versions(self) -> list[int]:
        return self._series.numbers()

    def fetch(
        self, version: int | Literal["latest"], dest: str | os.PathLike[str]
    ) -> tuple[int, Manifest]:
        """Fetch and verify a version (``"latest"``: the newest that verifies) into ``dest``.

        The directory as committed: a delta version holds its ``delta.safetensors``, which
        :func:`posttrain.rollout.weights.fetch_version` applies to its base."""
        with tracer.start_as_current_span("weights.fetch") as span:
            if version == "latest":
                result = self._series.fetch_latest(dest)
                if result is None:
                    raise ArtifactNotFoundError(
                        f"no weights published under {self._series.store.uri(self._series.prefix)}"
                        " yet; the trainer publishes the first version after its first step"
                    )
            else:
                result = (version, self._series.fetch(version, dest))
            span.set_attribute("weights.version", result[0])
            span.set_attribute("storage.bytes", result[1].total_bytes)
            return result


def publish_weights(
    store: ArtifactStore,
    version: int,
    local_dir: str | os.PathLike[str],
    *,
    prefix: str = "weights",
    metadata: dict[str, Any] | None = None,
) -> Manifest:
    """Publish one weight version (see :class:`WeightRegistry`)."""
    return WeightRegistry(store, prefix).publish(version, local_dir, metadata)


def fetch_weights(
    store: ArtifactStore,
    version: int | Literal["latest"],
    dest: str | os.PathLike[str],
    *,
    prefix: str = "weights",
) -> tuple[int, Manifest]:
    """Fetch one weight version, or the newest that verifies (see :class:`WeightRegistry`)."""
    return WeightRegistry(store, prefix).fetch(version, dest)
