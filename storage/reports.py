"""Eval reports and plots stored beside the run, under ``<run prefix>/reports/``.

Reports are plain files people open in the MinIO console or fetch with ``mc``; they are not
committed directories (no manifest) because each file stands alone and is safe to
overwrite: the newest eval report simply replaces the previous one of the same name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from posttrain.storage.commit import local_files
from posttrain.storage.store import ArtifactStore, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

REPORTS_DIR = "reports"


class ReportSync:
    """Uploads files to ``<run_prefix>/reports/<relative path>`` when they are new or changed
    since this object last uploaded them (size and mtime), so a run's outputs reach object
    storage while it runs and outlive its pod, at the cost of re-sending only what changed."""

    def __init__(self, store: ArtifactStore, run_prefix: str = "") -> None:
        self.store = store
        self.run_prefix = run_prefix
        self._sent: dict[str, tuple[int, int]] = {}

    def uri(self) -> str:
        return self.store.uri(join_key(self.run_prefix, REPORTS_DIR))

    def sync(self, files: Iterable[tuple[str, Path]]) -> list[str]:
        """Upload the changed ones of ``files`` (relative path, local path); their keys."""
        keys = []
        with tracer.start_as_current_span("storage.upload_reports") as span:
            total = 0
            for rel, path in files:
                stat = path.stat()
                signature = (stat.st_size, stat.st_mtime_ns)
                if self._sent.get(rel) == signature:
                    continue
                key = join_key(self.run_prefix, REPORTS_DIR, rel)
                total += self.store.put_file(key, path).size
                self._sent[rel] = signature
                keys.append(key)
            span.set_attribute("storage.files", len(keys))
            span.set_attribute("storage.bytes", total)
        if keys:
            log.info("uploaded %d report file(s) to %s", len(keys), self.uri())
        return keys


def upload_reports(
    store: ArtifactStore, run_prefix: str, local_dir: str | os.PathLike[str]
) -> list[str]:
    """Upload every file under ``local_dir`` to ``<run_prefix>/reports/<relative path>``.

    Returns the uploaded keys (sorted), for example
    ``["runs/ns/a/reports/eval-step-12.md", "runs/ns/a/reports/plots/reward.png"]``.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"cannot upload reports from {root}: not a directory")
    return ReportSync(store, run_prefix).sync(local_files(root))


def download_reports(store: ArtifactStore, local_dir: Path, run_prefix: str = "") -> int:
    """Fetch ``<run_prefix>/reports/`` into ``local_dir`` (what ``posttrain report s3://...``
    renders); the number of files."""
    prefix = join_key(run_prefix, REPORTS_DIR) + "/"
    keys = store.list(prefix)
    for key in keys:
        rel = key[len(prefix) :]
        if not rel or ".." in Path(rel).parts:
            continue
        target = local_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, target)
    return len(keys)
