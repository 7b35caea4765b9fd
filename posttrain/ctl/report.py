"""``posttrain report RUN_DIR``: one self-contained HTML or Markdown file per local run.

The trainer already draws reward/accuracy/KL/length/loss plots from its own files
(:mod:`posttrain.trainer.observe.run_report`); this module reuses those functions and adds what a
reader of a shared report also needs: rollout throughput, the sandbox latency
histogram (when the run recorded latencies) and the base-vs-trained table, with every
PNG embedded as base64 so the single file can be mailed or attached to a ticket.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.errors import UsageError
from posttrain.telemetry import get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer("posttrain.ctl")
RUN_SPEC_FILES = ("run.yaml", "run.yml", "manifest.yaml")  # where a run dir may keep its spec


@dataclass
class Figure:
    """One embedded plot."""

    title: str
    png: bytes


@dataclass
class Example:
    """One held-out item whose verdict changed between the base and the trained model."""

    verdict: str  # "fixed" (fail -> pass) or "broken" (pass -> fail)
    domain: str
    prompt: str
    base_completion: str
    trained_completion: str


@dataclass
class ReportData:
    """Everything the report shows, gathered before any rendering."""

    title: str
    facts: list[tuple[str, str]]
    accuracy_rows: list[tuple[str, float, float, int]]  # domain, base, trained, items
    figures: list[Figure]
    notes: list[str]
    overall: tuple[float, float, int] | None = None  # the "all" row: base, trained, items
    steps: tuple[int, int] | None = None  # (base step, trained step) of the comparison
    flips: tuple[int, int] = (0, 0)  # how many items were fixed, broken
    examples: list[Example] = field(default_factory=list)
    # Environment domains: (domain, base metrics, trained metrics) of the held-out episodes
    # (success rate, mean turns, valid-tool-call rate, recovery rate, errored; see
    # posttrain.envs.episode.agent_metrics).
    agent: list[tuple[str, dict[str, float], dict[str, float]]] = field(default_factory=list)


AGENT_COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("success_rate", "success", True),
    ("mean_turns", "mean turns", False),
    ("valid_tool_call_rate", "valid tool calls", True),
    ("recovery_rate", "recovery after failure", True),
    ("truncated_rate", "truncated", True),
)


def agent_cell(
    key: str, percent: bool, before: Mapping[str, float], after: Mapping[str, float]
) -> str:
    """``base -> trained`` of one episode metric.

    >>> agent_cell("success_rate", True, {"success_rate": 0.0}, {"success_rate": 0.25})
    '0.0% -> 25.0%'
    """

    def shown(v: float) -> str:
        return f"{v:.1%}" if percent else f"{v:.2f}"

    return (f"{shown(before[key])} -> " if key in before else "") + shown(after.get(key, 0.0))


def tokens_per_second(
    metrics: Sequence[Mapping[str, Any]], group_size: int | None
) -> list[tuple[int, float]]:
    """(step, sampled tokens per rollout second): the recorded ``tokens_per_s`` when a
    line has it, else mean response length x completions / rollout seconds.

    >>> tokens_per_second([{"step": 1, "response_length": 40.0, "total_groups": 2,
    ...                     "rollout_seconds": 4.0}], group_size=8)
    [(1, 160.0)]
    >>> tokens_per_second([{"step": 1, "tokens_per_s": 99.0}], group_size=None)
    [(1, 99.0)]
    """
    points: list[tuple[int, float]] = []
    for line in metrics:
        if line.get("tokens_per_s") is not None:
            points.append((int(line["step"]), float(line["tokens_per_s"])))
        elif group_size and line.get("rollout_seconds"):
            completions = int(line.get("total_groups", 0)) * group_size
            tokens = float(line.get("response_length", 0.0)) * completions
            points.append((int(line["step"]), tokens / float(line["rollout_seconds"])))
    return points


def sandbox_latencies_ms(metrics: Sequence[Mapping[str, Any]]) -> list[float]:
    """Every sandbox execution latency the run recorded (``sandbox_latency_ms`` lists).

    >>> sandbox_latencies_ms([{"sandbox_latency_ms": [12.0, 30.5]}, {"step": 2}])
    [12.0, 30.5]
    """
    return [float(v) for line in metrics for v in line.get("sandbox_latency_ms") or []]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:  # matplotlib ships with the train extra, not the base install
        raise UsageError(
            "posttrain report draws plots with matplotlib, which is not installed; "
            "install it with: pip install 'posttrain[train]'"
        ) from None

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=100)
    _pyplot().close(fig)
    return buffer.getvalue()


def plot_throughput(points: Sequence[tuple[int, float]]) -> bytes:
    """Rollout throughput over steps, as PNG bytes."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([s for s, _ in points], [v for _, v in points], marker="o")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel("tokens / s")
    ax.set_title("Rollout throughput (sampled tokens per rollout second)")
    return _png(fig)


def plot_latency_histogram(latencies_ms: Sequence[float]) -> bytes:
    """Histogram of sandbox execution latencies, as PNG bytes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(latencies_ms, bins=min(30, max(5, len(latencies_ms) // 4)))
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("executions")
    ax.set_title(f"Sandbox latency ({len(latencies_ms)} executions)")
    return _png(fig)


def data_uri(png: bytes) -> str:
    """A base64 ``data:`` URI that browsers and most Markdown viewers show inline.

    >>> data_uri(b"\\x89PNG")
    'data:image/png;base64,iVBORw=='
    """
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def run_spec(run_dir: Path, manifest: Path | None) -> Any | None:
    """The run's TrainingRun spec from --manifest or a spec file kept in the run dir."""
    from posttrain.api import TrainingRun, load_manifest

    candidates = [manifest] if manifest else [run_dir / n for n in RUN_SPEC_FILES]
    for path in candidates:
        if path is not None and path.is_file():
            return load_manifest(path, TrainingRun).spec
    return None


def gather(run_dir: Path, manifest: Path | None = None, source: str | None = None) -> ReportData:
    """Read the run directory and draw every figure (the trainer's plots plus ours).

    ``source`` is where the files came from when ``run_dir`` is only a download of them (an
    s3:// URI): the report names it rather than a temporary directory deleted afterwards.
    """
    from posttrain.trainer.observe.domain_tables import readable_rows
    from posttrain.trainer.observe.run_report import (
        comparison_rows,
        flipped_items,
        latest_eval_per_step,
        plot_run,
        trained_comparison,
    )
    from posttrain.trainer.observe.step_metrics import load_metrics

    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: no such directory; pass the --out DIR of a local run")
    metrics = load_metrics(run_dir)
    if not metrics:
        raise UsageError(
            f"{run_dir}: no metrics.jsonl (or it is empty); pass the --out DIR of "
            "`posttrain run --local` after at least one step"
        )
    _pyplot()  # fail with the install hint before any work
    notes: list[str] = []
    figures: list[Figure] = []
    with tracer.start_as_current_span("ctl.report.plots") as span:
        span.set_attribute("posttrain.steps", len(metrics))
        spec = run_spec(run_dir, manifest)
        kl_coef = float(spec.algorithm.kl_coef) if spec is not None else None
        written = plot_run(run_dir, kl_coef=kl_coef)  # the trainer's own plots, redrawn
        figures += [Figure(_figure_title(p), p.read_bytes()) for p in written]
        group_size = int(spec.algorithm.group_size) if spec is not None else None
        throughput = tokens_per_second(metrics, group_size)
        if throughput:
            figures.append(Figure("Rollout throughput", plot_throughput(throughput)))
        else:
            notes.append(
                "Rollout throughput: not recorded (no tokens_per_s in metrics.jsonl); pass "
                "--manifest RUN.yaml so it can be derived from groupSize and rollout time."
            )
        latencies = sandbox_latencies_ms(metrics)
        if latencies:
            figures.append(Figure("Sandbox latency", plot_latency_histogram(latencies)))
        else:
            notes.append("Sandbox latency: this run recorded no sandbox_latency_ms.")
    evals = latest_eval_per_step(run_dir, "heldout")
    pair = trained_comparison(evals)
    rows, left_out = readable_rows(comparison_rows(*pair) if pair else [])
    if left_out and pair is not None:
        notes.append(
            f"Held-out accuracy table: {left_out}; the eval matrix heatmap and "
            f"eval/heldout_step{pair[1].step:04d}.json hold every domain."
        )
    if not evals:
        notes.append("Held-out accuracy: no eval/heldout_step*.json in the run directory.")
    elif pair is None:
        notes.append(
            f"Held-out accuracy was measured at step {evals[0].step} only "
            f"({evals[0].overall:.1%}): the run stopped before its next evaluation, so there "
            "is no trained result to compare yet."
        )
    overall, steps, flips, examples = None, None, (0, 0), []
    agent: list[tuple[str, dict[str, float], dict[str, float]]] = []
    if pair is not None:
        base, trained = pair
        agent = [
            (d, dict(base.agent.get(d, {})), dict(m)) for d, m in sorted(trained.agent.items())
        ]
        overall = (base.overall, trained.overall, sum(trained.counts.values()))
        steps = (base.step, trained.step)
        fixed, broken = flipped_items(base, trained)
        flips = (len(fixed), len(broken))
        for verdict, pairs in (("fixed", fixed), ("broken", broken)):
            examples += [
                Example(verdict, after.domain, after.prompt, before.completion, after.completion)
                for before, after in pairs[:EXAMPLES_PER_VERDICT]
            ]
    last = metrics[-1]
    # SFT/DPO stage lines carry no reward: the last RL line's (if the run has an RL stage)
    last_rl = next((m for m in reversed(metrics) if "reward_mean" in m), None)
    facts = [
        ("outputs from", source) if source else ("run directory", str(run_dir)),
        ("steps", str(last["step"])),
        (
            "final reward mean",
            f"{float(last_rl['reward_mean']):.3f}" if last_rl is not None else "- (no RL step)",
        ),
        ("domains", _domain_names((last_rl or {}).get("domain_rewards", {}))),
    ]
    if pair is not None:
        facts.append(
            (
                "held-out accuracy",
                f"{pair[0].overall:.1%} (step {pair[0].step}) -> "
                f"{pair[1].overall:.1%} (step {pair[1].step})",
            )
        )
    elif evals:
        facts.append(("held-out accuracy", f"{evals[0].overall:.1%} (step {evals[0].step} only)"))
    return ReportData(
        f"posttrain report: {run_dir.name}",
        facts,
        rows,
        figures,
        notes,
        overall,
        steps,
        flips,
        examples,
        agent,
    )


EXAMPLES_PER_VERDICT = 3  # fixed and broken items shown verbatim (all are in eval/*.json)
EXAMPLE_CHARS = 400  # of each completion


def _domain_names(rewards: Mapping[str, Any]) -> str:
    """The domains' names, or their count and the first few when there are many.

    >>> _domain_names({"b": 1.0, "a": 0.0}), _domain_names({f"d{i:02d}": 0 for i in range(40)})
    ('a, b', '40 domains (d00, d01, d02, ...)')
    """
    from posttrain.trainer.observe.domain_tables import MANY_DOMAINS

    names = sorted(rewards)
    if len(names) > MANY_DOMAINS:
        return f"{len(names)} domains ({', '.join(names[:3])}, ...)"
    return ", ".join(names) or "-"


TRAINER_PLOT_TITLES = {  # file names written by posttrain.trainer.observe.run_report.plot_run
    "reward_accuracy": "Reward and held-out accuracy per domain",
    "kl": "KL to the reference model",
    "response_length": "Response length",
    "loss": "Policy loss",
    "eval_matrix": "Held-out accuracy per domain and evaluation (heatmap)",
}


def _figure_title(path: Path) -> str:
    """A heading for one of the trainer's PNGs; unknown ones get their file name.

    >>> _figure_title(Path("plots/kl.png")), _figure_title(Path("plots/grad_norm.png"))
    ('KL to the reference model', 'Grad norm')
    """
    return TRAINER_PLOT_TITLES.get(path.stem, path.stem.replace("_", " ").capitalize())


def _comparison_heading(data: ReportData) -> str:
    if data.steps is None:
        return "Held-out accuracy: base vs trained"
    return f"Held-out accuracy: base (step {data.steps[0]}) vs trained (step {data.steps[1]})"


def render_markdown(data: ReportData) -> str:
    """The report as Markdown with inline base64 images."""
    from posttrain.trainer.observe.run_report import code_fence

    lines = [f"# {data.title}", ""]
    lines += [f"- **{key}:** {value}" for key, value in data.facts]
    if data.accuracy_rows:
        lines += ["", f"## {_comparison_heading(data)}", ""]
        lines += [
            "| domain | base | trained | change | items |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for domain, base, trained, items in data.accuracy_rows:
            lines.append(
                f"| {domain} | {base:.1%} | {trained:.1%} | {trained - base:+.1%} | {items} |"
            )
        if data.overall is not None:
            base, trained, items = data.overall
            lines.append(
                f"| **all** | {base:.1%} | {trained:.1%} | {trained - base:+.1%} | {items} |"
            )
        lines += ["", f"{data.flips[0]} held-out items fixed, {data.flips[1]} broken.", ""]
        for example in data.examples:
            lines += [
                f"**{example.verdict.capitalize()}** ({example.domain}): {example.prompt}",
                "",
            ]
            for name, text in (
                ("Base", example.base_completion),
                ("Trained", example.trained_completion),
            ):
                shown = text.strip()[:EXAMPLE_CHARS]
                fence = code_fence(shown)
                lines += [f"{name}:", "", f"{fence}text", shown, fence, ""]
    if data.agent:
        lines += ["", "## Agent episodes (held-out): base -> trained", ""]
        lines += [
            "| domain | " + " | ".join(title for _, title, _ in AGENT_COLUMNS) + " | errored |",
            "| --- |" + " ---: |" * (len(AGENT_COLUMNS) + 1),
        ]
        for domain, before, after in data.agent:
            cells = [agent_cell(k, pct, before, after) for k, _, pct in AGENT_COLUMNS]
            errored = int(after.get("errored", 0))
            lines.append(f"| {domain} | " + " | ".join(cells) + f" | {errored} |")
    lines += ["", "## Plots", ""]
    for figure in data.figures:
        lines += [f"### {figure.title}", "", f"![{figure.title}]({data_uri(figure.png)})", ""]
    if data.notes:
        lines += ["## Notes", "", *[f"- {note}" for note in data.notes], ""]
    return "\n".join(lines)


def render_html(data: ReportData) -> str:
    """The report as one HTML page with every image embedded."""
    esc = html.escape
    parts = [
        "<!doctype html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{esc(data.title)}</title>",
        "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
        "td.n{text-align:right}img{max-width:100%}td{vertical-align:top}"
        "pre{white-space:pre-wrap;margin:0;font-size:90%}div.ex{margin:1em 0}</style>",
        "</head><body>",
        f"<h1>{esc(data.title)}</h1>",
        "<ul>",
        *[f"<li><b>{esc(k)}:</b> {esc(v)}</li>" for k, v in data.facts],
        "</ul>",
    ]
    if data.accuracy_rows:
        parts += [
            f"<h2>{esc(_comparison_heading(data))}</h2>",
            "<table><tr><th>domain</th><th>base</th><th>trained</th><th>change</th>"
            "<th>items</th></tr>",
        ]
        rows = [(esc(d), b, t, n) for d, b, t, n in data.accuracy_rows]
        if data.overall is not None:
            rows.append(("<b>all</b>", *data.overall))
        for domain, base, trained, items in rows:
            parts.append(
                f'<tr><td>{domain}</td><td class="n">{base:.1%}</td>'
                f'<td class="n">{trained:.1%}</td><td class="n">{trained - base:+.1%}</td>'
                f'<td class="n">{items}</td></tr>'
            )
        parts.append("</table>")
        parts.append(f"<p>{data.flips[0]} held-out items fixed, {data.flips[1]} broken.</p>")
        for example in data.examples:
            parts += [
                f'<div class="ex"><p><b>{example.verdict.capitalize()}</b> '
                f"({esc(example.domain)}): {esc(example.prompt)}</p>",
                "<table><tr><th>base</th><th>trained</th></tr><tr>",
                f"<td><pre>{esc(example.base_completion.strip()[:EXAMPLE_CHARS])}</pre></td>",
                f"<td><pre>{esc(example.trained_completion.strip()[:EXAMPLE_CHARS])}</pre></td>",
                "</tr></table></div>",
            ]
    if data.agent:
        parts += [
            "<h2>Agent episodes (held-out): base -&gt; trained</h2>",
            "<table><tr><th>domain</th>"
            + "".join(f"<th>{esc(title)}</th>" for _, title, _ in AGENT_COLUMNS)
            + "<th>errored</th></tr>",
        ]
        for domain, before, after in data.agent:
            cells = "".join(
                f'<td class="n">{esc(agent_cell(k, pct, before, after))}</td>'
                for k, _, pct in AGENT_COLUMNS
            )
            parts.append(
                f"<tr><td>{esc(domain)}</td>{cells}"
                f'<td class="n">{int(after.get("errored", 0))}</td></tr>'
            )
        parts.append("</table>")
    parts.append("<h2>Plots</h2>")
    for figure in data.figures:
        parts += [
            f"<h3>{esc(figure.title)}</h3>",
            f'<img alt="{esc(figure.title)}" src="{data_uri(figure.png)}">',
        ]
    if data.notes:
        parts += ["<h2>Notes</h2>", "<ul>", *[f"<li>{esc(n)}</li>" for n in data.notes], "</ul>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(
    run_dir: Path, out: Path | None, manifest: Path | None = None, source: str | None = None
) -> Path:
    """Build the report for ``run_dir``; the suffix of ``out`` (.html/.md) picks the format.
    ``source``: see :func:`gather`."""
    out = out or run_dir / "report.html"
    if out.suffix not in (".html", ".htm", ".md"):
        raise UsageError(f"--out {out}: use a .html or .md file name (the suffix picks the format)")
    data = gather(run_dir, manifest, source)
    text = render_markdown(data) if out.suffix == ".md" else render_html(data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    log.info("wrote %s (%d plots, %d KiB)", out, len(data.figures), len(text) // 1024)
    return out


def fetch_reports(uri: str, local_dir: Path) -> Path:
    """Download a cluster run's uploaded outputs (``s3://.../reports`` or the run prefix
    above it) into ``local_dir``; the directory to build the report from."""
    from posttrain.storage.reports import REPORTS_DIR, download_reports
    from posttrain.storage.store import open_store

    prefix_uri = uri.rstrip("/")
    if prefix_uri.endswith(f"/{REPORTS_DIR}"):
        prefix_uri = prefix_uri[: -len(REPORTS_DIR) - 1]
    store = open_store(prefix_uri, create_bucket=False)
    count = download_reports(store, local_dir)
    if count == 0:
        raise UsageError(
            f"{uri}: no outputs under {store.uri(REPORTS_DIR)}/; pass a run's status.reportsUri "
            "(posttrain describe tr NAME shows it) or its s3:// prefix"
        )
    log.info("downloaded %d output file(s) from %s", count, store.uri(REPORTS_DIR))
    return local_dir


def report_command(args: argparse.Namespace) -> int:
    source = str(args.run_dir)
    if source.startswith("s3://"):
        import tempfile

        name = [p for p in source.rstrip("/").split("/") if p and p != "reports"][-1]
        with tempfile.TemporaryDirectory(prefix="posttrain-report-") as tmp:
            run_dir = fetch_reports(source, Path(tmp) / name)
            out = args.out or Path(f"{name}-report.html")
            path = write_report(run_dir, out, args.manifest, source=source)
    else:
        path = write_report(Path(source), args.out, args.manifest)
    print(f"wrote {path}")
    return 0
