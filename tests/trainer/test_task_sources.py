"""Task files beyond local JSONL: Parquet and Arrow (local), JSONL and Parquet streamed from
a real MinIO (s3://), and the errors a bad file gives (naming the column and the file)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from posttrain.errors import UsageError
from posttrain.storage.store import open_store
from posttrain.trainer.data.datasets import load_jsonl_tasks, load_tasks
from posttrain.trainer.data.rundata import domain_tasks

ROWS = [
    {"prompt": "What is 2 + 3?", "answer": "5", "difficulty": "easy"},
    {
        "prompt": "Write f(x) returning x + 1.",
        "tests": "assert f(1) == 2\n",
        "difficulty": "hard",
        "verifier": "unit_tests",
    },
    {"prompt": "What is 7 * 6?", "answer": "42", "difficulty": "hard", "source": "gsm"},
]


def _table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as a table with every column any row has (absent values are nulls)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return pa.Table.from_pylist([{c: row.get(c) for c in columns} for row in rows])


def test_local_parquet_and_arrow_read_like_jsonl(tmp_path: Path) -> None:
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    pq.write_table(_table(ROWS), tmp_path / "t.parquet", row_group_size=2)  # two row groups
    feather.write_feather(_table(ROWS), tmp_path / "t.arrow")
    expected = load_tasks(str(jsonl), "math")
    for name in ("t.parquet", "t.arrow"):
        tasks = load_tasks(str(tmp_path / name), "math")
        assert [t.to_dict() for t in tasks] == [t.to_dict() for t in expected], name
    assert expected[1].tests == "assert f(1) == 2\n" and expected[1].verifier == "unit_tests"
    assert expected[2].extra == {"source": "gsm"}  # extra columns reach the verifier
    assert expected[0].answer == "5" and expected[1].answer is None  # nulls are absent fields


def test_parquet_without_a_required_column_names_it_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pq.write_table(_table([{"question": "What is 1 + 1?", "answer": "2"}]), path)
    with pytest.raises(UsageError) as err:
        load_tasks(str(path), "math")
    assert "'prompt'" in str(err.value) and str(path) in str(err.value)
    assert "question, answer" in str(err.value)  # what the file does have
    no_answer = tmp_path / "no_answer.parquet"
    pq.write_table(_table([{"prompt": "What is 1 + 1?"}]), no_answer)
    with pytest.raises(UsageError, match=r"no_answer\.parquet: no column 'answer' or 'tests'"):
        load_tasks(str(no_answer), "math")


def test_a_bad_row_names_the_file_and_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(_table([ROWS[0], {"prompt": "", "answer": "1"}]), path)
    with pytest.raises(UsageError, match=r"rows\.parquet:2: missing or empty \"prompt\""):
        load_tasks(str(path), "math")
    with pytest.raises(UsageError, match="not a readable Parquet file"):
        (tmp_path / "junk.parquet").write_text("not parquet")
        load_tasks(str(tmp_path / "junk.parquet"), "math")


def test_s3_jsonl_and_parquet_from_minio(minio_env: dict[str, str], tmp_path: Path) -> None:
    bucket = f"data-{uuid.uuid4().hex[:8]}"
    store = open_store(f"s3://{bucket}")
    # More than one 1 MiB chunk, so lines are split across chunk boundaries while streaming.
    lines = [
        json.dumps({"prompt": f"What is {i} + 1? {'pad ' * 32}", "answer": str(i + 1)})
        for i in range(12_000)
    ]
    body = ("\n".join(lines) + "\n").encode()
    assert len(body) > 2 * (1 << 20)
    store.put_bytes("sets/big.jsonl", body)
    parquet = tmp_path / "t.parquet"
    pq.write_table(_table(ROWS), parquet)
    store.put_file("sets/t.parquet", parquet)
    bad = tmp_path / "bad.parquet"
    pq.write_table(_table([{"prompt": "p"}]), bad)
    store.put_file("sets/bad.parquet", bad)

    big = load_jsonl_tasks(f"s3://{bucket}/sets/big.jsonl", default_domain="sums")
    assert len(big) == 12_000 and big[-1].answer == "12000" and big[4321].answer == "4322"
    tasks = load_tasks(f"s3://{bucket}/sets/t.parquet", "math")
    assert [t.prompt for t in tasks] == [r["prompt"] for r in ROWS]
    # A domain whose train and eval sets both live in MinIO (the split stays disjoint).
    train, held = domain_tasks(
        "sums", f"s3://{bucket}/sets/big.jsonl", f"s3://{bucket}/sets/t.parquet"
    )
    assert len(held) == 3 and not {t.task_id for t in train} & {t.task_id for t in held}
    with pytest.raises(UsageError) as err:
        load_tasks(f"s3://{bucket}/sets/bad.parquet", "math")
    assert f"s3://{bucket}/sets/bad.parquet" in str(err.value) and "'answer'" in str(err.value)
