"""posttrain's RL loop vs TRL's GRPOTrainer: throughput and held-out accuracy, one run (CPU).

Both train SmolLM2-135M-Instruct (fp32) with the same GRPO/DAPO-style loss (token-mean,
clip 0.2 / 0.28, no KL) on the same prompt pool (``builtin:arithmetic`` train split),
``--prompts`` prompts x ``--group`` samples per step, ``--tokens`` new tokens, temperature
1, learning rate ``--lr``, and the same numeric verifier as reward, each for the same
wall-clock budget (``--budget`` seconds of training steps; model loading not counted).

Reported per trainer: steps, completions/s and trained (completion) tokens/s over the
timed steps, and greedy held-out accuracy of the final weights on ``--heldout`` items of the
held-out split, scored by one function (:func:`heldout_accuracy`, in-process HF greedy
decoding + the numeric verifier) for both and for the base model. Ratios are ours/TRL.

posttrain samples over HTTP from a CPU rollout server child process, overlapping the
sampling of batch n+1 with the update of step n for ``--lags 1`` (``maxPolicyLag``; each
lag given is one posttrain run), and publishes weights to it after each step; TRL calls HF
``generate`` in process.

    .venv/bin/python bench/trainer_vs_trl.py --budget 120 --lags 0 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from posttrain.api import TrainingRunSpec
from posttrain.models import resolve_model
from posttrain.rollout.client import RolloutClient
from posttrain.sandboxes.verifiers import verify
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.data.rundata import balanced_subset, domain_tasks
from posttrain.trainer.observe.status import LocalStatusReporter, RunStatus
from posttrain.trainer.observe.step_metrics import load_metrics
from posttrain.trainer.run.loop import train
from posttrain.trainer.run.server_process import LocalRolloutServer, thread_split

MODEL = "smollm2-135m-instruct"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


class CpuAfterEachStep:
    """CPU seconds used so far (this process + ``extra_pids``) after each finished step.

    On a shared machine CPU seconds per completion is steadier than wall time: other
    people's jobs slow us down but do not add to our CPU time.
    """

    def __init__(self, extra_pids: list[int] | None = None) -> None:
        self.extra_pids = extra_pids or []
        self.samples: list[float] = []

    def record(self) -> None:
        self.samples.append(
            time.process_time() + sum(process_cpu_seconds(pid) for pid in self.extra_pids)
        )

    def per_step_after_first(self) -> float | None:
        """Mean CPU seconds of steps 2 .. n-1 (the first warms up, the last also saves)."""
        window = self.samples[: max(2, len(self.samples) - 1)]
        if len(window) < 2:
            return None
        return (window[-1] - window[0]) / (len(window) - 1)


def heldout_accuracy(model: Any, tokenizer: Any, tasks: list[Task], max_new_tokens: int) -> float:
    """Fraction of ``tasks`` whose greedy answer the numeric verifier accepts (batched)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t.prompt}], tokenize=False, add_generation_prompt=True
        )
        for t in tasks
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )  # (B, T + new)
    answers = tokenizer.batch_decode(
        out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    passed = [
        verify("numeric", a, {"answer": t.answer}).passed
        for a, t in zip(answers, tasks, strict=True)
    ]
    return sum(passed) / len(passed)


def evaluate_dir(model_dir: Path, tasks: list[Task], max_new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return heldout_accuracy(model, AutoTokenizer.from_pretrained(model_dir), tasks, max_new_tokens)


def bench_posttrain(
    args: argparse.Namespace, lag: int, out: Path, heldout: list[Task]
) -> dict[str, Any]:
    spec = TrainingRunSpec.model_validate(
        {
            "model": MODEL,
            "algorithm": {
                "groupSize": args.group,
                "promptsPerStep": args.prompts,
                "maxSteps": 10_000,
                "learningRate": args.lr,
                "maxNewTokens": args.tokens,
                "microBatchSize": args.prompts * args.group,
                "dynamicSampling": False,
                "maxPolicyLag": lag,
                "temperature": 1.0,
            },
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "numeric"},
                }
            ],
            "curriculum": {"enabled": False},
            "evaluation": {"everySteps": 10_000, "maxItemsPerDomain": 1},
            "checkpoint": {"everySteps": 10_000},
            "audit": {"enabled": False},
        }
    )
    trainer_threads, server_threads = thread_split(os.cpu_count() or 1, overlapped=lag > 0)
    torch.set_num_threads(trainer_threads)
    with LocalRolloutServer(spec.model, out / "server.log", threads=server_threads) as server:
        client = RolloutClient([server.url], timeout_s=900, max_in_flight=args.prompts)
        cpu = CpuAfterEachStep([server.process.pid or 0])

        class Reporter(LocalStatusReporter):
            def report(self, status: RunStatus) -> None:
                if status.step > len(cpu.samples):  # once per step (not the final report)
                    cpu.record()
                super().report(status)

        train(spec, out, client, reporter=Reporter(out), wall_budget_s=args.budget)
        client.close()
    torch.set_num_threads(os.cpu_count() or 1)
    metrics = load_metrics(out)
    completions = args.prompts * args.group
    return {
        "threads": {"trainer": trainer_threads, "server": server_threads},
        "step_s": [round(m["step_seconds"], 2) for m in metrics],
        "rollout_wait_s": [round(m["step_seconds"] - m["train_seconds"], 2) for m in metrics],
        "completions": completions * len(metrics),
        "trained_tokens": sum(
            round(m["response_length"] * completions) for m in metrics if m["applied"]
        ),
        "staleness": [m["staleness"] for m in metrics],
        "cpu_s_per_step": cpu.per_step_after_first(),
        "accuracy": evaluate_dir(out / "checkpoints" / "latest", heldout, args.tokens),
    }


def bench_trl(
    args: argparse.Namespace, out: Path, heldout: list[Task], train_tasks: list[Task]
) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": t.prompt}], "answer": t.answer}
            for t in train_tasks
        ]
    )
    tokens: list[int] = []

    def numeric_reward(
        completions: list, answer: list, completion_ids: list, **_: object
    ) -> list[float]:
        tokens.append(sum(len(ids) for ids in completion_ids))
        return [
            verify("numeric", c[0]["content"], {"answer": a}).reward
            for c, a in zip(completions, answer, strict=True)
        ]

    seconds: list[float] = []
    cpu = CpuAfterEachStep()

    class Budget(TrainerCallback):
        """Per-step wall time; stops training once the budget is spent."""

        def on_train_begin(self, *_: object, **__: object) -> None:
            self.began = time.monotonic()

        def on_step_begin(self, *_: object, **__: object) -> None:
            self.started = time.monotonic()

        def on_step_end(self, _args: object, _state: object, control: Any, **__: object) -> None:
            seconds.append(time.monotonic() - self.started)
            cpu.record()
            if time.monotonic() - self.began >= args.budget:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(out),
        max_steps=10_000,
        learning_rate=args.lr,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.tokens,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=0.0,
        seed=0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        # TRL defaults to activation checkpointing (recomputes the forward in backward, ~1/3
        # more training compute); posttrain does not checkpoint, and a 135M model needs no
        # memory saving, so TRL runs without it: its fastest configuration here.
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=str(resolve_model(MODEL)),
        reward_funcs=numeric_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[Budget()],
    )
    trainer.train()
    return {
        "threads": {"trainer": torch.get_num_threads()},
        "step_s": [round(s, 2) for s in seconds],
        "completions": args.prompts * args.group * len(seconds),
        "trained_tokens": sum(tokens[: len(seconds)]),
        "cpu_s_per_step": cpu.per_step_after_first(),
        "accuracy": heldout_accuracy(trainer.model, trainer.processing_class, heldout, args.tokens),
    }


def with_rates(result: dict[str, Any], completions_per_step: int) -> dict[str, Any]:
    """Throughput over all timed steps (wall) and per CPU-second (steps 2 .. n-1)."""
    timed = sum(result["step_s"])
    result["timed_s"] = round(timed, 1)
    result["completions_per_s"] = result["completions"] / timed
    result["trained_tokens_per_s"] = result["trained_tokens"] / timed
    cpu = result["cpu_s_per_step"]
    result["completions_per_cpu_s"] = completions_per_step / cpu if cpu else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=120.0, help="wall seconds of training steps per trainer"
    )
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument(
        "--lags",
        type=int,
        nargs="+",
        default=[0, 1],
        help="posttrain maxPolicyLag values to run (0: on-policy, no overlap; "
        "1: sample batch n+1 during step n)",
    )
    parser.add_argument("--heldout", type=int, default=32, help="held-out arithmetic items")
    parser.add_argument("--skip-trl", action="store_true", help="only run posttrain")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    train_tasks, held = domain_tasks("arithmetic", "builtin:arithmetic", None)
    heldout = balanced_subset(held, args.heldout)
    started, per_step = time.time(), args.prompts * args.group
    result: dict[str, Any] = {
        "config": vars(args),
        "base_accuracy": evaluate_dir(resolve_model(MODEL), heldout, args.tokens),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for lag in args.lags:
            result[f"posttrain_lag{lag}"] = with_rates(
                bench_posttrain(args, lag, Path(tmp) / f"posttrain-lag{lag}", heldout), per_step
            )
        if not args.skip_trl:
            result["trl"] = with_rates(
                bench_trl(args, Path(tmp) / "trl", heldout, train_tasks), per_step
            )
    for lag in args.lags if "trl" in result else []:
        ours, theirs = result[f"posttrain_lag{lag}"], result["trl"]
        result[f"ratios_lag{lag}_over_trl"] = {
            key: round(ours[key] / theirs[key], 3) if ours[key] and theirs[key] else None
            for key in (
                "completions_per_s",
                "trained_tokens_per_s",
                "completions_per_cpu_s",
                "accuracy",
            )
        }
    result["wall_s"] = round(time.time() - started)
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
