"""Held-out change of every stage of a staged run, over seeds: is a stage's gain more than noise?

Runs one TrainingRun manifest locally once per seed (``spec.algorithm.seed``: the SFT and DPO
data order, rollout sampling and the curriculum all follow it), or reuses a seed's finished
run under ``--out``, then prints per stage:

- for each seed: held-out accuracy before -> after the stage, the change with its paired
  standard error (the same items both times: ``posttrain.trainer.observe.heldout_change``),
  and the items it fixed / broke;
- over the seeds: the mean change and the seeds' half-range (run-to-run noise), and a
  verdict -- a gain or a loss when every seed moved the same way by more than twice its
  standard error, otherwise "noise".

The table also goes to ``<out>/gains.md`` and the numbers to ``<out>/gains.json``.

    .venv/bin/python bench/stage_gains.py examples/sft-dpo-rl.yaml --seeds 0 1 --out runs/gains-sdr
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from posttrain.trainer.observe.heldout_change import PairedChange, paired_change, stratum_changes
from posttrain.trainer.observe.run_report import latest_eval_per_step, stage_rows


def run_seed(manifest: Path, seed: int, out: Path, max_items: int | None) -> Path:
    """``<out>/seed<N>/run``, finished: reused when its status says Succeeded, else (re)run.

    A seed that stopped half way resumes from its checkpoints (``posttrain run`` resumes an
    output directory), so an interrupted bench loses no finished step.
    """
    where = out / f"seed{seed}"
    run_dir = where / "run"
    status = run_dir / "status.json"
    if status.is_file() and json.loads(status.read_text()).get("phase") == "Succeeded":
        print(f"seed {seed}: reusing the finished run in {run_dir}", flush=True)
        return run_dir
    doc = yaml.safe_load(manifest.read_text())
    doc["spec"].setdefault("algorithm", {})["seed"] = seed
    if max_items is not None:
        doc["spec"].setdefault("evaluation", {})["maxItemsPerDomain"] = max_items
    where.mkdir(parents=True, exist_ok=True)
    seeded = where / "manifest.yaml"
    seeded.write_text(yaml.safe_dump(doc, sort_keys=False))
    log = where / "run.log"
    command = [
        sys.executable,
        "-m",
        "posttrain",
        "run",
        str(seeded),
        "--local",
        "--out",
        str(run_dir),
    ]
    print(f"seed {seed}: {' '.join(command)} (log: {log})", flush=True)
    start = time.monotonic()
    with log.open("a") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, check=False)
    print(f"seed {seed}: exit {done.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {done.returncode}); see {log}")
    return run_dir


def stage_changes(run_dir: Path) -> list[dict[str, Any]]:
    """Per stage of one finished run: name, type, before, after and its paired change."""
    stages = json.loads((run_dir / "status.json").read_text()).get("stages", [])
    rows = []
    for name, kind, _, _, before, after in stage_rows(
        stages, latest_eval_per_step(run_dir, "heldout")
    ):
        paired, by_stratum = None, {}
        if before is not None and after is not None:
            paired, by_stratum = paired_change(before, after), stratum_changes(before, after)
        rows.append(
            {
                "stage": name,
                "type": kind,
                "before": None if before is None else before.overall,
                "after": None if after is None else after.overall,
                "paired": None if paired is None else asdict(paired),
                "strata": {group: asdict(change) for group, change in by_stratum.items()},
            }
        )
    return rows


def verdict(changes: list[PairedChange]) -> str:
    """ "gain"/"loss" when every seed moved the same way by more than 2 standard errors.

    >>> verdict([PairedChange(96, 12, 1), PairedChange(96, 10, 2)])
    'gain'
    >>> verdict([PairedChange(96, 12, 1), PairedChange(96, 3, 4)])
    'noise'
    """
    if changes and all(c.change > 2 * c.stderr for c in changes):
        return "gain"
    if changes and all(c.change < -2 * c.stderr for c in changes):
        return "loss"
    return "noise"


def table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """The markdown table: a column per seed, then the mean, the seeds' half-range, a verdict."""
    seeds = sorted(per_seed)
    head = "| stage | type | " + " | ".join(
        f"seed {s}: before -> after, change ± s.e. (fixed / broken of n)" for s in seeds
    )
    lines = [head + " | mean change | seeds' half-range | verdict |"]
    lines.append("| --- | --- | " + " | ".join("---" for _ in seeds) + " | ---: | ---: | --- |")
    first = per_seed[seeds[0]]
    for index, row in enumerate(first):
        cells, changes = [], []
        for seed in seeds:
            mine = per_seed[seed][index]
            if mine["paired"] is None:
                cells.append("-")
                continue
            paired = PairedChange(**mine["paired"])
            changes.append(paired)
            cells.append(
                f"{mine['before']:.1%} -> {mine['after']:.1%}, {paired.text()} "
                f"({paired.fixed} / {paired.broken} of {paired.n})"
            )
        values = [c.change for c in changes]
        mean = f"{sum(values) / len(values):+.1%}" if values else "-"
        spread = f"{(max(values) - min(values)) / 2:.1%}" if values else "-"
        lines.append(
            f"| {row['stage']} | {row['type']} | "
            + " | ".join(cells)
            + f" | {mean} | {spread} | {verdict(changes) if changes else '-'} |"
        )
    return "\n".join(lines) + "\n" + strata_table(per_seed)


def strata_table(per_seed: dict[int, list[dict[str, Any]]]) -> str:
    """Each stage's change per difficulty stratum and seed (runs whose held-out items carry
    their stratum): where a stage gained and where it lost; empty when none do."""
    seeds = sorted(per_seed)
    groups = list(
        dict.fromkeys(
            g for rows in per_seed.values() for row in rows for g in row.get("strata", {})
        )
    )
    if not groups:
        return ""
    lines = [
        "",
        "| stage | stratum | "
        + " | ".join(f"seed {s}: change ± s.e. (fixed / broken of n)" for s in seeds)
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in seeds) + " |",
    ]
    for index, row in enumerate(per_seed[seeds[0]]):
        for group in groups:
            cells = []
            for seed in seeds:
                found = per_seed[seed][index].get("strata", {}).get(group)
                change = None if found is None else PairedChange(**found)
                cells.append(
                    "-"
                    if change is None
                    else f"{change.text()} ({change.fixed} / {change.broken} of {change.n})"
                )
            lines.append(f"| {row['stage']} | {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "manifest",
        type=Path,
        nargs="?",
        default=Path("examples/sft-dpo-rl.yaml"),
        help="a TrainingRun YAML with stages (default: examples/sft-dpo-rl.yaml)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=Path("runs/stage-gains"))
    parser.add_argument("--max-items", type=int, default=None, help="override maxItemsPerDomain")
    args = parser.parse_args()
    per_seed = {
        seed: stage_changes(run_seed(args.manifest, seed, args.out, args.max_items))
        for seed in args.seeds
    }
    names = {seed: [r["stage"] for r in rows] for seed, rows in per_seed.items()}
    if len({tuple(v) for v in names.values()}) != 1:
        raise SystemExit(f"the seeds' runs have different stages: {names}")
    text = table(per_seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gains.md").write_text(text)
    (args.out / "gains.json").write_text(json.dumps(per_seed, indent=1))
    print(text)


if __name__ == "__main__":
    main()
