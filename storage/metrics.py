"""Prometheus metrics for the storage layer (one module-level object per metric).

Scraped from whichever process uses storage (trainer, rollout server, operator) through
``posttrain.telemetry.start_metrics_server``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# Transfers of a few KB up to multi-GB checkpoints: buckets span 10 ms to ~30 min.
_TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)

BYTES_UPLOADED = Counter(
    "posttrain_storage_uploaded_bytes",
    "Bytes written to the artifact store.",
    ["store"],
)
BYTES_DOWNLOADED = Counter(
    "posttrain_storage_downloaded_bytes",
    "Bytes read from the artifact store.",
    ["store"],
)
UPLOAD_SECONDS = Histogram(
    "posttrain_storage_upload_seconds",
    "Wall time of one upload (a single object, or a whole committed directory).",
    ["kind"],
    buckets=_TRANSFER_BUCKETS,
)
DOWNLOAD_SECONDS = Histogram(
    "posttrain_storage_download_seconds",
    "Wall time of one download (a single object, or a whole committed directory).",
    ["kind"],
    buckets=_TRANSFER_BUCKETS,
)
STORAGE_RETRIES = Counter(
    "posttrain_storage_retries",
    "Storage calls retried after a transient failure (connection refused, timeout, 5xx).",
    ["operation"],
)
CORRUPT_ARTIFACTS = Counter(
    "posttrain_storage_corrupt_artifacts",
    "Committed directories refused on load because verification failed.",
    ["kind"],
)
CHECKPOINTS_SAVED = Counter(
    "posttrain_checkpoints_saved",
    "Checkpoints committed (manifest written and latest pointer moved).",
)
CHECKPOINTS_DELETED = Counter(
    "posttrain_checkpoints_deleted",
    "Checkpoints removed by the retention policy.",
)
TRAJECTORY_RECORDS = Counter(
    "posttrain_trajectory_records",
    "Trajectory records appended (sealed into a spooled chunk on flush).",
    ["writer"],
)
TRAJECTORY_CHUNKS_UPLOADED = Counter(
    "posttrain_trajectory_chunks_uploaded",
    "Trajectory chunks uploaded from the local spool.",
    ["writer"],
)
TRAJECTORY_SPOOLED_CHUNKS = Gauge(
    "posttrain_trajectory_spooled_chunks",
    "Trajectory chunks sealed on local disk and not yet uploaded (grows while storage is down).",
    ["writer"],
)
