"""Progress reporting and streaming checksums for large transfers.

A checkpoint of a few GB takes tens of seconds; without progress lines an operator cannot
tell a slow transfer from a hung one. Hashing happens while bytes stream through, so
verifying costs no second pass over the file.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import BinaryIO

from posttrain.progresslog import format_duration
from posttrain.storage.checksums import DEFAULT_CHECKSUM, new_hasher

log = logging.getLogger(__name__)

# Below this a transfer is over before a progress line would help.
PROGRESS_MIN_BYTES = 64 * 1024 * 1024


def format_bytes(count: float) -> str:
    """Human-readable byte count.

    >>> format_bytes(540_000_000)
    '515.0 MiB'
    >>> format_bytes(512)
    '512 B'
    """
    if count < 1024:
        return f"{int(count)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}"
    raise AssertionError("unreachable")


class TransferProgress:
    """Thread-safe byte counter that logs ``done/total`` at most every ``interval_s``.

    Several upload threads call :meth:`update` concurrently; a transfer smaller than
    :data:`PROGRESS_MIN_BYTES` stays silent.
    """

    def __init__(self, label: str, total_bytes: int, interval_s: float = 5.0) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._interval_s = interval_s
        self._start = time.monotonic()
        self._last_log = self._start
        self._lock = threading.Lock()
        self._enabled = total_bytes >= PROGRESS_MIN_BYTES

    def update(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes
            now = time.monotonic()
            if not self._enabled or now - self._last_log < self._interval_s:
                return
            self._last_log = now
            done = self.done_bytes
        self._log(done, now)

    def finish(self) -> None:
        if self._enabled:
            self._log(self.done_bytes, time.monotonic())

    def _log(self, done: int, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = done / elapsed
        remaining = (self.total_bytes - done) / rate if rate > 0 else 0.0
        log.info(
            "%s: %s / %s (%.0f%%) at %s/s%s",
            self.label,
            format_bytes(done),
            format_bytes(self.total_bytes),
            100.0 * done / max(self.total_bytes, 1),
            format_bytes(rate),
            f", ETA {format_duration(remaining)}" if done < self.total_bytes else "",
        )


class HashingReader:
    """File-like wrapper that hashes and counts bytes as the uploader reads them.

    The minio SDK reads multipart parts sequentially from one thread, so the digest is
    the digest of the whole stream in order.
    """

    def __init__(
        self,
        raw: BinaryIO,
        progress: TransferProgress | None = None,
        algorithm: str = DEFAULT_CHECKSUM,
    ) -> None:
        self._raw = raw
        self._progress = progress
        self.algorithm = algorithm
        self.hasher = new_hasher(algorithm)
        self.size = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.hasher.update(data)
        self.size += len(data)
        if self._progress is not None:
            self._progress.update(len(data))
        return data
