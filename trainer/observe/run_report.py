"""Plots and the end-of-run report: did held-out accuracy improve, and at what cost?

Everything is drawn from the files the run wrote (``metrics.jsonl``, ``eval/*.json``),
so a report can be rebuilt for any finished or interrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from posttrain.trainer.evaluation.heldout import EvalItem, EvalResult
from posttrain.trainer.observe.domain_tables import (
    MANY_DOMAINS,
    plot_eval_heatmap,
    plot_reward_summary,
    readable_rows,
)
from posttrain.trainer.observe.heldout_change import (
    PairedChange,
    change_text,
    paired_change,
    stratum_changes,
)
from posttrain.trainer.observe.step_metrics import load_metrics


def _pyplot() -> Any:
    """pyplot for files, without the warnings a pod's first plot would log: a non-writable
    $HOME (pods run as a user without one) gets a config dir in /tmp of our choosing instead
    of matplotlib's "created a temporary cache directory" WARNING, and the one-time "building
    the font cache" notice is not a warning for anyone to act on."""
    config_dir = Path(os.environ.get("MPLCONFIGDIR") or Path.home() / ".config" / "matplotlib")
    if not _writable(config_dir):
        os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix="posttrain-matplotlib-")
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    import matplotlib

    matplotlib.use("Agg")  # files only: trainer pods and CI have no display
    import matplotlib.pyplot as plt

    return plt


def _writable(directory: Path) -> bool:
    """Whether matplotlib could use ``directory`` (creating it if need be)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


def latest_eval_per_step(out_dir: Path, split: str) -> list[EvalResult]:
    """Eval results of one split ordered by step (the newest file wins for a step)."""
    results = []
    for path in sorted((out_dir / "eval").glob(f"{split}_step*.json")):
        results.append(EvalResult.from_json(json.loads(path.read_text())))
    return sorted(results, key=lambda r: r.step)


def plot_run(out_dir: Path, kl_coef: float | None = None) -> list[Path]:
    """Write reward/accuracy/KL/length PNGs under ``plots/``; returns the files written.

    ``kl_coef`` (spec.algorithm.klCoef, when known) lets the KL plot say why it is flat:
    with a weight of 0 no reference model is loaded and KL is not measured.
    """
    plt = _pyplot()
    every_step = load_metrics(out_dir)
    metrics = [m for m in every_step if m.get("stage_type", "rl") == "rl"]  # SFT/DPO: loss only
    evals = latest_eval_per_step(out_dir, "heldout")
    plots = out_dir / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    if len({d for m in metrics for d in m["domain_rewards"]}) > MANY_DOMAINS:
        # One line per domain would be unreadable: overall, worst-k, best-k and a heatmap.
        written = [plot_reward_summary(plt, metrics, evals, plots / "reward_accuracy.png")]
        heatmap = plot_eval_heatmap(plt, evals, plots / "eval_matrix.png")
        written += [heatmap] if heatmap else []
    else:
        written = [plot_reward_accuracy(plt, metrics, evals, plots / "reward_accuracy.png")]
    for key, title, ylabel, name in [
        ("kl", "KL to the reference model (k3 estimate)", "KL (nats / token)", "kl.png"),
        ("response_length", "Mean response length", "tokens", "response_length.png"),
        (
            "loss",
            "Loss (policy; SFT cross-entropy and DPO loss in their stages)",
            "loss (per token)",
            "loss.png",
        ),
    ]:
        fig, ax = plt.subplots(figsize=(6.5, 3))
        shown = every_step if key == "loss" else metrics
        values = [m[key] for m in shown]
        ax.plot([m["step"] for m in shown], values, marker="o")
        _step_axis(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        mark_curriculum_changes(ax, shown)
        if key == "kl":
            note = kl_note(kl_coef, values)
            if note:
                ax.text(
                    0.5,
                    0.5,
                    note,
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    fontsize=9,
                    bbox={"facecolor": "white", "edgecolor": "#999"},
                )
        fig.tight_layout()
        written.append(plots / name)
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written


def plot_reward_accuracy(
    plt: Any, metrics: list[dict[str, Any]], evals: list[EvalResult], path: Path
) -> Path:
    """Train reward per domain (lines: one point per step) and held-out accuracy (markers
    only: measured at a few steps, so a line between them would invent the values between).

    The legend sits outside the axes, where it cannot hide a point, and dotted vertical
    lines mark curriculum promotions: the reward drops there because the prompts got harder.
    """
    fig, ax = plt.subplots(figsize=(8, 3.8))
    domains = sorted({d for m in metrics for d in m["domain_rewards"]})
    colors: dict[str, Any] = {}
    for domain in domains:
        xs = [m["step"] for m in metrics if domain in m["domain_rewards"]]
        ys = [m["domain_rewards"][domain] for m in metrics if domain in m["domain_rewards"]]
        (line,) = ax.plot(xs, ys, marker="o", markersize=4, label=f"train reward: {domain}")
        colors[domain] = line.get_color()
    eval_domains = sorted({d for r in evals for d in r.accuracy})
    last_step = max([1, *[m["step"] for m in metrics], *[r.step for r in evals]])
    for index, domain in enumerate(eval_domains):
        # Domains measured at the same step with the same accuracy would hide each other:
        # each is nudged sideways by a small, fixed amount (its step is still readable).
        dodge = 0.015 * last_step * (index - (len(eval_domains) - 1) / 2)
        xs = [r.step + dodge for r in evals if domain in r.accuracy]
        ys = [r.accuracy[domain] for r in evals if domain in r.accuracy]
        ax.plot(
            xs,
            ys,
            marker="D",
            markersize=8,
            linestyle="none",
            markeredgecolor="black",
            color=colors.get(domain),
            label=f"held-out accuracy: {domain}",
            zorder=3,
        )
    _step_axis(ax)
    ax.set_ylabel("reward / accuracy (0-1)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Train reward and held-out accuracy per domain")
    if mark_curriculum_changes(ax, metrics):
        ax.plot([], [], color="#777", linestyle=":", label="curriculum: harder stratum")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _step_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers


def curriculum_changes(metrics: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, "domain -> stratum") wherever a domain's stratum (or the run's stage) changed.

    >>> curriculum_changes([{"step": 1, "strata": {"a": "easy"}},
    ...                     {"step": 2, "strata": {"a": "easy"}},
    ...                     {"step": 3, "strata": {"a": "hard"}, "stage": "s2"}])
    [(3, 'a -> hard'), (3, 'stage s2')]
    """
    changes: list[tuple[int, str]] = []
    previous: dict[str, Any] = {}
    previous_stage: Any = None
    for index, record in enumerate(metrics):
        strata = record.get("strata") or {}
        for domain, stratum in sorted(strata.items()):
            if index > 0 and domain in previous and previous[domain] != stratum:
                changes.append((int(record["step"]), f"{domain} -> {stratum}"))
        previous.update(strata)
        stage = record.get("stage")
        if index > 0 and stage is not None and stage != previous_stage:
            changes.append((int(record["step"]), f"stage {stage}"))
        previous_stage = stage
    return changes


def mark_curriculum_changes(ax: Any, metrics: list[dict[str, Any]]) -> bool:
    """Dotted vertical lines, labelled, at every curriculum promotion or stage change."""
    changes = curriculum_changes(metrics)
    labels: dict[int, list[str]] = {}
    for step, label in changes:
        labels.setdefault(step, []).append(label)
    for step, names in labels.items():
        ax.axvline(step - 0.5, color="#777", linestyle=":", linewidth=1)
        ax.annotate(
            ", ".join(names),
            xy=(step - 0.5, 0.98),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=7,
            color="#333",
            ha="right",
            va="top",
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    return bool(changes)


def kl_note(kl_coef: float | None, values: list[float]) -> str | None:
    """Why a KL plot is flat at 0, when it is.

    >>> kl_note(0.0, [0.0, 0.0])
    'KL weight (klCoef) is 0: no reference model, KL not measured'
    >>> kl_note(None, [0.0]), kl_note(0.05, [0.1])
    ('KL is 0 at every step (klCoef 0 means it is not measured)', None)
    """
    if kl_coef is not None and kl_coef == 0:
        return "KL weight (klCoef) is 0: no reference model, KL not measured"
    if kl_coef is None and values and all(v == 0 for v in values):
        return "KL is 0 at every step (klCoef 0 means it is not measured)"
    return None


def comparison_rows(base: EvalResult, trained: EvalResult) -> list[tuple[str, float, float, int]]:
    """(domain, base accuracy, trained accuracy, items) for domains both evaluated."""
    return [
        (d, base.accuracy[d], trained.accuracy[d], trained.counts[d])
        for d in sorted(trained.accuracy)
        if d in base.accuracy
    ]


def trained_comparison(evals: list[EvalResult]) -> tuple[EvalResult, EvalResult] | None:
    """(base, trained) held-out results, or None while only the base model was evaluated.

    An interrupted run may hold nothing but the step-0 evaluation; calling that "trained"
    would claim a result the run never measured.
    """
    if len(evals) < 2 or evals[-1].step <= evals[0].step:
        return None
    return evals[0], evals[-1]


def stage_rows(
    stages: list[dict[str, Any]], evals: list[EvalResult]
) -> list[tuple[str, str, int, int, EvalResult | None, EvalResult | None]]:
    """(stage, type, first step, last step, held-out before, after) for each stage: what
    each stage did, from the evaluations at its boundaries (None where none ran).

    >>> r = lambda step, acc: EvalResult(step, "heldout", {"a": acc}, {"a": 4}, 0.0)
    >>> [(name, before.overall, after.overall) for name, _, _, _, before, after in stage_rows(
    ...     [{"name": "sft", "type": "sft", "firstStep": 1, "lastStep": 3}], [r(0, 0.25), r(3, 0.5)])]
    [('sft', 0.25, 0.5)]
    """
    by_step = {e.step: e for e in evals}
    return [
        (
            s["name"],
            s["type"],
            s["firstStep"],
            s["lastStep"],
            by_step.get(s["firstStep"] - 1),
            by_step.get(s["lastStep"]),
        )
        for s in stages
    ]


def stage_training(records: list[dict[str, Any]], stage: str) -> str:
    """What a stage's own steps measured, first -> last step: SFT loss; DPO loss, reward
    margin and preference accuracy; RL mean reward (and KL when it was penalised).

    >>> stage_training([{"stage": "s", "stage_type": "sft", "loss": 0.9},
    ...                 {"stage": "s", "stage_type": "sft", "loss": 0.3}], "s")
    'loss 0.900 -> 0.300'
    >>> stage_training([{"stage": "d", "stage_type": "dpo", "loss": 0.69, "reward_margin": 0.0,
    ...                  "reward_accuracy": 0.0}, {"stage": "d", "stage_type": "dpo",
    ...                  "loss": 0.5, "reward_margin": 0.4, "reward_accuracy": 0.75}], "d")
    'loss 0.690 -> 0.500, margin +0.000 -> +0.400, pairs ranked right 0% -> 75%'
    >>> stage_training([{"stage": "r", "reward_mean": 0.5, "kl": 0.0, "entropy": 0.9},
    ...                 {"stage": "r", "reward_mean": 0.7, "kl": 0.02, "entropy": 0.6}], "r")
    'reward 0.500 -> 0.700, kl 0.0000 -> 0.0200, entropy 0.900 -> 0.600'
    """
    mine = [r for r in records if r.get("stage") == stage]
    if not mine:
        return "-"
    first, last = mine[0], mine[-1]
    kind = first.get("stage_type", "rl")
    if kind == "rl":
        text = f"reward {first['reward_mean']:.3f} -> {last['reward_mean']:.3f}"
        if any(r.get("kl") for r in mine):
            text += f", kl {first['kl']:.4f} -> {last['kl']:.4f}"
        if first.get("entropy") is not None and last.get("entropy") is not None:
            text += f", entropy {first['entropy']:.3f} -> {last['entropy']:.3f}"
        return text
    text = f"loss {first['loss']:.3f} -> {last['loss']:.3f}"
    if kind == "dpo" and first.get("reward_margin") is not None:
        text += (
            f", margin {first['reward_margin']:+.3f} -> {last['reward_margin']:+.3f}, "
            f"pairs ranked right {first['reward_accuracy']:.0%} -> {last['reward_accuracy']:.0%}"
        )
    return text


def write_report(
    out_dir: Path,
    title: str,
    extra: dict[str, Any] | None = None,
    stages: list[dict[str, Any]] | None = None,
) -> Path:
    """``report.md``: base vs trained held-out accuracy, what each stage did, flips, plots,
    alerts, spot checks."""
    evals = latest_eval_per_step(out_dir, "heldout")
    lines = [f"# {title}", ""]
    for key, value in (extra or {}).items():
        lines.append(f"- **{key}:** {value}")
    lines.append("")
    if stages and len(stages) > 1:
        lines += _stage_section(out_dir, stages, evals)
    pair = trained_comparison(evals)
    if pair is not None:
        lines += _comparison_section(*pair)
    elif evals:
        only = evals[0]
        lines += [
            f"## Held-out accuracy at step {only.step} only",
            "",
            "The run stopped before its next evaluation, so there is no trained result yet; "
            "resume it to get one.",
            "",
            "| domain | accuracy | items |",
            "| --- | ---: | ---: |",
            *[f"| {d} | {a:.1%} | {only.counts[d]} |" for d, a in only.accuracy.items()],
            f"| **all** | {only.overall:.1%} | {sum(only.counts.values())} |",
            "",
        ]
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
    lines += [
        "",
        "## Audit",
        "",
        f"{count} reward-hacking alert(s); see audit/alerts.jsonl and audit/spot_checks.md.",
        "",
    ]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def _stage_section(
    out_dir: Path, stages: list[dict[str, Any]], evals: list[EvalResult]
) -> list[str]:
    """The "Held-out accuracy by stage" table: before and after each stage, the change with
    its paired standard error (same items both times, ``heldout_change``), the items it fixed
    and broke, and what it trained."""
    lines = [
        "## Held-out accuracy by stage",
        "",
        "| stage | type | steps | before | after | change ± s.e. | fixed / broken "
        "| training (first -> last step) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    records = load_metrics(out_dir)
    rows = stage_rows(stages, evals)
    for name, kind, first_step, last_step, before, after in rows:
        change, flips = "-", "-"
        if before is not None and after is not None:
            change = change_text(before, after)
            paired = paired_change(before, after)
            flips = "-" if paired is None else _flips(paired)
        lines.append(
            f"| {name} | {kind} | {first_step}-{last_step} | {_pct(before)} | {_pct(after)} "
            f"| {change} | {flips} | {stage_training(records, name)} |"
        )
    lines += _strata_rows(
        [
            (name, before, after)
            for name, _, _, _, before, after in rows
            if before is not None and after is not None
        ]
    )
    lines += [
        "",
        "s.e.: the standard error of the per-item change; a change within about two of them "
        "is what re-drawing the items could give (seeds add run-to-run spread: "
        "bench/stage_gains.py).",
        "",
    ]
    return lines


def _strata_rows(rows: list[tuple[str, EvalResult, EvalResult]]) -> list[str]:
    """Each stage's change per difficulty stratum (where a domain has several), from its
    (name, before, after) evaluations: where a stage gained and where it lost, which the
    overall change can hide."""
    per_stage = [(name, stratum_changes(before, after)) for name, before, after in rows]
    names = list(per_stage[0][1]) if per_stage else []
    if not names:
        return []
    lines = [
        "",
        "By difficulty stratum (change ± s.e., fixed / broken of n):",
        "",
        "| stage | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    for name, changes in per_stage:
        cells = [
            f"{c.text()}, {_flips(c)}" if (c := changes.get(group)) else "-" for group in names
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _flips(change: PairedChange) -> str:
    return f"{change.fixed} / {change.broken} of {change.n}"


def _comparison_section(base: EvalResult, trained: EvalResult) -> list[str]:
    """Base vs trained held-out accuracy per domain, episodes' figures, and flipped items."""
    lines = [
        f"## Held-out accuracy: base (step {base.step}) vs trained (step {trained.step})",
        "",
        "| domain | base | trained | change | items |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    shown, left_out = readable_rows(comparison_rows(base, trained))
    for domain, before, after, n in shown:
        lines.append(f"| {domain} | {before:.1%} | {after:.1%} | {after - before:+.1%} | {n} |")
    lines.append(
        f"| **all** | {base.overall:.1%} | {trained.overall:.1%} | {change_text(base, trained)} "
        f"| {sum(trained.counts.values())} |"
    )
    if left_out:
        lines += [
            "",
            f"Shown: {left_out}; every domain is in "
            f"eval/heldout_step{trained.step:04d}.json and plots/eval_matrix.png.",
        ]
    return [*lines, "", *_agent_rows(base, trained), *_flip_examples(base, trained)]


def _agent_rows(base: EvalResult, trained: EvalResult) -> list[str]:
    """Episode metrics of environment domains, base vs trained (empty when there are none)."""
    if not trained.agent:
        return []
    lines = [
        "## Agent episodes (held-out): base -> trained",
        "",
        "| domain | success | mean turns | valid tool calls | recovery after failure | errored |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for domain, after in sorted(trained.agent.items()):
        before = base.agent.get(domain, {})

        def pair(
            key: str,
            percent: bool = True,
            b: dict[str, float] = before,
            a: dict[str, float] = after,
        ) -> str:
            shown = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:.2f}")
            return (f"{shown(b[key])} -> " if key in b else "") + shown(a.get(key, 0.0))

        lines.append(
            f"| {domain} | {pair('success_rate')} | {pair('mean_turns', False)} | "
            f"{pair('valid_tool_call_rate')} | {pair('recovery_rate')} | "
            f"{int(after.get('errored', 0))} |"
        )
    return [*lines, ""]


def flipped_items(
    base: EvalResult, trained: EvalResult
) -> tuple[list[tuple[EvalItem, EvalItem]], list[tuple[EvalItem, EvalItem]]]:
    """(fixed, broken): held-out items that went fail -> pass and pass -> fail, as
    (base item, trained item) pairs. The Markdown and the HTML report both show them."""
    before = {i.task_id: i for i in base.items}
    fixed = [
        (before[i.task_id], i)
        for i in trained.items
        if i.task_id in before and i.passed and not before[i.task_id].passed
    ]
    broken = [
        (before[i.task_id], i)
        for i in trained.items
        if i.task_id in before and not i.passed and before[i.task_id].passed
    ]
    return fixed, broken


def code_fence(text: str) -> str:
    """A backtick fence longer than any backtick run in ``text``, so a completion that
    contains its own fenced code block cannot close ours early.

    >>> code_fence("plain"), code_fence("```python\\nx = 1\\n```")
    ('```', '````')
    """
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _flip_examples(base: EvalResult, trained: EvalResult, limit: int = 3) -> list[str]:
    """A few held-out items that went from fail to pass (and pass to fail), verbatim."""
    fixed, broken = flipped_items(base, trained)
    lines = [f"{len(fixed)} held-out items fixed, {len(broken)} broken.", ""]
    for label, pairs in (("Fixed", fixed), ("Broken", broken)):
        for before, item in pairs[:limit]:
            lines += [f"**{label}** ({item.domain}): {item.prompt}", ""]
            for name, completion in (("Base", before.completion), ("Trained", item.completion)):
                text = completion.strip()[:400]
                fence = code_fence(text)
                lines += [f"{name}:", "", f"{fence}text", text, fence, ""]
    return lines


def _pct(result: EvalResult | None) -> str:
    return "-" if result is None else f"{result.overall:.1%}"
