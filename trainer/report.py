"""Plots and the end-of-run report: did held-out accuracy improve, and at what cost?

Everything is drawn from the files the run wrote (``metrics.jsonl``, ``eval/*.json``),
so a report can be rebuilt for any finished or interrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.trainer.evaluate import EvalResult
from posttrain.trainer.progress import load_metrics


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: trainer pods and CI have no display
    import matplotlib.pyplot as plt

    return plt


def latest_eval_per_step(out_dir: Path, split: str) -> list[EvalResult]:
    """Eval results of one split ordered by step (the newest file wins for a step)."""
    results = []
    for path in sorted((out_dir / "eval").glob(f"{split}_step*.json")):
        results.append(EvalResult.from_json(json.loads(path.read_text())))
    return sorted(results, key=lambda r: r.step)


def plot_run(out_dir: Path) -> list[Path]:
    """Write reward/accuracy/KL/length PNGs under ``plots/``; returns the files written."""
    plt = _pyplot()
    every_step = load_metrics(out_dir)
    metrics = [m for m in every_step if m.get("stage_type", "rl") == "rl"]  # SFT/DPO: loss only
    evals = latest_eval_per_step(out_dir, "heldout")
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 3.5))
    domains = sorted({d for m in metrics for d in m["domain_rewards"]})
    for domain in domains:
        xs = [m["step"] for m in metrics if domain in m["domain_rewards"]]
        ys = [m["domain_rewards"][domain] for m in metrics if domain in m["domain_rewards"]]
        ax.plot(xs, ys, marker="o", label=f"train reward: {domain}")
    for domain in sorted({d for r in evals for d in r.accuracy}):
        xs = [r.step for r in evals if domain in r.accuracy]
        ys = [r.accuracy[domain] for r in evals if domain in r.accuracy]
        ax.plot(xs, ys, marker="s", linestyle="--", label=f"held-out acc: {domain}")
    ax.set_xlabel("step")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Reward and held-out accuracy per domain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(plots / "reward_accuracy.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    for key, title, name in [
        ("kl", "KL to reference (k3, per token)", "kl.png"),
        ("response_length", "Mean response length (tokens)", "response_length.png"),
        ("loss", "Policy loss", "loss.png"),
    ]:
        fig, ax = plt.subplots(figsize=(6, 3))
        shown = every_step if key == "loss" else metrics
        ax.plot([m["step"] for m in shown], [m[key] for m in shown], marker="o")
        ax.set_xlabel("step")
        ax.set_title(title)
        fig.tight_layout()
        written.append(plots / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def comparison_rows(base: EvalResult, trained: EvalResult) -> list[tuple[str, float, float, int]]:
    """(domain, base accuracy, trained accuracy, items) for domains both evaluated."""
    return [
        (d, base.accuracy[d], trained.accuracy[d], trained.counts[d])
        for d in sorted(trained.accuracy)
        if d in base.accuracy
    ]


def stage_rows(
    stages: list[dict[str, Any]], evals: list[EvalResult]
) -> list[tuple[str, str, int, int, float | None, float | None]]:
    """(stage, type, first step, last step, held-out before, after) for each stage: what
    each stage did, from the evaluations at its boundaries (None where none ran).

    >>> r = lambda step, acc: EvalResult(step, "heldout", {"a": acc}, {"a": 4}, 0.0)
    >>> stage_rows([{"name": "sft", "type": "sft", "firstStep": 1, "lastStep": 3}],
    ...            [r(0, 0.25), r(3, 0.5)])
    [('sft', 'sft', 1, 3, 0.25, 0.5)]
    """
    by_step = {e.step: e.overall for e in evals}
    return [(s["name"], s["type"], s["firstStep"], s["lastStep"],
             by_step.get(s["firstStep"] - 1), by_step.get(s["lastStep"])) for s in stages]


def write_report(out_dir: Path, title: str, extra: dict[str, Any] | None = None,
                 stages: list[dict[str, Any]] | None = None) -> Path:
    """``report.md``: base vs trained held-out accuracy, what each stage did, flips, plots,
    alerts, spot checks."""
    evals = latest_eval_per_step(out_dir, "heldout")
    lines = [f"# {title}", ""]
    for key, value in (extra or {}).items():
        lines.append(f"- **{key}:** {value}")
    lines.append("")
    if stages and len(stages) > 1:
        lines += ["## Held-out accuracy by stage", "",
                  "| stage | type | steps | before | after | change |",
                  "| --- | --- | --- | ---: | ---: | ---: |"]
        for name, kind, first, last, before, after in stage_rows(stages, evals):
            change = f"{after - before:+.1%}" if before is not None and after is not None else "-"
            lines.append(f"| {name} | {kind} | {first}-{last} | {_pct(before)} | {_pct(after)} "
                         f"| {change} |")
        lines.append("")
    if len(evals) >= 1:
        base, trained = evals[0], evals[-1]
        lines += [
            f"## Held-out accuracy: base (step {base.step}) vs trained (step {trained.step})",
            "",
            "| domain | base | trained | change | items |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for domain, before, after, n in comparison_rows(base, trained):
            lines.append(f"| {domain} | {before:.1%} | {after:.1%} | {after - before:+.1%} | {n} |")
        lines.append(
            f"| **all** | {base.overall:.1%} | {trained.overall:.1%} | "
            f"{trained.overall - base.overall:+.1%} | {sum(trained.counts.values())} |"
        )
        lines += ["", *_flip_examples(base, trained)]
    regression = latest_eval_per_step(out_dir, "regression")
    if len(regression) >= 2:
        first, last = regression[0], regression[-1]
        lines += [
            "## Regression set (scored on the base model at step 0)",
            "",
            f"{first.overall:.1%} at step {first.step} -> {last.overall:.1%} at step {last.step}",
            "",
        ]
    lines += ["## Plots", ""]
    for png in sorted((out_dir / "plots").glob("*.png")):
        lines.append(f"![{png.stem}](plots/{png.name})")
    alerts = out_dir / "audit" / "alerts.jsonl"
    count = len(alerts.read_text().splitlines()) if alerts.is_file() else 0
    lines += ["", "## Audit", "", f"{count} reward-hacking alert(s); see audit/alerts.jsonl and "
              "audit/spot_checks.md.", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _flip_examples(base: EvalResult, trained: EvalResult, limit: int = 3) -> list[str]:
    """A few held-out items that went from fail to pass (and pass to fail), verbatim."""
    before = {i.task_id: i for i in base.items}
    fixed = [i for i in trained.items if i.passed and i.task_id in before
             and not before[i.task_id].passed]
    broken = [i for i in trained.items if not i.passed and i.task_id in before
              and before[i.task_id].passed]
    lines = [f"{len(fixed)} held-out items fixed, {len(broken)} broken.", ""]
    for label, items in (("Fixed", fixed), ("Broken", broken)):
        for item in items[:limit]:
            lines += [
                f"**{label}** ({item.domain}): {item.prompt}",
                "",
                "Base:",
                "```text",
                before[item.task_id].completion.strip()[:400],
                "```",
                "Trained:",
                "```text",
                item.completion.strip()[:400],
                "```",
                "",
            ]
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
