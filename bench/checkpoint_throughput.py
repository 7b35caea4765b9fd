"""Checkpoint save/load through CheckpointManager vs raw minio-SDK transfers of the same bytes.

What CheckpointManager adds over a plain ``fput_object``/``fget_object`` is integrity: a
checksum per file (xxh3-128; sha256 for manifests written before v2), a manifest written
last, a pointer update, and verification plus an atomic swap of the destination on load. This measures what that costs, in one run, on one
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
import resource
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
    header = (
        json.dumps(
            {
                "__metadata__": {"format": "pt"},
                "model.weight": {
                    "dtype": "F32",
                    "shape": [payload // 4],
                    "data_offsets": [0, payload],
                },
            }
        )
        .encode()
        .ljust(1024 - 8, b" ")
    )
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


def process_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system, all threads) used so far by ``pid`` (None: this process)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed(fn: Callable[[], object], server_pid: int | None) -> tuple[float, float, float]:
    """(wall s, client CPU s, MinIO CPU s) of one call.

    CPU seconds are reported beside wall time because on a shared machine wall time
    swings with the neighbours' load, while CPU cost per transfer does not. Dirty pages are
    flushed first (untimed), so no variant pays for the writeback of the one before it.
    """
    os.sync()
    client, server = process_cpu_s(None), process_cpu_s(server_pid) if server_pid else 0.0
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    server_used = process_cpu_s(server_pid) - server if server_pid else float("nan")
    return wall, process_cpu_s(None) - client, server_used


def run(args: argparse.Namespace) -> None:  # noqa: C901
    work = Path(tempfile.mkdtemp(prefix="posttrain-bench-", dir=args.work_dir))
    server = None
    if args.endpoint:
        endpoint, access_key, secret_key = args.endpoint, args.access_key, args.secret_key
    else:
        from posttrain.devenv.minio import MinioServer

        server = MinioServer(data_dir=work / "minio").start()
        endpoint, access_key, secret_key = server.endpoint, server.access_key, server.secret_key
    try:
        store = S3Store(
            endpoint,
            args.bucket or f"bench-{uuid.uuid4().hex[:8]}",
            "bench",
            access_key=access_key,
            secret_key=secret_key,
            secure=args.secure,
            download_streams=args.download_streams,
        )
        client, bucket = store.client, store.bucket
        size = int(args.size_gb * 1e9)
        ckpt = make_checkpoint_dir(work, size)
        files = sorted(p for p in ckpt.iterdir())
        total = sum(p.stat().st_size for p in files)
        print(
            f"checkpoint: {len(files)} files, {total / MB:.0f} MB in {work}; MinIO at "
            f"{endpoint}; {args.repeats} repeats, median reported; {os.cpu_count()} CPUs, "
            f"{store.download_streams} download stream(s), "
            f"load average {os.getloadavg()[0]:.1f} at start"
        )

        def raw_save(part_size: int, parallel: int) -> Callable[[], None]:
            def go() -> None:
                for p in files:
                    client.fput_object(
                        bucket,
                        f"bench/raw/{p.name}",
                        str(p),
                        part_size=part_size,
                        num_parallel_uploads=parallel,
                    )

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
            # Into an empty directory, like raw_load (a resuming trainer pod starts empty).
            # Replacing a previous copy keeps it until the new one is verified, which on a
            # disk doubles the dirty pages in flight; --replace measures that case.
            dest = work / "ours-dest"
            if not args.replace:
                shutil.rmtree(dest, ignore_errors=True)
            manager.load_latest(dest)

        server_pid = server.process.pid if server is not None and server.process else None
        results: dict[str, list[tuple[float, float, float]]] = {
            name: []
            for name in (
                "raw save (SDK defaults)",
                "raw save (our part size)",
                "ours save",
                "raw load (fget_object)",
                "ours load (verified)",
            )
        }
        for repeat in range(args.repeats):
            # Interleaved so drift (page cache, MinIO compaction) hits every variant alike;
            # the two loads swap order every repeat so neither always runs second.
            results["raw save (SDK defaults)"].append(timed(raw_save(0, 3), server_pid))
            results["raw save (our part size)"].append(
                timed(raw_save(DEFAULT_PART_SIZE, DEFAULT_PARALLEL_PARTS), server_pid)
            )
            results["ours save"].append(timed(ours_save, server_pid))
            loads = [("raw load (fget_object)", raw_load), ("ours load (verified)", ours_load)]
            for name, load in loads if repeat % 2 == 0 else loads[::-1]:
                results[name].append(timed(load, server_pid))

        def median(name: str, column: int) -> float:
            return statistics.median(sample[column] for sample in results[name])

        rate = {name: total / MB / median(name, 0) for name in results}
        print("\n| transfer | median wall s | wall s min-max | MB/s | client CPU s | MinIO CPU s |")
        print("|---|---|---|---|---|---|")
        for name in results:
            walls = [sample[0] for sample in results[name]]
            print(
                f"| {name} | {median(name, 0):.2f} | {min(walls):.2f}-{max(walls):.2f} | "
                f"{rate[name]:.0f} | {median(name, 1):.2f} | {median(name, 2):.2f} |"
            )
        save_vs_default = rate["ours save"] / rate["raw save (SDK defaults)"]
        save_vs_tuned = rate["ours save"] / rate["raw save (our part size)"]
        load_ratio = rate["ours load (verified)"] / rate["raw load (fget_object)"]
        print(
            f"\nsave throughput ours/raw: {save_vs_default:.2f}x vs SDK defaults, "
            f"{save_vs_tuned:.2f}x vs same part size (goal >= 0.8x)"
        )
        print(f"load throughput ours/raw: {load_ratio:.2f}x (goal >= 0.8x)")
        # Each repeat ran both loads back to back, so its own ratio shows the spread that the
        # neighbours' load causes.
        per_repeat = [
            raw[0] / ours[0]
            for raw, ours in zip(
                results["raw load (fget_object)"], results["ours load (verified)"], strict=True
            )
        ]
        print("load ours/raw per repeat: " + " ".join(f"{r:.2f}" for r in per_repeat))
        for kind, ours, raw in (
            ("save", "ours save", "raw save (our part size)"),
            ("load", "ours load (verified)", "raw load (fget_object)"),
        ):
            cost = (median(ours, 1) + median(ours, 2)) / (median(raw, 1) + median(raw, 2))
            print(f"{kind} CPU cost ours/raw (client + MinIO): {cost:.2f}x")
        print(f"load average {os.getloadavg()[0]:.1f} at end")
    finally:
        if server is not None:
            server.destroy()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size-gb",
        type=float,
        default=0.54,
        help="checkpoint size in GB (0.54 = SmolLM2-135M in fp32)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", help="existing MinIO host:port (default: start one)")
    parser.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID"))
    parser.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY"))
    parser.add_argument("--bucket", help="bucket to use (default: a fresh one)")
    parser.add_argument("--secure", action="store_true", help="TLS to --endpoint")
    parser.add_argument("--work-dir", help="where to write the synthetic checkpoint")
    parser.add_argument(
        "--replace",
        action="store_true",
        help="load over the previous load's directory (kept until the new copy is verified)",
    )
    parser.add_argument(
        "--download-streams",
        type=int,
        help="parallel ranged GETs per file on load (default: one per 4 CPUs, 1 to 4)",
    )
    logging.basicConfig(
        level=logging.INFO if os.environ.get("BENCH_VERBOSE") else logging.WARNING,
        format="%(relativeCreated)d %(name)s: %(message)s",
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
