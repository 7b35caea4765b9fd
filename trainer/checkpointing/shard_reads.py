"""Each rank reads only its slices of a checkpoint's DCP data files, straight from the store.

A checkpoint written by W ranks holds W DCP data files (``dcp/__<rank>_0.distcp``) that
together are the whole fp32 training state, 16 bytes per parameter: ~1.1 TB for a 70B model.
If every rank of a resuming gang downloaded all of them, a node of 8 GPUs would pull 8 x
1.1 TB onto its disks. Instead restore downloads everything else, and DCP's load plan for
this rank names the ``(file, offset, length)`` of every item it needs; :class:`ShardSource`
fetches just the blocks covering those bytes (one ranged GET per run of blocks), verifies
each against the block index the writer stored beside the file
(:mod:`posttrain.storage.blocks`, itself verified by the manifest), and DCP reads the
resulting sparse local copy. With the same world size a rank fetches its own file plus the
few replicated scalars DCP stored in the others; with a different one, the slices it reshards
from. Checkpoints written before block indexes existed are fetched whole, per file, on first
use, verified against the manifest.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.futures import Future

from posttrain.storage.blocks import BlockIndex, PartialFile, index_path
from posttrain.storage.commit import Manifest, ManifestFile, fetch_file
from posttrain.storage.errors import CorruptArtifactError
from posttrain.storage.progress import TransferProgress
from posttrain.storage.store import ArtifactStore, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

DATA_SUFFIX = ".distcp"


def read_on_demand(path: str, sharded_dir: str) -> bool:
    """True for the files restore leaves in the store: the DCP data files.

    >>> read_on_demand("dcp/__1_0.distcp", "dcp"), read_on_demand("dcp/.metadata", "dcp")
    (True, False)
    """
    return path.startswith(f"{sharded_dir}/") and path.endswith(DATA_SUFFIX)


class ShardSource:
    """Fetches, on demand and verified, the parts of one committed checkpoint's DCP data
    files that this rank's load plan reads, into the local copy of the checkpoint."""

    def __init__(
        self,
        store: ArtifactStore,
        prefix: str,
        manifest: Manifest,
        local_root: Path,
        sharded_dir: str,
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.local_root = local_root
        self.sharded_dir = sharded_dir
        self.entries: dict[str, ManifestFile] = {f.path: f for f in manifest.files}
        self.total_bytes = sum(
            f.size for f in manifest.files if read_on_demand(f.path, sharded_dir)
        )
        self.fetched_bytes = 0
        self._partial: dict[str, PartialFile] = {}
        self._whole: set[str] = set()

    def pending_bytes(self, relative: str, ranges: list[tuple[int, int]]) -> int:
        """Bytes :meth:`ensure` would fetch for these ranges (for progress)."""
        path, entry = self._entry(relative)
        if path in self._whole:
            return 0
        part = self._part(path, entry)
        return part.missing_bytes(ranges) if part is not None else entry.size

    def ensure(
        self,
        relative: str,
        ranges: list[tuple[int, int]],
        progress: TransferProgress | None = None,
    ) -> None:
        """Make the ``(offset, length)`` ranges of DCP file ``relative`` readable locally."""
        path, entry = self._entry(relative)
        if path in self._whole:
            return
        part = self._part(path, entry)
        if part is not None:
            self.fetched_bytes += part.ensure(ranges, progress)
        else:  # written before block indexes: the whole file, verified by the manifest
            fetch_file(self.store, self.prefix, entry, self.local_root, progress)
            self._whole.add(path)
            self.fetched_bytes += entry.size

    def _entry(self, relative: str) -> tuple[str, ManifestFile]:
        path = f"{self.sharded_dir}/{relative}"
        entry = self.entries.get(path)
        if entry is None:
            raise CorruptArtifactError(
                f"{self.store.uri(self.prefix)}: the DCP metadata names {path}, which the "
                "checkpoint's manifest does not list"
            )
        return path, entry

    def _part(self, path: str, entry: ManifestFile) -> PartialFile | None:
        """The sparse local copy of a file with a block index; None for one without."""
        part = self._partial.get(path)
        local = self.local_root / path
        if part is None and index_path(local).is_file():
            index = BlockIndex.read(index_path(local))
            if index.size != entry.size:
                raise CorruptArtifactError(
                    f"{self.store.uri(join_key(self.prefix, path))}: its block index describes "
                    f"{index.size} bytes, the manifest {entry.size}"
                )
            part = self._partial[path] = PartialFile(
                self.store, join_key(self.prefix, path), local, index
            )
        return part


class OnDemandReader(FileSystemReader):
    """DCP's file reader, fetching through a :class:`ShardSource` what each read needs."""

    def __init__(self, path: Path, source: ShardSource) -> None:
        super().__init__(path)
        self.source = source

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        with tracer.start_as_current_span("checkpoint.fetch_shards") as span:
            pending = sum(self.source.pending_bytes(r, w) for r, w in ranges.items())
            progress = TransferProgress(
                f"fetch this rank's slices of {self.source.store.uri(self.source.prefix)}",
                pending,
            )
            for relative, wanted in sorted(ranges.items()):
                self.source.ensure(relative, wanted, progress)
            progress.finish()
            span.set_attribute("storage.bytes", self.source.fetched_bytes)
            span.set_attribute("storage.bytes_total", self.source.total_bytes)
        log.info(
            "fetched %.1f MiB of the checkpoint's %.1f MiB of sharded state (%d file(s) read from)",
            self.source.fetched_bytes / 2**20,
            self.source.total_bytes / 2**20,
            len(ranges),
        )
        return super().read_data(plan, planner)
