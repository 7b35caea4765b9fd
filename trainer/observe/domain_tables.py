"""Tables and plots that stay readable with hundreds of domains.

One column, line or table row per domain is fine for two domains and unreadable for
300. Above :data:`MANY_DOMAINS` the step table, the reward plot and the report's
accuracy table show the overall value plus the ``k`` worst and ``k`` best domains, and
the evaluation matrix (domain x eval step) becomes a heatmap. Every number stays in
``metrics.jsonl`` and ``eval/*.json``; this only decides what a person is shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

MANY_DOMAINS = 8  # above this many domains, show overall + worst-k + best-k
SHOW_K = 5  # worst and best domains shown in reports and plots
TABLE_K = 2  # worst and best domains shown in the per-step terminal table (one per line)


def worst_and_best(values: Mapping[str, float], k: int) -> tuple[list[str], list[str]]:
    """The ``k`` lowest and ``k`` highest domains (ties by name); disjoint when possible.

    >>> worst_and_best({"a": 0.1, "b": 0.9, "c": 0.5, "d": 0.0}, 1)
    (['d'], ['b'])
    >>> worst_and_best({"a": 0.1, "b": 0.9}, 5)
    (['a'], ['b'])
    """
    ordered = sorted(values, key=lambda d: (values[d], d))
    k = min(k, len(ordered) // 2) if len(ordered) > 1 else len(ordered)
    worst = ordered[:k]
    best = [d for d in reversed(ordered) if d not in worst][:k]
    return worst, best


def table_summary(values: Mapping[str, float], k: int = TABLE_K) -> tuple[str, str]:
    r"""``name=value`` cells (one domain per line) for the worst and best domains of a step.

    >>> table_summary({"a": 0.25, "b": 1.0, "c": 0.5, "d": 0.0}, 2)
    ('d=0.00\na=0.25', 'b=1.00\nc=0.50')
    """
    worst, best = worst_and_best(values, k)
    return (
        "\n".join(f"{d}={values[d]:.2f}" for d in worst),
        "\n".join(f"{d}={values[d]:.2f}" for d in best),
    )


def readable_rows(
    rows: Sequence[tuple[str, float, float, int]], k: int = SHOW_K
) -> tuple[list[tuple[str, float, float, int]], str | None]:
    """(domain, base, trained, items) rows to print, and a note when some were left out.

    Up to :data:`MANY_DOMAINS` domains every row is shown; beyond, the ``k`` worst and
    ``k`` best by trained accuracy, worst first.

    >>> rows = [(f"d{i}", 0.0, i / 10, 4) for i in range(10)]
    >>> shown, note = readable_rows(rows, 2)
    >>> [r[0] for r in shown], note
    (['d0', 'd1', 'd9', 'd8'], 'the 2 worst and 2 best of 10 domains by trained accuracy')
    """
    if len(rows) <= MANY_DOMAINS:
        return list(rows), None
    by_name = {r[0]: r for r in rows}
    worst, best = worst_and_best({r[0]: r[2] for r in rows}, k)
    note = f"the {len(worst)} worst and {len(best)} best of {len(rows)} domains by trained accuracy"
    return [by_name[d] for d in worst + best], note


def _recent_mean(metrics: Sequence[Mapping[str, Any]], domain: str, last: int = 5) -> float:
    values = [m["domain_rewards"][domain] for m in metrics if domain in m["domain_rewards"]]
    tail = values[-last:]
    return sum(tail) / len(tail) if tail else 0.0


def plot_reward_summary(
    plt: Any,
    metrics: Sequence[Mapping[str, Any]],
    evals: Sequence[Any],
    path: Path,
    k: int = SHOW_K,
) -> Path:
    """Overall train reward and held-out accuracy, plus the worst-k and best-k domains.

    Domains are ranked by their mean reward over the last five steps that sampled them,
    so the lines shown are the ones a person would act on.
    """
    domains = sorted({d for m in metrics for d in m["domain_rewards"]})
    worst, best = worst_and_best({d: _recent_mean(metrics, d) for d in domains}, k)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [m["step"] for m in metrics],
        [m["reward_mean"] for m in metrics],
        color="black",
        linewidth=2.5,
        label="train reward: all domains",
    )
    if evals:
        ax.plot(
            [r.step for r in evals],
            [r.overall for r in evals],
            color="black",
            linestyle="--",
            marker="s",
            label="held-out acc: all domains",
        )
    for names, cmap, label in (
        (worst, plt.get_cmap("Reds"), "worst"),
        (best, plt.get_cmap("Greens"), "best"),
    ):
        for i, domain in enumerate(names):
            xs = [m["step"] for m in metrics if domain in m["domain_rewards"]]
            ys = [m["domain_rewards"][domain] for m in metrics if domain in m["domain_rewards"]]
            ax.plot(
                xs,
                ys,
                color=cmap(0.45 + 0.5 * i / max(1, len(names))),
                linewidth=1,
                label=f"{label}: {domain}",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Reward: all {len(domains)} domains, {len(worst)} worst and {len(best)} best")
    ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_eval_heatmap(plt: Any, evals: Sequence[Any], path: Path) -> Path | None:
    """The evaluation matrix: one row per domain (worst final accuracy on top), one column
    per evaluation; None when there is no evaluation to draw."""
    if not evals:
        return None
    last = evals[-1].accuracy
    domains = sorted({d for r in evals for d in r.accuracy}, key=lambda d: (last.get(d, -1.0), d))
    matrix = [[r.accuracy.get(d, float("nan")) for r in evals] for d in domains]  # (D, E)
    height = min(14.0, 2.5 + 0.04 * len(domains))  # inches: 300 domains fit one screen
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.0, 2.0 + 0.4 * len(evals))), height))
    image = ax.imshow(
        matrix, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest"
    )
    ax.set_xticks(range(len(evals)), [str(r.step) for r in evals])
    every = max(1, -(-len(domains) // 50))  # at most 50 labels stay legible
    ax.set_yticks(range(0, len(domains), every), domains[::every], fontsize=6)
    ax.set_xlabel("eval step")
    ax.set_ylabel(f"domain ({len(domains)}, worst final accuracy on top)")
    ax.set_title("Held-out accuracy per domain and evaluation")
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
