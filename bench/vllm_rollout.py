"""vLLM (CPU build) vs posttrain's CPU engine, the front door's overhead, and publish latency.

Side by side in one run, on SmolLM2-135M-Instruct (fp32, CPU), the same prompts and the
same sampling settings (temperature 0.8, top-p 1, ``--n`` samples per prompt):

1. generated tokens/s of ``posttrain serve`` (CPU engine) vs a vLLM replica (front door),
2. the front door vs raw vLLM (the replica's internal port, no proxy): ratio of tokens/s,
   alternating rounds so machine load hits both alike,
3. publish -> every replica serving: ``WeightPublisher.publish`` through the weight
   registry to ``--replicas`` vLLM replicas, fp32 and bf16 (seconds and bytes per step).

Needs ``make venv-vllm``. Each vLLM replica takes minutes to start on a loaded machine.

    .venv/bin/python bench/vllm_rollout.py --prompts 8 --n 4 --max-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient, SamplingParams
from posttrain.rollout.vllm_local import LocalVllmReplica
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import LocalStore
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import WeightPublisher
from posttrain.trainer.run.server_process import LocalRolloutServer

TOPICS = [
    "the ocean", "a lighthouse keeper", "machine learning", "a lost cat", "the moon landing",
    "bread baking", "a chess tournament", "volcanoes", "a city at night", "honeybees",
    "an old library", "the first computer", "a mountain village", "thunderstorms",
    "a robot learning to paint", "the history of tea",
]  # fmt: skip


def tokens_per_second(url: str, prompts: list[list[int]], params: SamplingParams) -> float:
    """Generated tokens (incl. EOS) per wall-second for one batch of concurrent requests."""
    with RolloutClient([url], timeout_s=1800, max_in_flight=len(prompts)) as client:
        started = time.perf_counter()
        groups = client.generate(prompts, params)
        elapsed = time.perf_counter() - started
    return sum(len(c.token_ids) for g in groups for c in g) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="front door vs raw rounds")
    parser.add_argument("--replicas", type=int, default=2, help="vLLM replicas to publish to")
    args = parser.parse_args()
    print(f"load before: {Path('/proc/loadavg').read_text().strip()}  cores: {os.cpu_count()}")

    model_dir = resolve_model("smollm2-135m-instruct")
    policy = Policy(model_dir, learning_rate=1e-5)
    prompts = [policy.encode_prompt(f"Write two sentences about {t}.")
               for t in TOPICS[: args.prompts]]  # fmt: skip
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=0.8, top_p=1.0,
                            seed=1)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    store = LocalStore(work / "store")
    registry = WeightRegistry(store, "weights", keep_last=2)
    replicas = [LocalVllmReplica(model_dir, work / f"replica-{i}.log",
                                 weights_uri=store.uri("weights"))
                for i in range(args.replicas)]  # fmt: skip
    try:
        for replica in replicas:
            replica.start()
        started = time.monotonic()
        for replica in replicas:
            replica.wait_ready(timeout_s=3600)
        print(f"{args.replicas} vLLM replica(s) ready in {time.monotonic() - started:.0f}s")
        vllm = replicas[0]
        raw = f"http://127.0.0.1:{vllm.internal_port}"

        # 1. CPU engine vs vLLM (one warm-up batch each, then one measured batch).
        with LocalRolloutServer(str(model_dir), work / "cpu-server.log") as cpu:
            tokens_per_second(cpu.url, prompts[:2], params)
            cpu_tps = tokens_per_second(cpu.url, prompts, params)
        tokens_per_second(vllm.url, prompts[:2], params)
        vllm_tps = tokens_per_second(vllm.url, prompts, params)
        print(
            f"engine  cpu {cpu_tps:7.1f} tok/s   vllm {vllm_tps:7.1f} tok/s   "
            f"vllm/cpu {vllm_tps / cpu_tps:.2f}x"
        )

        # 2. Front door vs raw vLLM, alternating.
        door, bare = [], []
        for _ in range(args.rounds):
            bare.append(tokens_per_second(raw, prompts, params))
            door.append(tokens_per_second(vllm.url, prompts, params))
        ratios = [d / b for d, b in zip(door, bare, strict=True)]
        print(
            f"front door {statistics.median(door):7.1f} tok/s  raw vllm "
            f"{statistics.median(bare):7.1f} tok/s  ratio median {statistics.median(ratios):.3f} "
            f"(rounds {', '.join(f'{r:.3f}' for r in ratios)})"
        )

        # 3. Publish -> every replica serving, fp32 then bf16.
        with RolloutClient([r.url for r in replicas], timeout_s=1800) as client:
            version = 0
            for dtype in (None, torch.bfloat16):
                publisher = WeightPublisher(registry, store.uri("weights"), client, work,
                                            shared=False, dtype=dtype)  # fmt: skip
                for _ in range(2):
                    version += 1
                    started = time.perf_counter()
                    publisher.publish(policy, version)
                    seconds = time.perf_counter() - started
                    served = client.weight_versions()
                    assert set(served.values()) == {version}, served
                    name = "fp32" if dtype is None else "bf16"
                    print(
                        f"publish v{version} {name}: {seconds:6.2f}s  "
                        f"{publisher.last_bytes / 1e6:7.1f} MB  -> {len(served)} replicas"
                    )
    finally:
        for replica in replicas:
            replica.stop()
    print(f"load after: {Path('/proc/loadavg').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
