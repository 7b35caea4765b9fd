"""Checkpoint save/load through CheckpointManager vs raw minio-SDK transfers of the same bytes.

What CheckpointManager adds over a plain ``fput_object``/``fget_object`` is integrity: a
sha256 per file, a manifest written last, a pointer update, and verification plus an
atomic swap of the destination on load. This measures what that costs, in one run, on one
MinIO, with the same synthetic safetensors-like checkpoint (the 135M model in fp32 is
~540 MB). Goal: CheckpointManager at >= 0.8x the raw throughput.

    .venv/bin/python bench/checkpoint_throughput.py               # ~540 MB, local MinIO
    .venv/bin/python bench/checkpoint_throughput.py --size-gb 2
    .venv/bin/python bench/checkpoint_throughput.py --endpoint host:9000 --bucket b \\
        --access-key ... --secret-key ...                          # an existing MinIO/S3

Two raw baselines are reported: the SDK's defaults (what a user would write first) and the
SDK with the same multipart settings our store uses (isolating the cost of integrity).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from posttrain.storage.checkpoints import CheckpointManager
from posttrain.storage.store import DEFAULT_PARALLEL_PARTS, DEFAULT_PART_SIZE, S3Store

MB = 1_000_000
CHUNK = 64 * 1024 * 1024


def write_safetensors_like(path: Path, size_bytes: int) -> None:
    """A file with a safetensors header (8-byte length + JSON) and random fp32 payload.

    Random bytes, so neither MinIO nor anything on the way can compress or dedupe them.
    """
    payload = size_bytes - 1024
    header = json.dumps({
        "__metadata__": {"format": "pt"},
        "model.weight": {"dtype": "F32", "shape": [payload // 4], "data_offsets": [0, payload]},
    }).encode().ljust(1024 - 8, b" ")
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header)) + header)
        left = payload
        while left:
            n = min(CHUNK, left)
            out.write(os.urandom(n))
            left -= n


def make_checkpoint_dir(root: Path, size_bytes: int) -> Path:
    ckpt = root / "checkpoint"
    ckpt.mkdir(parents=True)
    write_safetensors_like(ckpt / "model.safetensors", size_bytes)
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 576, "num_hidden_layers": 30}))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    return ckpt


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="posttrain-bench-", dir=args.work_dir))
    server = None
    if args.endpoint:
        endpoint, access_key, secret_key = args.endpoint, args.access_key, args.secret_key
    else:
        from posttrain.devenv.minio import MinioServer

        server = MinioServer(data_dir=work / "minio").start()
        endpoint, access_key, secret_key = server.endpoint, server.access_key, server.secret_key
    try:
        store = S3Store(endpoint, args.bucket or f"bench-{uuid.uuid4().hex[:8]}", "bench",
                        access_key=access_key, secret_key=secret_key, secure=args.secure)
        client, bucket = store.client, store.bucket
        size = int(args.size_gb * 1e9)
        ckpt = make_checkpoint_dir(work, size)
        files = sorted(p for p in ckpt.iterdir())
        total = sum(p.stat().st_size for p in files)
        print(f"checkpoint: {len(files)} files, {total / MB:.0f} MB in {work}; MinIO at "
              f"{endpoint}; {args.repeats} repeats, median reported; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f} at start")

        def raw_save(part_size: int, parallel: int) -> Callable[[], None]:
            def go() -> None:
                for p in files:
                    client.fput_object(bucket, f"bench/raw/{p.name}", str(p),
                                       part_size=part_size, num_parallel_uploads=parallel)
            return go

        def raw_load() -> None:
            dest = work / "raw-dest"
            shutil.rmtree(dest, ignore_errors=True)
            for p in files:
                client.fget_object(bucket, f"bench/raw/{p.name}", str(dest / p.name))

        manager = CheckpointManager(store, "ckpt", keep_last=1)
        step = iter(range(1, 10_000))

        def ours_save() -> None:
            manager.save(next(step), ckpt)

        def ours_load() -> None:
            manager.load_latest(work / "ours-dest")

        results: dict[str, list[float]] = {name: [] for name in (
            "raw save (SDK defaults)", "raw save (our part size)", "ours save",
            "raw load (fget_object)", "ours load (verified)")}
        for _ in range(args.repeats):
            # Interleaved so drift (page cache, MinIO compaction) hits every variant alike.
            results["raw save (SDK defaults)"].append(timed(raw_save(0, 3)))
            results["raw save (our part size)"].append(
                timed(raw_save(DEFAULT_PART_SIZE, DEFAULT_PARALLEL_PARTS)))
            results["ours save"].append(timed(ours_save))
            results["raw load (fget_object)"].append(timed(raw_load))
            results["ours load (verified)"].append(timed(ours_load))

        rate = {name: total / MB / statistics.median(times) for name, times in results.items()}
        print("\n| transfer | median s | MB/s |\n|---|---|---|")
        for name, times in results.items():
            print(f"| {name} | {statistics.median(times):.2f} | {rate[name]:.0f} |")
        save_vs_default = rate["ours save"] / rate["raw save (SDK defaults)"]
        save_vs_tuned = rate["ours save"] / rate["raw save (our part size)"]
        load_ratio = rate["ours load (verified)"] / rate["raw load (fget_object)"]
        print(f"\nsave ratio ours/raw: {save_vs_default:.2f}x vs SDK defaults, "
              f"{save_vs_tuned:.2f}x vs same part size (goal >= 0.8x)")
        print(f"load ratio ours/raw: {load_ratio:.2f}x (goal >= 0.8x)")
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    finally:
        if server is not None:
            server.destroy()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.54,
                        help="checkpoint size in GB (0.54 = SmolLM2-135M in fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", help="existing MinIO host:port (default: start one)")
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    parser.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    parser.add_argument("--bucket", help="bucket to use (default: a fresh one)")
    parser.add_argument("--secure", action="store_true", help="TLS to --endpoint")
    parser.add_argument("--work-dir", help="where to write the synthetic checkpoint")
    logging.basicConfig(level=logging.INFO if os.environ.get("BENCH_VERBOSE") else logging.WARNING,
                        format="%(relativeCreated)d %(name)s: %(message)s")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
