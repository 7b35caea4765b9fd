"""Where task records come from: JSONL, Parquet and Arrow files, local or in S3 (MinIO).

A domain's ``dataset`` (and ``evalDataset``, ``evaluation.regressionDataset``) may be

* ``path/tasks.jsonl`` or ``s3://bucket/key.jsonl``: one JSON object per line; from S3 the
  object is read as it streams in, line by line, never held whole in memory;
* ``path/tasks.parquet`` or ``s3://bucket/key.parquet``: columns ``prompt`` and ``answer``
  and/or ``tests`` (plus optional ``domain``, ``difficulty``, ``verifier`` and any extra
  columns, which reach the verifier as task fields). Parquet keeps its index at the end of
  the file, so an S3 object is first downloaded (digest-checked) to a temporary file; rows
  are then read one row group at a time;
* ``path/tasks.arrow`` / ``.feather`` (Arrow IPC file, e.g. what ``datasets`` caches) with
  the same columns, read one record batch at a time.

Every record goes through :func:`posttrain.trainer.data.datasets.parse_task_record`, so all
formats fail the same way on a bad row (``file:row: what is wrong``). A Parquet or Arrow
file without a required column fails before any row is read, naming the column and the file.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from posttrain.errors import UsageError

COLUMNAR_SUFFIXES = (".parquet", ".arrow", ".feather")
REQUIRED_COLUMN = "prompt"
ANSWER_COLUMNS = ("answer", "tests")  # at least one of them


def is_remote(source: str) -> bool:
    return source.startswith("s3://")


def _split_s3(source: str) -> tuple[str, str]:
    """(``s3://bucket``, key) of an object URI.

    >>> _split_s3("s3://data/sets/a.jsonl")
    ('s3://data', 'sets/a.jsonl')
    """
    bucket, _, key = source.removeprefix("s3://").partition("/")
    if not bucket or not key:
        raise UsageError(f"dataset {source!r} names no object; use s3://BUCKET/PATH/FILE.jsonl")
    return f"s3://{bucket}", key


def _open_s3(source: str) -> tuple[Any, str]:
    from posttrain.storage.store import open_store

    root, key = _split_s3(source)
    store = open_store(root, create_bucket=False)
    return store, key


def iter_records(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, record)`` for every task record of ``source``; ``where`` is ``file:line``
    (JSONL) or ``file:row`` (Parquet, Arrow), counting from 1."""
    suffix = Path(source.split("?", 1)[0]).suffix.lower()
    if suffix in COLUMNAR_SUFFIXES:
        yield from _columnar_records(source, suffix)
    else:
        yield from _jsonl_records(source)


def _jsonl_lines(source: str) -> Iterator[str]:
    if is_remote(source):
        store, key = _open_s3(source)
        pending = b""
        for chunk in store.iter_chunks(key):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.decode("utf-8")
        if pending:
            yield pending.decode("utf-8")
        return
    path = Path(source)
    if not path.is_file():
        raise UsageError(
            f"task file {source!r} does not exist; pass a JSONL, Parquet or Arrow "
            "file path or an s3:// URI"
        )
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            yield line.rstrip("\n")


def _jsonl_records(source: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for lineno, line in enumerate(_jsonl_lines(source), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"{where}: not valid JSON ({exc.msg}); each line must be one object"
            ) from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield where, record


def check_columns(columns: list[str], source: str) -> None:
    """Fail naming the file and the missing column before any row is read.

    >>> check_columns(["prompt", "answer"], "a.parquet")
    >>> check_columns(["question", "answer"], "a.parquet")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    posttrain.errors.UsageError: a.parquet: no column 'prompt' (columns: question, answer)...
    """
    if REQUIRED_COLUMN not in columns:
        raise UsageError(
            f"{source}: no column {REQUIRED_COLUMN!r} (columns: {', '.join(columns)}); "
            "a task table needs 'prompt' and 'answer' or 'tests'"
        )
    if not any(c in columns for c in ANSWER_COLUMNS):
        raise UsageError(
            f"{source}: no column 'answer' or 'tests' (columns: {', '.join(columns)}); each "
            "task needs an answer (numeric, exact, ...) or tests (Python asserts)"
        )


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError:
        raise UsageError(
            "Parquet and Arrow datasets need pyarrow, which is not installed; install it with: "
            "pip install 'posttrain[train]'"
        ) from None
    return pyarrow


def _columnar_records(source: str, suffix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if not is_remote(source):
        if not Path(source).is_file():
            raise UsageError(f"task file {source!r} does not exist")
        yield from _read_columnar(Path(source), source, suffix)
        return
    store, key = _open_s3(source)
    with tempfile.TemporaryDirectory(prefix="posttrain-dataset-") as tmp:
        local = Path(tmp) / Path(key).name
        store.get_file(key, local)
        yield from _read_columnar(local, source, suffix)


def _read_columnar(path: Path, source: str, suffix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    pa = _pyarrow()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
        except pa.ArrowInvalid as exc:
            raise UsageError(f"{source}: not a readable Parquet file ({exc})") from None
        check_columns(parquet.schema_arrow.names, source)
        batches = parquet.iter_batches(batch_size=4096)
    else:
        import pyarrow.ipc as ipc

        try:
            reader = ipc.open_file(pa.memory_map(str(path)))
        except pa.ArrowInvalid as exc:
            raise UsageError(f"{source}: not a readable Arrow IPC file ({exc})") from None
        check_columns(reader.schema.names, source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    row = 0
    for batch in batches:
        for record in batch.to_pylist():  # one row group / record batch in memory at a time
            row += 1
            yield f"{source}:{row}", {k: v for k, v in record.items() if v is not None}
