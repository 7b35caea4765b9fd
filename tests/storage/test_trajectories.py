"""TrajectoryWriter: batched zstd chunks, spooling through outages, exactly-once records."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard
from prometheus_client import REGISTRY

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.process import wait_for
from posttrain.storage.errors import CorruptArtifactError, SpoolNotDrainedError
from posttrain.storage.retry import RetryPolicy
from posttrain.storage.store import ArtifactStore, LocalStore, S3Store
from posttrain.storage.trajectories import (
    ATTEMPT_FIELD,
    TrajectoryWriter,
    export_spot_check,
    list_chunks,
    read_trajectories,
)


def record(i: int) -> dict[str, object]:
    return {
        "id": i,
        "prompt": f"What is {i} + {i}?",
        "completion": f"The answer is {2 * i}.",
        "prompt_token_ids": [7, 8],
        "completion_token_ids": [1, 2, 3, i],
        "completion_logprobs": [-0.1, -0.2, -0.3, -0.4],
        "weight_version": i // 10,
        "domain": "math" if i % 2 else "code",
        "reward": 1.0 if i % 3 else 0.0,
        "verifier": {"expected": str(2 * i), "matched": bool(i % 3)},
        "step": i // 5,
    }


def ids(records: object) -> list[int]:
    return [r["id"] for r in records]  # type: ignore[attr-defined]


def test_records_round_trip_in_compressed_chunks(store: ArtifactStore, tmp_path: Path) -> None:
    with TrajectoryWriter(
        store, "runs/ns/a/trajectories", tmp_path / "spool", flush_every=10, writer_id="trainer-0"
    ) as writer:
        for i in range(25):
            writer.append(record(i))
    keys = list_chunks(store, "runs/ns/a/trajectories")
    assert keys == [
        f"runs/ns/a/trajectories/part-trainer-0-{seq:08d}.jsonl.zst" for seq in range(3)
    ]
    first = store.get_bytes(keys[0])
    assert first[:4] == b"\x28\xb5\x2f\xfd"  # zstd frame magic
    lines = zstandard.ZstdDecompressor().decompress(first).decode().splitlines()
    assert len(lines) == 10 and json.loads(lines[0]) == {**record(0), ATTEMPT_FIELD: writer.attempt}
    assert list(read_trajectories(store, "runs/ns/a/trajectories")) == [
        {**record(i), ATTEMPT_FIELD: writer.attempt} for i in range(25)
    ]
    assert writer.spooled_chunks() == []
    assert (
        REGISTRY.get_sample_value("posttrain_trajectory_spooled_chunks", {"writer": "trainer-0"})
        == 0
    )


def test_restarted_writer_continues_numbering(store: ArtifactStore, tmp_path: Path) -> None:
    for attempt in range(2):
        # A rescheduled pod: same writer id, fresh (emptyDir) spool directory.
        with TrajectoryWriter(
            store, "traj", tmp_path / f"spool-{attempt}", flush_every=4, writer_id="w"
        ) as writer:
            for i in range(attempt * 10, attempt * 10 + 10):
                writer.append(record(i))
    assert [k.rsplit("-", 1)[-1] for k in list_chunks(store, "traj")] == [
        f"{seq:08d}.jsonl.zst" for seq in range(6)
    ]
    assert ids(read_trajectories(store, "traj")) == list(range(20))


def test_invalid_records_are_rejected_at_append(tmp_path: Path) -> None:
    with TrajectoryWriter(
        LocalStore(tmp_path / "s"), "t", tmp_path / "spool", writer_id="w"
    ) as writer:
        with pytest.raises(ValueError, match=r"lacks required field\(s\) \['reward'\]"):
            writer.append({"prompt": "p", "completion": "c"})
        with pytest.raises(ValueError, match="not JSON-serialisable"):
            writer.append({"prompt": "p", "completion": "c", "reward": object()})
        with pytest.raises(TypeError, match="must be a dict"):
            writer.append(["p"])  # type: ignore[arg-type]


def test_one_live_writer_per_spool_and_id(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    with TrajectoryWriter(store, "t", tmp_path / "spool", writer_id="w"):
        with pytest.raises(RuntimeError, match="another TrajectoryWriter with writer_id='w'"):
            TrajectoryWriter(store, "t", tmp_path / "spool", writer_id="w")
        TrajectoryWriter(store, "t", tmp_path / "spool", writer_id="w2").close()


def test_corrupt_chunk_is_reported(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    store.put_bytes("t/part-w-00000000.jsonl.zst", b"not zstd at all")
    with pytest.raises(CorruptArtifactError, match=r"part-w-00000000\.jsonl\.zst is unreadable"):
        list(read_trajectories(store, "t"))


def test_spot_check_export_is_deterministic_and_readable(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    with TrajectoryWriter(store, "t", tmp_path / "spool", flush_every=7, writer_id="w") as writer:
        for i in range(50):
            writer.append(record(i))
    sample = export_spot_check(store, "t", 5, seed=3, out_path=tmp_path / "a.jsonl")
    again = export_spot_check(store, "t", 5, seed=3, out_path=tmp_path / "b.md")
    other = export_spot_check(store, "t", 5, seed=4, out_path=tmp_path / "c.jsonl")
    assert len(sample) == 5 and sample == again and sample != other
    assert ids(sample) == sorted(ids(sample)) and len(set(ids(sample))) == 5
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == sample
    markdown = (tmp_path / "b.md").read_text()
    assert markdown.startswith("# Trajectory spot check")
    assert markdown.count("\n## ") == 5
    assert sample[0]["prompt"] in markdown and sample[0]["completion"] in markdown
    assert "completion_token_ids: 4 tokens" in markdown and '"matched"' in markdown
    assert len(export_spot_check(store, "t", 500, seed=0, out_path=tmp_path / "all.jsonl")) == 50


@pytest.mark.minio
def test_outage_spools_chunks_and_drains_them_after_restart(
    own_s3_server: MinioServer, tmp_path: Path, s3_store_factory: Callable[..., S3Store]
) -> None:
    store = s3_store_factory(own_s3_server)
    writer = TrajectoryWriter(
        store, "traj", tmp_path / "spool", flush_every=5, writer_id="w", drain_interval_s=0.2
    )
    for i in range(10):
        writer.append(record(i))
    assert writer.spooled_chunks() == []

    own_s3_server.stop()
    started = time.monotonic()
    for i in range(10, 23):
        writer.append(record(i))  # two chunks sealed while storage is down
    writer.flush()  # and a third, partial one
    assert time.monotonic() - started < 5, "appends must not wait for storage"
    assert len(writer.spooled_chunks()) == 3
    assert REGISTRY.get_sample_value("posttrain_trajectory_spooled_chunks", {"writer": "w"}) == 3

    own_s3_server.start()  # same port and data directory
    wait_for(lambda: not writer.spooled_chunks(), 30, "the drain thread to empty the spool")
    writer.append(record(23))
    writer.close()
    assert ids(read_trajectories(store, "traj")) == list(range(24))


@pytest.mark.minio
def test_spool_left_by_a_failed_close_is_uploaded_by_the_next_writer(
    own_s3_server: MinioServer, tmp_path: Path, s3_store_factory: Callable[..., S3Store]
) -> None:
    store = s3_store_factory(own_s3_server)
    own_s3_server.stop()
    writer = TrajectoryWriter(store, "traj", tmp_path / "spool", flush_every=3, writer_id="w")
    for i in range(7):
        writer.append(record(i))
    with pytest.raises(SpoolNotDrainedError) as info:
        writer.close(drain_timeout_s=0.5)
    assert str(tmp_path / "spool") in str(info.value) and "3 trajectory chunk(s)" in str(info.value)

    own_s3_server.start()
    # A restarted process on the same spool dir uploads the leftovers before anything new.
    with TrajectoryWriter(
        store,
        "traj",
        tmp_path / "spool",
        flush_every=3,
        writer_id="w",
        upload_retry=RetryPolicy(max_attempts=5, initial_delay_s=0.1),
    ) as again:
        again.append(record(7))
    # record 7 is step 1 again, by a later attempt: superseded=True shows every upload.
    assert ids(read_trajectories(store, "traj", superseded=True)) == list(range(8))
    # A storage outage plus a kill (issue 31's fourth resume path): the dead attempt's spooled
    # step 1 (records 5, 6) is uploaded by the next process, which sampled step 1 again (7);
    # readers see step 1 once, from the attempt that went on.
    assert ids(read_trajectories(store, "traj")) == [0, 1, 2, 3, 4, 7]


def test_a_step_sampled_again_after_a_resume_is_read_once(
    store: ArtifactStore, tmp_path: Path
) -> None:
    """The trainer died after flushing steps 2-3 whose checkpoint never committed: the next
    attempt resumes from step 1 and samples steps 2-3 again. Readers see each step once, from
    the attempt the surviving model was trained on; the other writer's records are untouched."""

    def step_records(step: int, tag: str) -> list[dict[str, object]]:
        return [
            {"prompt": f"{step}-{i}", "completion": tag, "reward": 0.0, "step": step}
            for i in range(3)
        ]

    with TrajectoryWriter(store, "traj", tmp_path / "spool", flush_every=2, writer_id="rank0") as w:
        for step in (1, 2, 3):
            for r in step_records(step, "first"):
                w.append(r)
    with TrajectoryWriter(store, "traj", tmp_path / "s1", flush_every=2, writer_id="rank1") as w:
        for r in step_records(2, "rank1"):
            w.append(r)
    # The resumed attempt (a new process: fresh spool, as after a pod was rescheduled).
    with TrajectoryWriter(
        store, "traj", tmp_path / "spool2", flush_every=4, writer_id="rank0"
    ) as w:
        for step in (2, 3, 4):
            for r in step_records(step, "again"):
                w.append(r)

    seen = [(r["step"], r["completion"]) for r in read_trajectories(store, "traj")]
    assert (
        seen
        == [(1, "first")] * 3
        + [(2, "again")] * 3
        + [(3, "again")] * 3
        + [(4, "again")] * 3
        + [(2, "rank1")] * 3
    )
    assert len(list(read_trajectories(store, "traj", superseded=True))) == 21
