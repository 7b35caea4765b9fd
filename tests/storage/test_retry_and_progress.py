"""The retry loop's bounds and the progress reporter, as plain functions."""

from __future__ import annotations

import hashlib
import io
import logging
import time

import pytest
import xxhash

from posttrain.storage.errors import StorageUnreachableError
from posttrain.storage.progress import PROGRESS_MIN_BYTES, HashingReader, TransferProgress
from posttrain.storage.retry import RetryPolicy, call_with_retry


class FlakyOperation:
    """Fails with ConnectionRefusedError ``failures`` times, then returns "ok"."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionRefusedError("connection refused")
        return "ok"


def _unreachable(exc: BaseException, attempts: int, elapsed: float) -> StorageUnreachableError:
    return StorageUnreachableError(f"gave up after {attempts} attempts: {exc}")


def _retry(fn: FlakyOperation, policy: RetryPolicy) -> str:
    return call_with_retry(
        fn,
        policy=policy,
        is_transient=lambda exc: isinstance(exc, ConnectionError),
        describe="put s3://b/k",
        on_exhausted=_unreachable,
    )


def test_transient_failures_are_retried_until_success(caplog: pytest.LogCaptureFixture) -> None:
    flaky = FlakyOperation(failures=2)
    with caplog.at_level(logging.WARNING):
        assert _retry(flaky, RetryPolicy(initial_delay_s=0.01)) == "ok"
    assert flaky.calls == 3
    assert "put s3://b/k failed (attempt 1/12" in caplog.text


def test_retries_stop_at_max_attempts_and_at_max_elapsed() -> None:
    flaky = FlakyOperation(failures=100)
    with pytest.raises(StorageUnreachableError, match="gave up after 4 attempts"):
        _retry(flaky, RetryPolicy(max_attempts=4, initial_delay_s=0.01))
    assert flaky.calls == 4

    slow = FlakyOperation(failures=100)
    started = time.monotonic()
    with pytest.raises(StorageUnreachableError):
        _retry(slow, RetryPolicy(max_attempts=1000, initial_delay_s=0.1, max_elapsed_s=0.5))
    assert time.monotonic() - started < 1.0  # never sleeps past the elapsed budget


def test_non_transient_errors_are_raised_at_once() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise PermissionError("not a network problem")

    with pytest.raises(PermissionError):
        call_with_retry(
            broken,
            policy=RetryPolicy(),
            is_transient=lambda exc: isinstance(exc, ConnectionError),
            describe="put",
            on_exhausted=_unreachable,
        )
    assert len(calls) == 1


def test_progress_logs_done_and_total_for_large_transfers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    progress = TransferProgress("upload s3://b/ckpt", PROGRESS_MIN_BYTES * 2, interval_s=0)
    with caplog.at_level(logging.INFO, logger="posttrain.storage.progress"):
        progress.update(PROGRESS_MIN_BYTES)
        progress.update(PROGRESS_MIN_BYTES)
    half = next(r.getMessage() for r in caplog.records if "(50%)" in r.getMessage())
    assert half.startswith("upload s3://b/ckpt: 64.0 MiB / 128.0 MiB (50%) at ")
    assert ", ETA " in half  # how long the rest will take, at the rate so far
    assert "128.0 MiB / 128.0 MiB (100%)" in caplog.text

    small = TransferProgress("tiny", 10, interval_s=0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="posttrain.storage.progress"):
        small.update(10)
        small.finish()
    assert caplog.text == ""


def test_hashing_reader_digests_what_it_passes_through() -> None:
    reader = HashingReader(io.BytesIO(b"abc" * 1000), algorithm="sha256")
    assert reader.read(10) + reader.read() == b"abc" * 1000
    assert reader.size == 3000
    assert reader.hasher.hexdigest() == hashlib.sha256(b"abc" * 1000).hexdigest()
    default = HashingReader(io.BytesIO(b"abc" * 1000))
    default.read()
    assert default.hasher.hexdigest() == xxhash.xxh3_128(b"abc" * 1000).hexdigest()
