"""Rollout throughput: posttrain serve over HTTP vs in-process ``model.generate``.

Same model (real SmolLM2-135M-Instruct, fp32, CPU), same prompts, same batch, same sampling
settings (temperature 1, top-p 1, max_tokens). Tokens/s counts generated tokens up to and
including EOS in both cases; ``model.generate`` keeps computing finished rows until the
longest finishes, our engine drops them, and that difference is part of what is measured.

Also measures weight-update latency: publish a new version (write safetensors under a
prefix) -> ``RolloutClient.load_weights`` -> every replica reports the new version.

    .venv/bin/python bench/rollout_throughput.py --prompts 16 --max-tokens 64 --replicas 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file, save_file

from posttrain.devenv.process import free_port
from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient, SamplingParams
from posttrain.rollout.weights import version_dir_name

TOPICS = [
    "the ocean", "a lighthouse keeper", "machine learning", "a lost cat", "the moon landing",
    "bread baking", "a chess tournament", "volcanoes", "a city at night", "honeybees",
    "an old library", "the first computer", "a mountain village", "thunderstorms",
    "a robot learning to paint", "the history of tea",
]  # fmt: skip


def chat_prompts(tokenizer: object, count: int) -> list[list[int]]:
    prompts = []
    for i in range(count):
        messages = [{"role": "user", "content": f"Write a long story about {TOPICS[i % 16]}."}]
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompts.append(list(ids))
    return prompts


def baseline_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> float:
    """tokens/s of plain ``model.generate`` on the same batch (left padded)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.full((len(prompts), width), pad)  # (B, L)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, L)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=input_ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kwargs)
        torch.manual_seed(0)
        started = time.perf_counter()
        out = model.generate(
            input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, **kwargs
        )
        elapsed = time.perf_counter() - started
    generated = 0
    for row in out[:, width:].tolist():  # (B, T) -> count up to and including EOS
        generated += (
            row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        )
    print(f"  model.generate: {generated} tokens in {elapsed:.2f}s")
    return generated / elapsed


def start_server(model: str, port: int, threads: int, weights_uri: str) -> subprocess.Popen:
    env = dict(os.environ, POSTTRAIN_NUM_THREADS=str(threads))
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", "serve", "--model", model, "--host", "127.0.0.1",
         "--port", str(port), "--threads", str(threads), "--weights-uri", weights_uri],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def http_generate(client: RolloutClient, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0, seed=0)
    client.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    started = time.perf_counter()
    results = client.generate(prompts, params)
    elapsed = time.perf_counter() - started
    generated = sum(len(c.token_ids) for completions in results for c in completions)
    print(f"  posttrain serve over HTTP: {generated} tokens in {elapsed:.2f}s")
    return generated / elapsed


def publish(state: dict[str, torch.Tensor], prefix: Path, version: int) -> float:
    started = time.perf_counter()
    dest = prefix / version_dir_name(version)
    tmp = prefix / f".{version_dir_name(version)}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v + 1e-4 * version for k, v in state.items()}, str(tmp / "model.safetensors"))
    tmp.rename(dest)  # atomic publish: replicas never see half a version
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2, help="for the weight-update test")
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    prompts = chat_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    print(f"model {model_dir}, {len(prompts)} prompts, max_tokens {args.max_tokens}, "
          f"{args.threads} threads")  # fmt: skip

    print("throughput (batch of all prompts at once):")
    baseline = baseline_generate(model_dir, prompts, args.max_tokens)
    prefix = Path(tempfile.mkdtemp(prefix="posttrain-bench-weights-"))
    port = free_port()
    server = start_server(str(model_dir), port, args.threads, str(prefix))
    try:
        with RolloutClient(
            [f"http://127.0.0.1:{port}"], max_in_flight=len(prompts), timeout_s=1800
        ) as client:
            client.wait_healthy(300)
            ours = http_generate(client, prompts, args.max_tokens)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"  model.generate {baseline:.1f} tok/s | posttrain serve (HTTP) {ours:.1f} tok/s | "
          f"ratio {ours / baseline:.2f}x")  # fmt: skip

    print(f"weight update latency ({args.replicas} replicas, {args.updates} updates):")
    state = load_file(str(model_dir / "model.safetensors"))
    ports = [free_port() for _ in range(args.replicas)]
    threads_each = max(1, args.threads // args.replicas)
    servers = [start_server(str(model_dir), p, threads_each, str(prefix)) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with RolloutClient(urls, timeout_s=1800) as client:
            client.wait_healthy(300)
            publish_s, load_s, total_s = [], [], []
            for version in range(1, args.updates + 1):
                started = time.perf_counter()
                publish_s.append(publish(state, prefix, version))
                loaded = time.perf_counter()
                client.load_weights(str(prefix), version)
                versions = {u: httpx.get(f"{u}/v1/weights/version").json() for u in urls}
                assert all(v["weight_version"] == version for v in versions.values()), versions
                load_s.append(time.perf_counter() - loaded)
                total_s.append(time.perf_counter() - started)
        size_mb = (prefix / version_dir_name(1) / "model.safetensors").stat().st_size / 1e6
        print(f"  checkpoint {size_mb:.0f} MB; median publish {statistics.median(publish_s):.2f}s, "
              f"load on all replicas {statistics.median(load_s):.2f}s, "
              f"publish -> all serving {statistics.median(total_s):.2f}s")  # fmt: skip
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=60)
        shutil.rmtree(prefix, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
