"""Publish -> every vLLM replica serving, phase by phase, beside vLLM's own reload from memory.

Side by side in one run, on SmolLM2-135M-Instruct and ``--replicas`` real vLLM CPU replicas
(``make venv-vllm``), the same bf16 bytes every round:

1. **registry**: ``WeightPublisher`` through a local ``WeightRegistry`` (write, commit with
   digests, each replica verifies the manifest and reloads), every version full;
2. **shared**: the same-node path (one safetensors file in tmpfs, read in place by every
   replica, no registry copy, no digest);
3. **transfer**: the direct path (``/v1/weights/transfer``: the trainer packs the tensors
   into two 64 MiB shared-memory buckets in turn, every replica's worker copies each one
   into the model through vLLM's weight-transfer API, rollout/weight_transfer.py);
   With ``--s3`` the registry is a real MinIO on this host instead (``s3://``, the row
   named s3): every replica downloads the version (parallel ranged GETs above 64 MiB),
   verifies its digests and reloads: the path of a RolloutPool on other nodes; and the
   row **s3-stream**: the same registry, every replica streaming the version into vLLM
   while it downloads (``stream=True``, docs/rollout.md "Streamed loads"). With
   ``--link-mbps N`` MinIO sits behind a throttling TCP proxy (N MB/s per connection and
   direction, no burst credit), for the trainer's upload and every replica's download
   alike: an object store across a network link instead of on the same two cores;
4. **vLLM from memory**: the same version's tensors staged in every replica's worker
   memory beforehand, then vLLM's own in-place reload (``Worker.reload_weights``) on every
   replica at once through the worker extension, timed in the worker and end to end.

Every publish logs where its time went (trainer: write, delta, commit, load; each replica:
fetch, drain, reload, flip, hold); this prints them per round.

    PYTHONPATH=$PWD .venv/bin/python bench/weight_publish.py --rounds 3 [--s3 [--link-mbps 100]]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.vllm_local import CPU_ENGINE_ARGS, LocalVllmReplica
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import LocalStore
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import WeightPublisher


def rpc(replica: LocalVllmReplica, method: str, *args: str) -> list[Any]:
    """The worker extension's ``method`` on every worker of ``replica`` (its internal port)."""
    response = httpx.post(
        f"http://127.0.0.1:{replica.internal_port}/collective_rpc",
        json={"method": method, "args": list(args)},
        timeout=600,
    )
    response.raise_for_status()
    return list(response.json().get("results") or []) if response.content else []


def on_all(replicas: list[LocalVllmReplica], method: str, *args: str) -> tuple[float, list[Any]]:
    """``method`` on every replica at once; wall seconds until the last one answered."""
    results: list[Any] = [None] * len(replicas)

    def call(i: int) -> None:
        results[i] = rpc(replicas[i], method, *args)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(replicas))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, results


def reload_from_memory(replicas: list[LocalVllmReplica], source: str) -> tuple[float, float]:
    """vLLM's own in-place reload of ``source``'s tensors, staged in every replica's worker
    memory first, on every replica at once: (seconds end to end, slowest worker's own)."""
    on_all(replicas, "stage_weights_in_memory", source)
    wall, results = on_all(replicas, "reload_staged_weights")
    on_all(replicas, "drop_staged_weights")
    return wall, max(float(r["seconds"]) for res in results for r in res)


def nudge(policy: Policy, seed: int) -> None:
    """A new version: every weight moves a little (every bf16 tensor differs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in policy.model.parameters():
            param.mul_(1 + 1e-2 * torch.randn(param.shape, generator=generator))


def phases_text(phases: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.2f}" for k, v in phases.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-dtype", default=CPU_ENGINE_ARGS["dtype"],
                        help="vLLM's --dtype (the weights it serves)")  # fmt: skip
    parser.add_argument("--bucket-mib", type=int, default=64, help="transfer bucket size")
    parser.add_argument("--bind-cores", action="store_true",
                        help="pin replica i to core i (VLLM_CPU_OMP_THREADS_BIND)")  # fmt: skip
    parser.add_argument("--s3", action="store_true",
                        help="the registry in a real MinIO (s3://) instead of a directory")  # fmt: skip
    parser.add_argument("--link-mbps", type=float, default=0.0,
                        help="with --s3: MinIO behind a link of this many MB/s per connection")  # fmt: skip
    args = parser.parse_args()
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}  cores: {os.cpu_count()}")

    model_dir = resolve_model("smollm2-135m-instruct")
    policy = Policy(model_dir, learning_rate=1e-5)
    work = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    (work / "scratch").mkdir()
    store = LocalStore(work / "store")
    registry = WeightRegistry(store, "weights", keep_last=2)
    registry_uri = store.uri("weights")
    minio = None
    if args.s3:  # the replicas load only from their own registry: this one
        minio, (registry, registry_uri) = start_s3_registry(work, args.link_mbps)
    engine_args = {**CPU_ENGINE_ARGS, "dtype": args.engine_dtype}
    cores = os.cpu_count() or 1
    replicas = [
        LocalVllmReplica(model_dir, work / f"replica-{i}.log", weights_uri=registry_uri,
                         engine_args=engine_args,
                         cpu_cores=str(i % cores) if args.bind_cores else None)
        for i in range(args.replicas)
    ]  # fmt: skip
    modes = ("s3", "s3-stream", "shared", "transfer") if args.s3 else ("registry", "shared",
                                                                        "transfer")  # fmt: skip
    rows: dict[str, list[float]] = {m: [] for m in (*modes, "memory", "memory_w")}
    try:
        for replica in replicas:
            replica.start()
        started = time.monotonic()
        for replica in replicas:
            replica.wait_ready(timeout_s=3600)
        print(f"{args.replicas} vLLM replica(s) ready in {time.monotonic() - started:.0f}s "
              f"(engine dtype {args.engine_dtype})")  # fmt: skip
        with RolloutClient([r.url for r in replicas], timeout_s=1800) as client:
            publishers = {
                name: WeightPublisher(registry, registry_uri, client, work / "scratch",
                                      shared=name in ("shared", "transfer"),
                                      dtype=torch.bfloat16, deltas=None,
                                      transfer_bucket_bytes=(args.bucket_mib << 20
                                                             if name == "transfer" else None),
                                      stream={"s3": False, "s3-stream": True}.get(name))
                for name in modes
            }  # fmt: skip
            version = 0
            for round_ in range(args.rounds):
                for name, publisher in publishers.items():
                    version += 1
                    nudge(policy, version)
                    mark = time.perf_counter()
                    publisher.publish(policy, version)
                    seconds = time.perf_counter() - mark
                    served = client.weight_versions()
                    assert set(served.values()) == {version}, served
                    assert publisher.transport == ("registry" if name.startswith("s3")
                                                   else name)  # fmt: skip
                    rows[name].append(seconds)
                    print(f"round {round_} v{version} {name:8s} {seconds:6.2f}s "
                          f"{publisher.last_bytes / 1e6:6.1f} MB  trainer: "
                          f"{phases_text(publisher.last_phases)}")  # fmt: skip
                    for url, reply in sorted(client.last_load_replies.items()):
                        print(f"      {url}: {phases_text(reply.get('phases') or {})}")
                # vLLM's own reload of the registry version's bytes, already in memory.
                source = registry_copy(registry, version - len(modes) + 1, work)
                wall, worker = reload_from_memory(replicas, source)
                rows["memory"].append(wall)
                rows["memory_w"].append(worker)
                print(f"round {round_} vLLM reload from memory, every replica at once: "
                      f"{wall:6.2f}s end to end, {worker:.2f}s in the slowest worker "
                      f"(source {source})")  # fmt: skip
            # Each replica alone (the others idle): vLLM's reload without contention.
            for i, replica in enumerate(replicas):
                wall, worker = reload_from_memory([replica], source)
                print(f"replica {i} alone: vLLM reload from memory {wall:.2f}s end to end, "
                      f"{worker:.2f}s in the worker")  # fmt: skip
    finally:
        for replica in replicas:
            replica.stop()
        if minio is not None:
            minio.destroy()
        shutil.rmtree(work, ignore_errors=True)  # ~0.5 GB of registry versions and logs
    summary(rows, modes)
    return 0


def summary(rows: dict[str, list[float]], modes: tuple[str, ...]) -> None:
    """Each path's median against vLLM's reload from memory, end to end and in the worker."""
    memory, in_worker = statistics.median(rows["memory"]), statistics.median(rows["memory_w"])
    print(f"vLLM's reload from memory, every replica at once: median {memory:.2f}s end to end "
          f"(the RPC to each replica included), {in_worker:.2f}s in the slowest worker")  # fmt: skip
    for name in modes:
        median = statistics.median(rows[name])
        print(f"{name:8s} publish -> every replica serving: median {median:.2f}s "
              f"({', '.join(f'{s:.2f}' for s in rows[name])}) = {median / memory:.2f}x the "
              f"reload end to end, {median / in_worker:.2f}x in the worker")  # fmt: skip
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}")


def registry_copy(registry: WeightRegistry, version: int, work: Path) -> str:
    """A local directory holding registry ``version``'s files: in place for a directory
    registry, downloaded once for MinIO's."""
    root = getattr(registry.store, "root", None)
    if root is not None:
        return str(Path(root) / registry.version_key(version))
    dest = work / f"reference-v{version}"
    if not dest.exists():
        registry.fetch(version, dest)
    return str(dest)


def start_s3_registry(work: Path, link_mbps: float) -> tuple[Any, tuple[WeightRegistry, str]]:
    """A real MinIO under ``work`` with a weight registry in it, and the storage environment
    set for this process and the replicas it starts: (server, (registry, its URI)). With
    ``link_mbps`` everyone reaches it through a throttling proxy (:func:`serve_link`)."""
    from posttrain.api.env import S3_ENDPOINT
    from posttrain.devenv.minio import MinioServer
    from posttrain.devenv.process import free_port
    from posttrain.storage.store import open_store

    (work / "minio").mkdir()
    minio = MinioServer(data_dir=work / "minio").start()
    os.environ.update(minio.env())
    if link_mbps:
        host, _, port = os.environ[S3_ENDPOINT].rpartition(":")
        listen = free_port()
        link = multiprocessing.Process(target=serve_link, daemon=True,
                                       args=(listen, host, int(port), link_mbps * 1e6))  # fmt: skip
        link.start()
        os.environ[S3_ENDPOINT] = f"127.0.0.1:{listen}"
        print(f"MinIO behind a {link_mbps:.0f} MB/s link (per connection and direction)")
    minio.client().make_bucket("bench")
    store = open_store("s3://bench/run")
    return minio, (WeightRegistry(store, "weights", keep_last=2), store.uri("weights"))


def serve_link(listen: int, host: str, port: int, rate: float) -> None:
    """A TCP proxy to ``host:port`` on ``listen`` that moves at most ``rate`` bytes/s per
    connection and direction (a leaky bucket: idle time earns no burst), run in its own
    process so that its copying does not share the benchmark's interpreter."""

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        due = time.monotonic()
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
                due = max(due, time.monotonic()) + len(data) / rate
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, port)
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def main() -> None:
        server = await asyncio.start_server(connect, "127.0.0.1", listen)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    sys.exit(main())
