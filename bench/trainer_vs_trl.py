"""posttrain's RL step vs TRL's GRPOTrainer on the same model, data and batch shape (CPU).

Both train SmolLM2-135M-Instruct with GRPO on builtin arithmetic prompts for ``--steps``
steps of ``--prompts`` prompts x ``--group`` samples, ``--tokens`` new tokens, and the same
numeric verifier as reward. Reported: mean wall seconds per step after the first (warm-up)
step. posttrain's step includes sampling over HTTP from the CPU rollout server, scoring,
the optimizer step and publishing weights to the server; TRL's includes HF ``generate``,
scoring and the optimizer step in one process.

    .venv/bin/python bench/trainer_vs_trl.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from posttrain.api import TrainingRunSpec
from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient
from posttrain.sandboxes.verifiers import verify
from posttrain.trainer.datasets import builtin_tasks
from posttrain.trainer.loop import train
from posttrain.trainer.progress import load_metrics
from posttrain.trainer.server_process import LocalRolloutServer


def bench_posttrain(args: argparse.Namespace, out: Path) -> list[float]:
    spec = TrainingRunSpec.model_validate({
        "model": "smollm2-135m-instruct",
        "algorithm": {"groupSize": args.group, "promptsPerStep": args.prompts,
                      "maxSteps": args.steps, "learningRate": 1e-5, "maxNewTokens": args.tokens,
                      "microBatchSize": args.prompts * args.group, "dynamicSampling": False},
        "domains": [{"name": "arithmetic", "dataset": "builtin:arithmetic",
                     "verifier": {"kind": "numeric"}}],
        "curriculum": {"enabled": False},
        "evaluation": {"everySteps": 1000, "maxItemsPerDomain": 1},
        "checkpoint": {"everySteps": 1000},
    })
    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=900, max_in_flight=args.prompts)
        train(spec, out, client)
        client.close()
    return [m["step_seconds"] for m in load_metrics(out)]


class _StepTimer:
    """TRL callback recording wall time per optimizer step."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *_: object, **__: object) -> None:
                timer.started = time.monotonic()

            def on_step_end(self, *_: object, **__: object) -> None:
                timer.seconds.append(time.monotonic() - timer.started)

        self.callback = Callback()
        self.seconds: list[float] = []
        self.started = 0.0


def bench_trl(args: argparse.Namespace, out: Path) -> list[float]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tasks = builtin_tasks("arithmetic", "train", 64)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": t.prompt}], "answer": t.answer} for t in tasks]
    )

    def numeric_reward(completions: list, answer: list, **_: object) -> list[float]:
        return [verify("numeric", c[0]["content"], {"answer": a}).reward
                for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, learning_rate=1e-5,
        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
        max_completion_length=args.tokens, temperature=1.0, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, beta=0.0, seed=0,
    )
    timer = _StepTimer()
    trainer = GRPOTrainer(model=str(resolve_model("smollm2-135m-instruct")),
                          reward_funcs=numeric_reward, args=config, train_dataset=dataset,
                          callbacks=[timer.callback])
    trainer.train()
    return timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        ours = bench_posttrain(args, Path(tmp) / "posttrain")
        theirs = bench_trl(args, Path(tmp) / "trl")

    def warm_mean(xs: list[float]) -> float:
        rest = xs[1:] or xs
        return sum(rest) / len(rest)

    result = {"config": vars(args), "posttrain_step_s": ours, "trl_step_s": theirs,
              "posttrain_mean_s": warm_mean(ours), "trl_mean_s": warm_mean(theirs)}
    result["trl_over_posttrain"] = result["trl_mean_s"] / result["posttrain_mean_s"]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
