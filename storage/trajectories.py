"""Trajectory logging: append-only, batched, zstd-compressed JSONL chunks that survive outages.

Every rollout the trainer learns from is kept (prompt, completion, token ids, logprobs, the
weight version that sampled it, reward and verifier details) so a run can be audited and
replayed. Records are buffered in memory, sealed ``flush_every`` at a time into a chunk
that is written to a local spool directory and fsynced **before** any upload is tried, then
uploaded as ``<prefix>/part-<writer>-<seq>.jsonl.zst``.

* Storage down: the chunk stays in the spool; a background thread (and every later
  flush/close) drains the spool oldest first once storage answers again. Appends never wait
  for storage.
* No duplicates: a chunk's name is fixed when it is sealed and its bytes never change, so
  re-uploading after a lost response overwrites the object with identical content.
* Restarts: the next sequence number is recovered from the spool, a small state file and
  the store's listing, so a restarted writer never reuses a name.
* Exactly once per step: a trainer that dies after a step's records were flushed but before
  that step's checkpoint committed samples the step again when it resumes. Each writer
  stamps its records with ``writer_attempt`` (when the writer started, ns since the epoch),
  and :func:`read_trajectories` keeps, for each (writer, step), only the newest attempt's
  records: the ones the surviving model was trained on.

The durability point is :meth:`TrajectoryWriter.flush`: records appended since the last
flush live only in memory (a crash there loses at most ``flush_every`` records, which the
trainer regenerates when it resumes from its checkpoint).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import zstandard

from posttrain.storage.errors import CorruptArtifactError, SpoolNotDrainedError, StorageError
from posttrain.storage.metrics import (
    TRAJECTORY_CHUNKS_UPLOADED,
    TRAJECTORY_RECORDS,
    TRAJECTORY_SPOOLED_CHUNKS,
)
from posttrain.storage.retry import RetryPolicy
from posttrain.storage.store import ArtifactStore, fsync_dir, join_key
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

CHUNK_SUFFIX = ".jsonl.zst"
ATTEMPT_FIELD = "writer_attempt"
"""Stamped on every record by its writer: the writer's start time, ns since the epoch."""
REQUIRED_FIELDS = ("prompt", "completion", "reward")
_CHUNK_RE = re.compile(r"part-(?P<writer>[A-Za-z0-9_.-]+)-(?P<seq>\d{8,})\.jsonl\.zst")
_WRITER_ID_RE = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def chunk_name(writer_id: str, seq: int) -> str:
    """
    >>> chunk_name("trainer-0", 12)
    'part-trainer-0-00000012.jsonl.zst'
    """
    return f"part-{writer_id}-{seq:08d}{CHUNK_SUFFIX}"


def parse_chunk_name(name: str) -> tuple[str, int] | None:
    """``(writer, seq)`` of a chunk file name, None for anything else.

    >>> parse_chunk_name("part-trainer-0-00000012.jsonl.zst")
    ('trainer-0', 12)
    """
    match = _CHUNK_RE.fullmatch(name)
    return (match.group("writer"), int(match.group("seq"))) if match else None


def encode_record(record: dict[str, Any]) -> str:
    """Validate a record and serialise it as one JSON line (no trailing newline).

    >>> encode_record({"prompt": "1+1=", "completion": "2", "reward": 1.0})
    '{"prompt":"1+1=","completion":"2","reward":1.0}'
    """
    if not isinstance(record, dict):
        raise TypeError(f"a trajectory record must be a dict, got {type(record).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in record]
    if missing:
        raise ValueError(
            f"trajectory record lacks required field(s) {missing}; it has {sorted(record)}"
        )
    try:
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"trajectory record is not JSON-serialisable ({exc}); convert tensors "
            "with .tolist() and numbers with float()/int()"
        ) from None


def default_writer_id() -> str:
    """The pod name (hostname), made safe for object names: stable across container restarts."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:100] or "writer"


class TrajectoryWriter:
    """Append trajectory records; flushes spool chunks locally and uploads them in order.

    Use one writer per process (``writer_id`` distinguishes processes sharing a prefix);
    a lock file stops two live writers from using the same spool directory and id.
    """

    def __init__(
        self,
        store: ArtifactStore,
        prefix: str,
        spool_dir: str | os.PathLike[str],
        *,
        flush_every: int = 256,
        writer_id: str | None = None,
        drain_interval_s: float = 5.0,
        compression_level: int = 3,
        upload_retry: RetryPolicy | None = None,
    ) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.writer_id = writer_id or default_writer_id()
        if not _WRITER_ID_RE.match(self.writer_id):
            raise ValueError(f"writer_id {self.writer_id!r} may only use letters, digits, '_-.'")
        # Uploads fail fast: the spool is the retry buffer, the drain thread the retry loop.
        self._store = store.with_retry(upload_retry or RetryPolicy.no_retry())
        self.prefix = prefix.strip("/")
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.flush_every = flush_every
        self._drain_interval_s = drain_interval_s
        self._compressor = zstandard.ZstdCompressor(level=compression_level)
        self._lock_file = self._acquire_lock()
        self._buffer: list[str] = []
        self._buffer_lock = threading.Lock()  # guards _buffer and _next_seq
        self._drain_lock = threading.Lock()  # one upload pass at a time
        self._storage_down_since: float | None = None
        self._gauge = TRAJECTORY_SPOOLED_CHUNKS.labels(writer=self.writer_id)
        self._records_counter = TRAJECTORY_RECORDS.labels(writer=self.writer_id)
        self._uploaded_counter = TRAJECTORY_CHUNKS_UPLOADED.labels(writer=self.writer_id)
        self._next_seq = self._recover_next_seq()
        # Later than any record an earlier process of this writer stamped (see the module doc).
        self.attempt = time.time_ns()
        self._gauge.set(len(self.spooled_chunks()))
        self._closed = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(
            target=self._drain_loop, name=f"trajectory-drain-{self.writer_id}", daemon=True
        )
        self._thread.start()
        if self.spooled_chunks():
            self._wake.set()  # leftovers from a previous run: upload them now

    # -- public API

    def append(self, record: dict[str, Any]) -> None:
        """Buffer one record; every ``flush_every`` records are sealed and uploaded."""
        if isinstance(record, dict) and ATTEMPT_FIELD not in record:
            record = {**record, ATTEMPT_FIELD: self.attempt}
        line = encode_record(record)
        with self._buffer_lock:
            if self._closed:
                raise RuntimeError("append() on a closed TrajectoryWriter")
            self._buffer.append(line)
            full = len(self._buffer) >= self.flush_every
        if full:
            self.flush()

    def flush(self) -> None:
        """Seal buffered records into a durable spool chunk, then try to upload the spool.

        Never raises because storage is down: the chunk stays spooled for the drain thread.
        """
        with self._buffer_lock:
            self._seal_locked()
        self._drain(blocking=False)

    def close(self, drain_timeout_s: float = 60.0) -> None:
        """Flush, stop the drain thread, and keep draining for up to ``drain_timeout_s``.

        Raises :class:`SpoolNotDrainedError` if chunks are still spooled afterwards; they
        stay on disk and the next writer with this spool dir and writer id uploads them.
        """
        with self._buffer_lock:
            if self._closed:
                return
            self._seal_locked()
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join()
        deadline = time.monotonic() + drain_timeout_s
        delay = 0.25
        try:
            while not self._drain(blocking=True) and time.monotonic() < deadline:
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 5.0)
            left = self.spooled_chunks()
            if left:
                raise SpoolNotDrainedError(
                    f"{len(left)} trajectory chunk(s) could not be uploaded to "
                    f"{self._store.uri(self.prefix)} within {drain_timeout_s:.0f}s; they are safe "
                    f"in {self.spool_dir} and a TrajectoryWriter with writer_id="
                    f"{self.writer_id!r} on that spool dir will upload them"
                )
        finally:
            self._release_lock()

    def spooled_chunks(self) -> list[Path]:
        """This writer's sealed chunks not yet uploaded, oldest first."""
        found = []
        for path in self.spool_dir.iterdir():
            parsed = parse_chunk_name(path.name)
            if parsed and parsed[0] == self.writer_id:
                found.append((parsed[1], path))
        return [path for _, path in sorted(found)]

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- sealing

    def _seal_locked(self) -> Path | None:
        """Write the buffer as the next chunk: temp file, fsync, rename, fsync dir, seq state."""
        if not self._buffer:
            return None
        seq = self._next_seq
        payload = ("\n".join(self._buffer) + "\n").encode()
        compressed = self._compressor.compress(payload)
        final = self.spool_dir / chunk_name(self.writer_id, seq)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "wb") as out:
            out.write(compressed)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, final)
        fsync_dir(self.spool_dir)
        self._next_seq = seq + 1
        self._write_seq_state(self._next_seq)
        self._records_counter.inc(len(self._buffer))
        self._buffer = []
        self._gauge.inc()
        return final

    # -- draining

    def _drain(self, *, blocking: bool) -> bool:
        """Upload spooled chunks oldest first; True when the spool is empty afterwards."""
        if not self._drain_lock.acquire(blocking=blocking):
            # A pass is running and may have listed the spool before our chunk was sealed:
            # ask the drain thread for another pass right after it.
            self._wake.set()
            return False
        try:
            chunks = self.spooled_chunks()
            if not chunks:
                return True
            with tracer.start_as_current_span("trajectories.drain") as span:
                span.set_attribute("storage.files", len(chunks))
                uploaded_bytes = 0
                for path in chunks:
                    key = join_key(self.prefix, path.name)
                    try:
                        digest = self._store.put_file(key, path)
                    except StorageError as exc:
                        self._note_outage(exc, len(chunks))
                        span.set_attribute("trajectories.left", len(self.spooled_chunks()))
                        return False
                    path.unlink()  # after a crash right before this, re-upload is identical
                    uploaded_bytes += digest.size
                    self._uploaded_counter.inc()
                    self._gauge.dec()
                span.set_attribute("storage.bytes", uploaded_bytes)
            if self._storage_down_since is not None:
                log.info(
                    "trajectory storage %s is back after %.0fs; spool drained",
                    self._store.uri(self.prefix),
                    time.monotonic() - self._storage_down_since,
                )
                self._storage_down_since = None
            return True
        finally:
            self._drain_lock.release()

    def _note_outage(self, exc: StorageError, pending: int) -> None:
        """Log the first failure of an outage loudly, later ones quietly."""
        if self._storage_down_since is None:
            self._storage_down_since = time.monotonic()
            log.warning(
                "trajectory upload failed, keeping %d chunk(s) spooled in %s and retrying every "
                "%.0fs: %s",
                pending,
                self.spool_dir,
                self._drain_interval_s,
                exc,
            )
        else:
            log.debug("trajectory storage still down (%d chunks spooled): %s", pending, exc)

    def _drain_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._drain_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._drain(blocking=True)
            except Exception:  # keep the thread alive: the spool must keep draining
                log.exception(
                    "trajectory drain pass failed; retrying in %.0fs", self._drain_interval_s
                )

    # -- restart safety

    def _seq_state_path(self) -> Path:
        return self.spool_dir / f"writer-{self.writer_id}.seq"

    def _write_seq_state(self, next_seq: int) -> None:
        state = self._seq_state_path()
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(str(next_seq))
        os.replace(tmp, state)  # the chunk file itself is durable; this is a fast hint

    def _recover_next_seq(self) -> int:
        """One past the highest sequence number seen in the state file, spool or store."""
        candidates = [0]
        with contextlib.suppress(FileNotFoundError, ValueError):
            candidates.append(int(self._seq_state_path().read_text().strip()))
        candidates += [parse_chunk_name(p.name)[1] + 1 for p in self.spooled_chunks()]  # type: ignore[index]
        try:
            uploaded = self._store.list(join_key(self.prefix, f"part-{self.writer_id}-"))
        except StorageError as exc:
            log.warning(
                "cannot list %s to resume chunk numbering (%s); using the local spool state",
                self._store.uri(self.prefix),
                exc,
            )
            uploaded = []
        for key in uploaded:
            parsed = parse_chunk_name(key.rsplit("/", 1)[-1])
            if parsed and parsed[0] == self.writer_id:
                candidates.append(parsed[1] + 1)
        return max(candidates)

    def _acquire_lock(self) -> Any:
        path = self.spool_dir / f"writer-{self.writer_id}.lock"
        handle = open(path, "a")  # noqa: SIM115 - held for the writer's lifetime
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RuntimeError(
                f"another TrajectoryWriter with writer_id={self.writer_id!r} is using spool dir "
                f"{self.spool_dir}; give each process its own writer_id"
            ) from None
        return handle

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


# --------------------------------------------------------------------------- reading


def list_chunks(store: ArtifactStore, prefix: str) -> list[str]:
    """Chunk keys under ``prefix`` ordered by (writer, sequence number)."""
    keyed = []
    for key in store.list(prefix.strip("/") + "/"):
        parsed = parse_chunk_name(key.rsplit("/", 1)[-1])
        if parsed:
            keyed.append((parsed, key))
    return [key for _, key in sorted(keyed)]


def read_trajectories(
    store: ArtifactStore, prefix: str, *, superseded: bool = False
) -> Iterator[dict[str, Any]]:
    """Every record under ``prefix``, chunk by chunk in (writer, sequence) order.

    A step sampled again after a resume is returned once: for each (writer, ``step``) only
    the records of the newest ``writer_attempt`` are kept (``superseded=True`` keeps all).
    Records without a ``step`` or an attempt stamp are always kept. Reads the chunks twice:
    the first pass finds each step's newest attempt.
    """
    keys = list_chunks(store, prefix)
    newest: dict[tuple[str, Any], int] = {}
    if not superseded:
        for key in keys:
            writer = _chunk_writer(key)
            for record in _read_chunk(store, key):
                if "step" in record and ATTEMPT_FIELD in record:
                    slot = (writer, record["step"])
                    newest[slot] = max(newest.get(slot, 0), int(record[ATTEMPT_FIELD]))
    for key in keys:
        writer = _chunk_writer(key)
        for record in _read_chunk(store, key):
            slot = (writer, record.get("step"))
            if slot in newest and int(record.get(ATTEMPT_FIELD, 0)) < newest[slot]:
                continue  # an earlier attempt at a step that was sampled again
            yield record


def _chunk_writer(key: str) -> str:
    parsed = parse_chunk_name(key.rsplit("/", 1)[-1])
    assert parsed is not None  # list_chunks returns parseable names only
    return parsed[0]


def _read_chunk(store: ArtifactStore, key: str) -> list[dict[str, Any]]:
    data = store.get_bytes(key)
    try:
        text = zstandard.ZstdDecompressor().decompressobj().decompress(data).decode()
        return [json.loads(line) for line in text.splitlines() if line]
    except (zstandard.ZstdError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptArtifactError(
            f"trajectory chunk {store.uri(key)} is unreadable: {exc}"
        ) from None


def sample_records(records: Iterator[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """A uniform sample of ``n`` records in one pass (reservoir sampling), in stream order.

    >>> sample_records(iter([{"i": i} for i in range(3)]), 5, seed=0)
    [{'i': 0}, {'i': 1}, {'i': 2}]
    """
    rng = random.Random(seed)
    reservoir: list[tuple[int, dict[str, Any]]] = []
    for index, record in enumerate(records):
        if len(reservoir) < n:
            reservoir.append((index, record))
        else:
            slot = rng.randint(0, index)
            if slot < n:
                reservoir[slot] = (index, record)
    return [record for _, record in sorted(reservoir, key=lambda item: item[0])]


def export_spot_check(
    store: ArtifactStore, prefix: str, n: int, seed: int, out_path: str | os.PathLike[str]
) -> list[dict[str, Any]]:
    """Write a random sample of ``n`` records for humans to read: Markdown for ``*.md``,
    otherwise JSONL. Returns the sampled records."""
    sample = sample_records(read_trajectories(store, prefix), n, seed)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".md":
        out.write_text(render_markdown(sample, source=store.uri(prefix), seed=seed))
    else:
        out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sample))
    log.info("wrote %d sampled trajectories from %s to %s", len(sample), store.uri(prefix), out)
    return sample


def _fence(text: str, lang: str = "text") -> str:
    """A Markdown code block that survives backticks inside ``text``.

    >>> _fence("a ``` b")
    '````text\\na ``` b\\n````'
    """
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text}\n{ticks}"


def _summarise_numbers(values: Sequence[float]) -> str:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    if not finite:
        return f"{len(values)} values"
    return f"{len(values)} values, mean {sum(finite) / len(finite):.3f}, min {min(finite):.3f}"


def render_markdown(records: list[dict[str, Any]], *, source: str, seed: int) -> str:
    """Readable report of sampled trajectories (token ids and logprobs summarised)."""
    lines = [
        f"# Trajectory spot check\n\n{len(records)} records sampled from `{source}` "
        f"(seed {seed}).\n"
    ]
    shown = {
        "prompt", "completion", "verifier",
        "prompt_token_ids", "completion_token_ids", "completion_logprobs",
    }  # fmt: skip
    for number, record in enumerate(records, 1):
        facts = ", ".join(
            f"{k}={record[k]}"
            for k in ("domain", "reward", "step", "weight_version")
            if k in record
        )
        lines.append(f"## {number}. {facts}\n")
        lines.append(f"**Prompt**\n\n{_fence(str(record.get('prompt', '')))}\n")
        lines.append(f"**Completion**\n\n{_fence(str(record.get('completion', '')))}\n")
        if "verifier" in record:
            verifier = json.dumps(record["verifier"], indent=2, ensure_ascii=False)
            lines.append(f"**Verifier**\n\n{_fence(verifier, 'json')}\n")
        for key in ("prompt_token_ids", "completion_token_ids"):
            if key in record:
                lines.append(f"- {key}: {len(record[key])} tokens")
        if "completion_logprobs" in record:
            lines.append(
                f"- completion_logprobs: {_summarise_numbers(record['completion_logprobs'])}"
            )
        extra = {
            k: v
            for k, v in record.items()
            if k not in shown and k not in ("domain", "reward", "step", "weight_version")
        }
        if extra:
            lines.append(f"- other fields: `{json.dumps(extra, ensure_ascii=False)[:500]}`")
        lines.append("")
    return "\n".join(lines)
