"""MinIO down for ~30 s in the middle of a run: nothing lost, nothing duplicated."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.storage.checkpoints import CheckpointManager
from posttrain.storage.retry import RetryPolicy
from posttrain.storage.store import S3Store
from posttrain.storage.trajectories import TrajectoryWriter, list_chunks, read_trajectories

OUTAGE_S = 30.0


def make_checkpoint(root: Path, step: int) -> Path:
    path = root / f"local-{step}"
    path.mkdir(parents=True, exist_ok=True)
    # 64 MiB in 5 MiB parts: MinIO goes down in the middle of this multipart upload.
    (path / "model.safetensors").write_bytes(os.urandom(64 * 1024 * 1024))
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    return path


@pytest.mark.slow
@pytest.mark.minio
def test_storage_down_30s_mid_run_loses_and_duplicates_nothing(
    own_s3_server: MinioServer,
    tmp_path: Path,
    s3_store_factory: Callable[..., S3Store],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="posttrain.storage.retry")
    # A save must outlast the outage: retry for up to 3 minutes, backing off to 4 s.
    patient = RetryPolicy(
        max_attempts=100, initial_delay_s=0.5, max_delay_s=4.0, max_elapsed_s=180.0
    )
    store = s3_store_factory(
        own_s3_server, prefix="runs/ns/outage", retry=patient, part_size=5 * 1024 * 1024
    )
    checkpoints = CheckpointManager(store, "checkpoints", keep_last=10)
    writer = TrajectoryWriter(
        store,
        "trajectories",
        tmp_path / "spool",
        flush_every=8,
        writer_id="trainer-0",
        drain_interval_s=1.0,
    )

    # The rollout side: appends records continuously, before, during and after the outage.
    appended: list[int] = []
    stop_appending = threading.Event()

    def produce() -> None:
        i = 0
        while not stop_appending.is_set():
            writer.append(
                {"id": i, "prompt": f"p{i}", "completion": f"c{i}", "reward": 1.0, "step": i // 50}
            )
            appended.append(i)
            i += 1
            time.sleep(0.01)

    producer = threading.Thread(target=produce, name="producer")
    producer.start()
    checkpoints.save(1, make_checkpoint(tmp_path, 1))
    time.sleep(1.0)

    # The trainer saves step 2; MinIO dies once the small files have landed, i.e. while the
    # 64 MiB model is mid-multipart. The save keeps retrying in its own thread.
    save_errors: list[BaseException] = []

    def save_step_2() -> None:
        try:
            checkpoints.save(2, make_checkpoint(tmp_path, 2))
        except BaseException as exc:
            save_errors.append(exc)

    probe = store.with_retry(RetryPolicy.no_retry())
    saver = threading.Thread(target=save_step_2, name="saver")
    saver.start()
    deadline = time.monotonic() + 30
    while not probe.exists("checkpoints/step-00000002/trainer_state.json"):
        assert time.monotonic() < deadline, "step 2 upload never started"
        time.sleep(0.005)
    own_s3_server.stop()
    outage_started = time.monotonic()
    time.sleep(OUTAGE_S)
    spooled_during_outage = len(writer.spooled_chunks())
    assert saver.is_alive(), "the save must still be retrying, not have given up"
    own_s3_server.start()  # same port, same data directory
    outage_s = time.monotonic() - outage_started

    saver.join(timeout=120)
    assert not saver.is_alive() and not save_errors, save_errors
    time.sleep(1.0)
    stop_appending.set()
    producer.join()
    checkpoints.save(3, make_checkpoint(tmp_path, 3))
    writer.close(drain_timeout_s=60)

    assert outage_s >= OUTAGE_S
    retried = [r.getMessage() for r in caplog.records if "step-00000002" in r.getMessage()]
    assert retried, "the step 2 save never hit the outage"
    assert spooled_during_outage > 10  # records kept flowing into the spool during the outage
    got = [r["id"] for r in read_trajectories(store, "trajectories")]
    assert got == appended, "every appended record exactly once, in order"
    seqs = [int(k.rsplit("-", 1)[-1].split(".")[0]) for k in list_chunks(store, "trajectories")]
    assert seqs == list(range(len(seqs)))  # no gaps, no re-used names
    assert checkpoints.list_steps() == [1, 2, 3]
    step, _manifest = checkpoints.load_latest(tmp_path / "resume")  # type: ignore[misc]
    assert step == 3 and checkpoints.last_refused == []
    assert checkpoints.load(2, tmp_path / "two").metadata["step"] == 2
