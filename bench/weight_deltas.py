"""Bytes moved per weight version: full vs delta versions, side by side in one run.

SmolLM2-135M-Instruct (the packaged model) takes real AdamW steps on CPU at the demo's
learning rate (examples/local-demo.yaml: 2e-5, constant) on a next-token loss over short
texts. After every step two ``WeightPublisher``\\ s publish the same policy in bf16 (the
serving dtype of a GPU pool) through their own weight registry, each to its own
``posttrain serve`` replica (in-process, real HTTP): one publishes every version full, the
other a delta over the previous version when it pays (:class:`DeltaPolicy`). Per version it
prints the bytes each registry committed (what every replica downloads), the fraction of
elements whose bf16 bits changed (``-``: the version is full), and publish -> serving seconds; at the end both replicas
must return the same greedy token ids and logprobs.

    PYTHONPATH=$PWD .venv/bin/python bench/weight_deltas.py --steps 6
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient, SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.storage.checkpoints import WeightRegistry
from posttrain.storage.store import LocalStore
from posttrain.trainer.model.policy import Policy
from posttrain.trainer.model.weight_sync import DeltaPolicy, WeightPublisher

TEXTS = [
    "Q: What is 17 + 25? A: 17 + 25 = 42.",
    "def add(a, b):\n    return a + b\n",
    "The capital of France is Paris, a city on the Seine.",
    "Q: What is 9 * 8? A: 9 * 8 = 72.",
    "def is_even(n):\n    return n % 2 == 0\n",
    "Honeybees communicate the direction of flowers with a waggle dance.",
    "Q: What is 100 - 37? A: 100 - 37 = 63.",
    "def square(x):\n    return x * x\n",
]


def optimizer_step(policy: Policy, batch: list[str]) -> float:
    """One real AdamW step of the policy on a next-token loss over ``batch``."""
    encoded = policy.tokenizer(batch, return_tensors="pt", padding=True)
    labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)  # (B, T)
    policy.optimizer.zero_grad(set_to_none=True)
    loss = policy.model(**encoded, labels=labels).loss
    loss.backward()  # type: ignore[no-untyped-call]
    policy.optimization.apply(float(loss.detach()), grad_clip=1.0)
    return float(loss.detach())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()

    torch.set_num_threads(2)
    model_dir = resolve_model(args.model)
    policy = Policy(model_dir, learning_rate=args.learning_rate)
    root = Path(tempfile.mkdtemp(prefix="bench-deltas-"))
    sides = {}
    for name, deltas in (("full", None), ("delta", DeltaPolicy())):
        store = LocalStore(root / name)
        (root / f"scratch-{name}").mkdir()
        server = ServerThread(ServerConfig(model=str(model_dir), num_threads=1)).start()
        client = RolloutClient([server.url], timeout_s=600)
        publisher = WeightPublisher(
            WeightRegistry(store, "weights", keep_last=2), store.uri("weights"), client,
            root / f"scratch-{name}", shared=False, dtype=torch.bfloat16, deltas=deltas,
        )  # fmt: skip
        sides[name] = (server, client, publisher)

    print(f"{args.model}, lr {args.learning_rate:g} (AdamW, constant), bf16 versions, "
          f"batch {args.batch}")  # fmt: skip
    print(f"{'version':>7} {'loss':>7} {'full MB':>8} {'delta MB':>9} {'kind':>6} "
          f"{'changed':>8} {'ratio':>7} {'full s':>7} {'delta s':>8}")  # fmt: skip
    totals = {"full": 0, "delta": 0}
    for version in range(1, args.steps + 1):
        start = (version - 1) * args.batch % len(TEXTS)
        batch = (TEXTS * 2)[start : start + args.batch]
        loss = optimizer_step(policy, batch)
        moved, seconds = {}, {}
        for name, (_, _, publisher) in sides.items():
            began = time.monotonic()
            publisher.publish(policy, version)
            seconds[name] = time.monotonic() - began
            moved[name] = publisher.last_bytes
            totals[name] += publisher.last_bytes
        delta_publisher = sides["delta"][2]
        fraction = delta_publisher.last_changed_fraction
        changed = "-" if fraction is None else f"{100 * fraction:.2f}%"
        print(f"{version:>7} {loss:>7.3f} {moved['full'] / 1e6:>8.1f} "
              f"{moved['delta'] / 1e6:>9.2f} {delta_publisher.last_kind:>6} "
              f"{changed:>8} {moved['full'] / max(moved['delta'], 1):>6.1f}x "
              f"{seconds['full']:>7.2f} {seconds['delta']:>8.2f}")  # fmt: skip
    print(f"total: full {totals['full'] / 1e6:.1f} MB, with deltas "
          f"{totals['delta'] / 1e6:.1f} MB ({totals['full'] / totals['delta']:.1f}x fewer)")  # fmt: skip

    prompt = policy.encode_prompt("What is 12 + 30?")
    params = SamplingParams(n=1, max_tokens=12, temperature=0.0, seed=0)
    served = [c.generate([prompt], params)[0][0] for _, c, _ in sides.values()]
    same = served[0].token_ids == served[1].token_ids and served[0].logprobs == served[1].logprobs
    versions = [s.weight_version for s in served]
    print(f"replicas at versions {versions}: identical greedy token ids and logprobs: {same}")
    for server, client, publisher in sides.values():
        publisher.close()
        client.close()
        server.stop()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
