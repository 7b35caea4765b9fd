"""300 domains: the step table, the plots and the report stay readable (overall, worst-k,
best-k, a heatmap of the evaluation matrix) and still hold every number on disk."""

from __future__ import annotations

import json
import re
from pathlib import Path

from rich.console import Console

from posttrain.trainer.evaluation.heldout import EvalItem, EvalResult, save_eval
from posttrain.trainer.observe.domain_tables import MANY_DOMAINS, SHOW_K, TABLE_K, readable_rows
from posttrain.trainer.observe.run_report import plot_run, write_report
from posttrain.trainer.observe.step_metrics import ProgressReporter, StepMetrics

DOMAINS = [f"skill-{i:03d}" for i in range(300)]


def _accuracy(i: int, step: int) -> float:
    """Domain i's synthetic accuracy: spread over [0, 1], rising with the step."""
    return min(1.0, (i % 100) / 100 + 0.05 * step)


def _metrics(step: int) -> StepMetrics:
    rewards = {d: _accuracy(i, step) for i, d in enumerate(DOMAINS)}
    return StepMetrics(
        step=step,
        reward_mean=sum(rewards.values()) / len(rewards),
        domain_rewards=rewards,
        domain_pass_rates=rewards,
        loss=0.1,
        grad_norm=1.0,
        kl=0.0,
        clip_fraction=0.0,
        ratio_mean=1.0,
        response_length=10.0,
        kept_groups=4,
        total_groups=8,
        weight_version=step,
        staleness=0,
        applied=True,
        skip_reason="",
        rollout_seconds=1.0,
        train_seconds=1.0,
        step_seconds=2.0,
    )


def _write_run(out: Path, steps: int = 3) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "metrics.jsonl").open("w") as fh:
        for step in range(1, steps + 1):
            fh.write(json.dumps(_metrics(step).to_json()) + "\n")
    for step in (0, steps):
        items = [
            EvalItem(f"{d}-{k}", d, "q", "1", "1", k < 2 + (i % 3), 1.0)
            for i, d in enumerate(DOMAINS)
            for k in range(4)
        ]
        accuracy = {d: (2 + (i % 3)) / 4 if step else 0.25 for i, d in enumerate(DOMAINS)}
        save_eval(EvalResult(step, "heldout", accuracy, dict.fromkeys(DOMAINS, 4), 1.0, items), out)


def test_the_step_table_has_the_same_columns_at_300_domains_as_at_two() -> None:
    console = Console(width=400, record=True)
    many = ProgressReporter._row_table(_metrics(1))
    two = ProgressReporter._row_table(
        _metrics(1).__class__(**{**_metrics(1).to_json(), "domain_rewards": {"a": 0.5, "b": 1.0}})
    )
    assert len(many.columns) == len(two.columns)
    console.print(many)
    header, *rows = console.export_text().splitlines()
    assert f"worst {TABLE_K}" in header and f"best {TABLE_K}" in header
    assert len(rows) == TABLE_K  # one line per worst/best domain
    assert "skill-000=0.05" in rows[0]  # the worst domain at step 1, with its value
    assert "skill-099=1.00" in rows[0] or "skill-299=1.00" in rows[0]  # a best one
    assert max(len(line) for line in rows) < 160  # not 300 columns


def test_plots_and_report_at_300_domains(tmp_path: Path) -> None:
    from PIL import Image

    _write_run(tmp_path)
    written = plot_run(tmp_path)
    names = {p.name for p in written}
    assert {"reward_accuracy.png", "eval_matrix.png"} <= names
    with Image.open(tmp_path / "plots" / "eval_matrix.png") as heatmap:
        width, height = heatmap.size
    assert height > width  # one row per domain: a tall matrix, not a legend of 300 lines
    report = write_report(tmp_path, "many domains").read_text()
    table = [line for line in report.splitlines() if line.startswith("| skill-")]
    assert len(table) == 2 * SHOW_K
    # worst (accuracy 0.5) first, then best (1.0); every domain is still on disk
    assert all(re.search(r"\| 50\.0% \|", line) for line in table[:SHOW_K])
    assert all(re.search(r"\| 100\.0% \|", line) for line in table[SHOW_K:])
    assert "5 worst and 5 best of 300 domains" in report
    on_disk = json.loads((tmp_path / "eval" / "heldout_step0003.json").read_text())
    assert len(on_disk["accuracy"]) == 300


def test_a_few_domains_keep_one_row_each() -> None:
    rows = [(f"d{i}", 0.0, 0.5, 4) for i in range(MANY_DOMAINS)]
    assert readable_rows(rows) == (rows, None)
