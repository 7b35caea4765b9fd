"""What a person (rich), a tracing backend (OpenTelemetry) and Prometheus see of each step.

One ``StepMetrics`` record per step feeds all three, so the terminal table, the span
attributes and the gauges can never disagree. The JSONL metrics file is the source the
plots and the report are drawn from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.trace import Span
from prometheus_client import Counter, Gauge
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from posttrain.telemetry import get_tracer
from posttrain.trainer.observe.domain_tables import MANY_DOMAINS, TABLE_K, table_summary

tracer = get_tracer(__name__)

STEP = Gauge("posttrain_trainer_step", "Last completed optimizer step")
REWARD = Gauge("posttrain_trainer_reward_mean", "Mean reward of the last batch", ["domain"])
LOSS = Gauge("posttrain_trainer_loss", "Policy loss of the last step")
KL = Gauge("posttrain_trainer_kl", "Mean per-token KL to the reference at the last step")
STEP_SECONDS = Gauge("posttrain_trainer_step_seconds", "Wall time of the last step")
ENTROPY = Gauge(
    "posttrain_trainer_sampled_entropy",
    "Mean -log p of the last batch's sampled tokens (per-token policy entropy estimate)",
)
STALENESS = Gauge(
    "posttrain_trainer_staleness_steps",
    "Weight versions the last batch's samples were behind the trainer's weights",
)
SKIPPED_STEPS = Counter(
    "posttrain_trainer_skipped_steps_total", "Steps whose update was not applied", ["reason"]
)


@dataclass
class StepMetrics:
    """Everything measured in one step; one line of ``metrics.jsonl``."""

    step: int
    reward_mean: float
    domain_rewards: dict[str, float]
    domain_pass_rates: dict[str, float]
    loss: float
    grad_norm: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    response_length: float
    kept_groups: int
    total_groups: int
    weight_version: int
    staleness: int
    applied: bool
    skip_reason: str
    rollout_seconds: float
    train_seconds: float
    step_seconds: float
    strata: dict[str, str] = field(default_factory=dict)
    stage: str = "rl"  # the pipeline stage (spec.stages[].name) this step belongs to
    stage_type: str = "rl"
    learning_rate: float | None = None  # the stage's schedule at this step
    masked_samples: int = 0  # a judge / reward model could not score them: not trained on
    rollout_wait_seconds: float = 0.0  # blocked on rollouts: take() + replicas' drain
    entropy: float | None = None  # sampled_entropy of the batch; None: it had no logprobs

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def sampled_entropy(groups: list[list[Any]]) -> float | None:
    """Mean -log p of the sampled tokens under the policy that sampled them: a Monte Carlo
    estimate of the policy's per-token entropy at the rollout temperature, free (the rollout
    returned the log-probs; no forward over the vocabulary). A fast fall is the policy
    collapsing onto few answers, which an RL stage after SFT must not do quietly (verl logs
    the exact value as ``actor/entropy``). An episode counts its model turns only (its
    ``loss_mask``), not the environment's tokens; None when the batch carries no log-probs.

    >>> from types import SimpleNamespace as S
    >>> sampled_entropy([[S(logprobs=[-1.0, -3.0])], [S(logprobs=[-2.0])]])
    2.0
    >>> episode = S(logprobs=[-0.5, 0.0, 0.0, -1.5], loss_mask=[1, 0, 0, 1])
    >>> sampled_entropy([[episode]]), sampled_entropy([])
    (1.0, None)
    """
    total, count = 0.0, 0
    for group in groups:
        for sample in group:
            logprobs = list(getattr(sample, "logprobs", None) or [])
            mask = getattr(sample, "loss_mask", None)
            if mask is not None:  # an episode: the environment's tokens are not sampled
                logprobs = [lp for lp, policy in zip(logprobs, mask, strict=True) if policy]
            total -= sum(logprobs)
            count += len(logprobs)
    return total / count if count else None


@dataclass
class StageStepMetrics:
    """One SFT or DPO step; one line of ``metrics.jsonl`` (``stage_type`` tells them apart
    from RL lines). DPO fields are None for SFT, as TRL logs them."""

    step: int  # global step, numbered across stages
    stage: str
    stage_type: str  # sft | dpo
    stage_step: int  # 1-based step within the stage
    loss: float
    grad_norm: float
    applied: bool
    skip_reason: str
    examples: int  # examples (sft) or pairs (dpo) in the step
    tokens: int  # completion tokens the loss covered
    learning_rate: float
    step_seconds: float
    skipped_examples: dict[str, int] = field(default_factory=dict)  # the stage's data, by reason
    truncated_examples: int = 0
    reward_chosen: float | None = None  # mean beta * (log pi - log pi_ref) of chosen answers
    reward_rejected: float | None = None
    reward_margin: float | None = None
    reward_accuracy: float | None = None  # share of pairs with chosen reward > rejected

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ProgressReporter:
    """Rich progress bar + a per-step table row, OTel spans, gauges, and metrics.jsonl."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0) -> None:
        self.metrics_path = out_dir / "metrics.jsonl"
        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[summary]}"),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, summary=""
        )
        self.history: list[StepMetrics] = []

    def __enter__(self) -> ProgressReporter:
        self.progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.progress.stop()

    @contextmanager
    def step_span(self, step: int) -> Iterator[Span]:
        """One OpenTelemetry span per step; attributes are filled in by :meth:`record`."""
        with tracer.start_as_current_span("trainer.step") as span:
            span.set_attribute("step", step)
            yield span

    def record(self, metrics: StepMetrics, span: Span | None = None) -> None:
        """Publish one step to every sink."""
        self.history.append(metrics)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(metrics.to_json()) + "\n")
        STEP.set(metrics.step)
        LOSS.set(metrics.loss)
        KL.set(metrics.kl)
        if metrics.entropy is not None:
            ENTROPY.set(metrics.entropy)
        STEP_SECONDS.set(metrics.step_seconds)
        STALENESS.set(metrics.staleness)
        REWARD.labels("all").set(metrics.reward_mean)
        for domain, value in metrics.domain_rewards.items():
            REWARD.labels(domain).set(value)
        if not metrics.applied:
            SKIPPED_STEPS.labels(metrics.skip_reason.split(" ")[0] or "unknown").inc()
        if span is not None:
            span.set_attribute("reward", metrics.reward_mean)
            span.set_attribute("loss", metrics.loss)
            span.set_attribute("kl", metrics.kl)
            if metrics.entropy is not None:
                span.set_attribute("entropy", metrics.entropy)
            span.set_attribute("applied", metrics.applied)
        summary = f"reward {metrics.reward_mean:.3f} loss {metrics.loss:+.4f}"
        self.progress.update(self.task, completed=metrics.step, summary=summary)
        self.progress.console.print(self._row_table(metrics))

    def record_stage_step(self, metrics: StageStepMetrics, span: Span | None = None) -> None:
        """Publish one SFT/DPO step to every sink (file, gauges, span, terminal)."""
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(metrics.to_json()) + "\n")
        STEP.set(metrics.step)
        LOSS.set(metrics.loss)
        STEP_SECONDS.set(metrics.step_seconds)
        if not metrics.applied:
            SKIPPED_STEPS.labels(metrics.skip_reason.split(" ")[0] or "unknown").inc()
        if span is not None:
            span.set_attribute("stage", metrics.stage)
            span.set_attribute("loss", metrics.loss)
            span.set_attribute("applied", metrics.applied)
        summary = f"{metrics.stage} loss {metrics.loss:.4f}"
        line = (
            f"step {metrics.step} [{metrics.stage} {metrics.stage_step}] "
            f"loss {metrics.loss:.4f} grad {metrics.grad_norm:.3f} "
            f"tokens {metrics.tokens} {metrics.step_seconds:.1f}s"
        )
        if metrics.reward_accuracy is not None:
            summary += f" acc {metrics.reward_accuracy:.2f}"
            line += f" margin {metrics.reward_margin:+.4f} acc {metrics.reward_accuracy:.2f}"
        if not metrics.applied:
            line += f" skipped: {metrics.skip_reason}"
        self.progress.update(self.task, completed=metrics.step, summary=summary)
        self.progress.console.print(line)

    def log(self, message: str) -> None:
        self.progress.console.print(message)

    @staticmethod
    def _row_table(m: StepMetrics) -> Table:
        table = Table(show_header=m.step <= 1, box=None, pad_edge=False)
        if len(m.domain_rewards) > MANY_DOMAINS:  # a column per domain would not fit
            domain_columns = [f"worst {TABLE_K}", f"best {TABLE_K}"]
            domain_cells = list(table_summary(m.domain_rewards))
        else:
            domain_columns = [f"r:{d}" for d in m.domain_rewards]
            domain_cells = [f"{v:.3f}" for v in m.domain_rewards.values()]
        columns = [
            "step",
            "reward",
            *domain_columns,
            "loss",
            "kl",
            "clip",
            "len",
            "groups",
            "v",
            "secs",
        ]
        for name in columns:
            wide = name in domain_columns and len(m.domain_rewards) > MANY_DOMAINS
            table.add_column(name, justify="right", min_width=16 if wide else 7, overflow="fold")
        table.add_row(
            str(m.step),
            f"{m.reward_mean:.3f}",
            *domain_cells,
            f"{m.loss:+.4f}" if m.applied else f"skip:{m.skip_reason[:8]}",
            f"{m.kl:.4f}",
            f"{m.clip_fraction:.3f}",
            f"{m.response_length:.0f}",
            f"{m.kept_groups}/{m.total_groups}",
            str(m.weight_version),
            f"{m.step_seconds:.0f}",
        )
        return table


def load_metrics(out_dir: Path) -> list[dict[str, Any]]:
    """Lines of ``metrics.jsonl``; a resumed run's repeated steps keep the newest line."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]


def discard_records_after(out_dir: Path, step: int) -> int:
    """Drop what an earlier attempt recorded past ``step``; returns how many steps were dropped.

    A run resumes from its last checkpoint, so the steps an interrupted attempt took after
    it are taken again. Without this, ``metrics.jsonl`` would hold steps 1..7, 6, 7 and
    ``eval/history.jsonl`` the re-run evaluations twice. Called at start-up with the step
    the run resumes from (0 for a fresh start, which drops everything).
    """
    dropped: set[int] = set()
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        kept = []
        for line in metrics.read_text().splitlines():
            if not line.strip():
                continue
            record_step = int(json.loads(line)["step"])
            if record_step <= step:
                kept.append(line)
            else:
                dropped.add(record_step)
        _rewrite(metrics, kept)
    eval_dir = out_dir / "eval"
    history = eval_dir / "history.jsonl"
    if history.is_file():
        lines = [ln for ln in history.read_text().splitlines() if ln.strip()]
        _rewrite(history, [ln for ln in lines if int(json.loads(ln)["step"]) <= step])
    for path in eval_dir.glob("*_step*.json") if eval_dir.is_dir() else []:
        number = path.stem.rsplit("_step", 1)[-1]
        if number.isdigit() and int(number) > step:
            path.unlink()
    return len(dropped)


def _rewrite(path: Path, lines: list[str]) -> None:
    """Replace ``path`` atomically with ``lines`` (a crash leaves the old or the new file)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    tmp.replace(path)
