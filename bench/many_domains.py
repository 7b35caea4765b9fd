"""Per-step cost of 300 domains vs 2 domains at the same batch size (target: <= 1.2x).

Two measurements, both side by side in one process, both on the same synthetic data
(``N`` JSONL task files of small sums, one per domain, scored by the real numeric verifier):

* ``stages``: a trainer step's work outside the model and the server, with the real
  stage code: the curriculum's draw, scoring, advantages and loss coefficients, the
  curriculum/audit updates, the step record (metrics.jsonl, Prometheus gauges, the rich
  table row, span) and the status file. Completions are synthetic (seeded mix of right
  and wrong answers), so only the per-domain bookkeeping differs between the two runs.
  The two runs alternate step by step (so load from other work hits both alike);
  ``--stage-steps`` steps each, the median step's wall and CPU (process) time is reported.
* ``loop``: whole ``train()`` steps (tiny random Llama with the real tokenizer, the real
  CPU rollout server over HTTP, the real policy step), ``--loop-steps`` steps per run,
  ``step_seconds`` of steps 2.. from metrics.jsonl (step 1 warms up). The two domain
  counts run ``--loop-reps`` times each, interleaved (A B B A A B ...), so load drift on a
  shared machine hits both alike; reported: the median step of each count over all its
  repetitions, and the median of the per-repetition ratios (each from one A/B pair run
  back to back).

    .venv/bin/python bench/many_domains.py --domains 300 --prompts 64 --group 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.api import TrainingRunSpec
from posttrain.rollout.protocol import Completion
from posttrain.trainer.algorithms.loss import loss_config
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
from posttrain.trainer.data.rundata import build_run_data
from posttrain.trainer.observe.audit import Auditor
from posttrain.trainer.observe.status import LocalStatusReporter, RunStatus
from posttrain.trainer.observe.step_metrics import ProgressReporter, StepMetrics, load_metrics
from posttrain.trainer.run.batch import prepare_batch, score_batch


def write_domains(folder: Path, count: int, tasks_per_domain: int) -> list[dict[str, Any]]:
    """``count`` JSONL task files of sums; returns the spec's ``domains`` list."""
    folder.mkdir(parents=True, exist_ok=True)
    domains = []
    for i in range(count):
        rng = random.Random(i)
        path = folder / f"skill-{i:03d}.jsonl"
        lines = []
        for _ in range(tasks_per_domain):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            lines.append(
                json.dumps({"prompt": f"What is {a} + {b}? Answer: <number>", "answer": str(a + b)})
            )
        path.write_text("\n".join(lines) + "\n")
        domains.append(
            {"name": f"skill-{i:03d}", "dataset": str(path), "verifier": {"kind": "numeric"}}
        )
    return domains


def make_spec(
    model: str, domains: list[dict[str, Any]], prompts: int, group: int, steps: int
) -> TrainingRunSpec:
    return TrainingRunSpec.model_validate(
        {
            "model": model,
            # dynamicSampling off: a tiny random model solves nothing, and dropping every
            # all-zero group would skip the policy step the loop part is meant to include.
            "algorithm": {
                "groupSize": group,
                "promptsPerStep": prompts,
                "maxSteps": steps,
                "learningRate": 1e-3,
                "maxNewTokens": 8,
                "microBatchSize": 32,
                "dynamicSampling": False,
                "seed": 0,
            },
            "domains": domains,
            "curriculum": {"window": 8, "minDomainFraction": 0.02},
            # Evaluation runs after a step's timer stops; keep it small so the bench is short.
            "evaluation": {"everySteps": 1000, "maxItemsPerDomain": 1},
            "checkpoint": {"everySteps": 1000, "keepLast": 1},
            "audit": {"spotCheckSamples": 5},
        }
    )


def synthetic_batch(step: int, tasks: list[Any], group: int) -> RolloutBatch:
    """Seeded completions: a right or wrong 'Answer: n' per sample, 8 tokens each."""
    rng = random.Random(step)
    completions = []
    for i, task in enumerate(tasks):
        group_out = []
        for _ in range(group):
            value = task.answer if rng.random() < 0.5 else str(rng.randint(0, 200))
            group_out.append(Completion(i, f"Answer: {value}", [1] * 8, [-1.0] * 8, "stop", 0))
        completions.append(group_out)
    request = RolloutRequest(step, tasks, [[0] * 16 for _ in tasks], seed=step)
    return RolloutBatch(request, completions, 0.0)


class StageLane:
    """One run's host-side stages (see the module docstring), stepped one step at a time so
    two lanes can alternate and share whatever load the machine is under."""

    def __init__(self, spec: TrainingRunSpec, out: Path, steps: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.spec, self.algo, self.data = spec, spec.algorithm, build_run_data(spec)
        self.auditor = Auditor(out, spec.audit.spot_check_samples, self.algo.seed)
        self.status = LocalStatusReporter(out)
        self.config = loss_config(self.algo)
        self.progress = ProgressReporter(out, steps)
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def step(self, step: int) -> None:
        algo, data, progress = self.algo, self.data, self.progress
        wall, cpu = time.perf_counter(), time.process_time()
        with progress.step_span(step) as span:
            tasks = data.curriculum.next_prompts(algo.prompts_per_step)
            batch = synthetic_batch(step, tasks, algo.group_size)
            scored = score_batch(batch, data.verifiers, algo, max_concurrency=2)
            prepared = prepare_batch(
                batch,
                scored,
                algorithm=algo.name,
                dynamic_sampling=algo.dynamic_sampling,
                loss_config=self.config,
                step=step,
            )
            for task, rate in zip(tasks, prepared.group_pass_rates, strict=True):
                data.curriculum.observe(task, rate, step)
            self.auditor.observe_batch(step, prepared.trajectories)
            progress.record(
                StepMetrics(
                    step=step,
                    reward_mean=prepared.reward_mean,
                    domain_rewards=prepared.domain_rewards,
                    domain_pass_rates=prepared.domain_pass_rates,
                    loss=0.0,
                    grad_norm=0.0,
                    kl=0.0,
                    clip_fraction=0.0,
                    ratio_mean=1.0,
                    response_length=prepared.response_length,
                    kept_groups=prepared.kept_groups,
                    total_groups=len(tasks),
                    weight_version=step,
                    staleness=0,
                    applied=True,
                    skip_reason="",
                    rollout_seconds=0.0,
                    train_seconds=0.0,
                    step_seconds=0.0,
                    strata={d: data.curriculum.current_stratum(d) for d in data.curriculum.pools},
                ),
                span,
            )
            self.status.report(
                RunStatus(
                    phase="Running",
                    step=step,
                    max_steps=algo.max_steps,
                    reward_mean=prepared.reward_mean,
                    domain_rewards=prepared.domain_rewards,
                )
            )
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)


def stage_step_seconds(
    specs: dict[int, TrainingRunSpec], root: Path, steps: int
) -> dict[str, float]:
    """Median wall and CPU seconds per step of each lane, the lanes alternating step by
    step (ABAB...), the first step of each left out (warm-up)."""
    lanes = {n: StageLane(spec, root / f"stages{n}", steps) for n, spec in specs.items()}
    for lane in lanes.values():
        lane.progress.__enter__()
    try:
        for step in range(1, steps + 1):
            for lane in lanes.values() if step % 2 else reversed(list(lanes.values())):
                lane.step(step)
    finally:
        for lane in lanes.values():
            lane.progress.__exit__()
    out = {}
    for n, lane in lanes.items():
        out[f"stages_{n}_wall"] = statistics.median(lane.wall[1:])
        out[f"stages_{n}_cpu"] = statistics.median(lane.cpu[1:])
    return out


def loop_step_seconds(spec: TrainingRunSpec, out: Path) -> list[float]:
    """``step_seconds`` of whole train() steps 2.. (tiny model, real server)."""
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.run.loop import train
    from posttrain.trainer.run.server_process import LocalRolloutServer

    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=600, max_in_flight=4)
        try:
            train(spec, out, client)
        finally:
            client.close()
    return [m["step_seconds"] for m in load_metrics(out)[1:]]


def interleaved_loop_seconds(
    specs: dict[int, TrainingRunSpec], root: Path, reps: int
) -> dict[str, Any]:
    """train() runs of each domain count, ``reps`` times, in ABBA order; per count the median
    step over every repetition, and the median per-repetition ratio (many / two)."""
    two, many = sorted(specs)
    steps: dict[int, list[float]] = {two: [], many: []}
    ratios = []
    for rep in range(reps):
        order = (two, many) if rep % 2 == 0 else (many, two)
        rep_median = {}
        for n in order:
            seconds = loop_step_seconds(specs[n], root / f"loop{n}-rep{rep}")
            steps[n] += seconds
            rep_median[n] = statistics.median(seconds)
        ratios.append(rep_median[many] / rep_median[two])
        print(
            f"loop rep {rep + 1}/{reps}: {two} domains {rep_median[two]:.2f} s/step, {many} "
            f"domains {rep_median[many]:.2f} s/step, ratio {ratios[-1]:.2f}",
            flush=True,
        )
    return {
        f"loop_{two}": statistics.median(steps[two]),
        f"loop_{many}": statistics.median(steps[many]),
        "loop_rep_ratios": ratios,
        "loop_ratio_median": statistics.median(ratios),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--domains", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=64, help="promptsPerStep (both runs)")
    parser.add_argument("--group", type=int, default=8, help="groupSize (both runs)")
    parser.add_argument("--stage-steps", type=int, default=30)
    parser.add_argument("--loop-steps", type=int, default=6, help="0 skips the train() part")
    parser.add_argument(
        "--loop-reps", type=int, default=4, help="train() runs per domain count, interleaved"
    )
    parser.add_argument("--loop-prompts", type=int, default=16)
    parser.add_argument("--loop-group", type=int, default=4)
    args = parser.parse_args()
    from posttrain.models import make_tiny_model

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-domains-") as tmp:
        root = Path(tmp)
        model = str(make_tiny_model(root / "model", seed=0)) if args.loop_steps else "tiny"
        domain_lists = {n: write_domains(root / f"data{n}", n, 40) for n in (2, args.domains)}
        specs = {
            n: make_spec(model, domain_lists[n], args.prompts, args.group, args.stage_steps)
            for n in (2, args.domains)
        }
        results.update(stage_step_seconds(specs, root, args.stage_steps))
        if args.loop_steps:
            loop_specs = {
                n: make_spec(
                    model, domain_lists[n], args.loop_prompts, args.loop_group, args.loop_steps
                )
                for n in (2, args.domains)
            }
            results.update(interleaved_loop_seconds(loop_specs, root, args.loop_reps))
    n = args.domains
    print(json.dumps(results, indent=1))
    for clock in ("wall", "cpu"):
        two, many = results[f"stages_2_{clock}"], results[f"stages_{n}_{clock}"]
        print(
            f"stages {clock} (batch {args.prompts}x{args.group}): 2 domains {two * 1e3:.1f} "
            f"ms/step, {n} domains {many * 1e3:.1f} ms/step, ratio {many / two:.2f}"
        )
    if args.loop_steps:
        print(
            f"train() steps (batch {args.loop_prompts}x{args.loop_group}, tiny model, "
            f"{args.loop_reps} interleaved runs each): 2 domains {results['loop_2']:.2f} s/step, "
            f"{n} domains {results[f'loop_{n}']:.2f} s/step (median steps), ratio "
            f"{results[f'loop_{n}'] / results['loop_2']:.2f}; median per-run-pair ratio "
            f"{results['loop_ratio_median']:.2f}"
        )


if __name__ == "__main__":
    main()
