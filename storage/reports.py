"""Eval reports and plots stored beside the run, under ``<run prefix>/reports/``.

Reports are plain files people open in the MinIO console or fetch with ``mc``; they are not
committed directories (no manifest) because each file stands alone and is safe to
overwrite: the newest eval report simply replaces the previous one of the same name.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from posttrain.storage.commit import local_files
from posttrain.storage.store import ArtifactStore, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

REPORTS_DIR = "reports"


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
    keys = []
    with tracer.start_as_current_span("storage.upload_reports") as span:
        total = 0
        for rel, path in local_files(root):
            key = join_key(run_prefix, REPORTS_DIR, rel)
            total += store.put_file(key, path).size
            keys.append(key)
        span.set_attribute("storage.files", len(keys))
        span.set_attribute("storage.bytes", total)
    log.info(
        "uploaded %d report file(s) to %s", len(keys), store.uri(join_key(run_prefix, REPORTS_DIR))
    )
    return keys
