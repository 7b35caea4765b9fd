"""How far held-out accuracy moved between two evaluations, and how much of that is noise.

Both evaluations score the *same* held-out items, so the change is a paired difference: each
item contributes d = +1 (fixed), -1 (broken) or 0, and the change is the mean of d. Its
standard error comes from the spread of d, not from two independent binomials: on 96 items a
stage that fixes 9 and breaks 6 moved accuracy by +3.1 % with a standard error of 4.0 %,
which is noise, whereas fixing 9 and breaking none (+9.4 % ± 3.0 %) is not. Reports and
``bench/stage_gains.py`` print the change with this error so a reader can tell a gain from a
lucky draw; seeds then add the run-to-run spread on top.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from posttrain.trainer.evaluation.heldout import EvalItem, EvalResult


@dataclass(frozen=True)
class PairedChange:
    """Items scored both times (``n``), and how many flipped each way."""

    n: int
    fixed: int
    broken: int

    @property
    def change(self) -> float:
        """Accuracy after minus before, over the shared items."""
        return (self.fixed - self.broken) / self.n if self.n else 0.0

    @property
    def stderr(self) -> float:
        """Standard error of the mean per-item change (sample variance of d over ``n``).

        >>> round(PairedChange(96, 9, 6).stderr, 4), round(PairedChange(96, 9, 0).stderr, 4)
        (0.0404, 0.0299)
        >>> PairedChange(1, 1, 0).stderr  # one item: no spread to estimate
        0.0
        """
        if self.n < 2:
            return 0.0
        variance = (self.fixed + self.broken - self.n * self.change**2) / (self.n - 1)
        return math.sqrt(max(variance, 0.0) / self.n)

    def text(self) -> str:
        """``+3.1% ± 3.9%`` -- the form the report's tables and the bench print.

        >>> PairedChange(32, 5, 1).text()
        '+12.5% ± 7.4%'
        """
        return f"{self.change:+.1%} ± {self.stderr:.1%}"


def paired_change(
    before: EvalResult, after: EvalResult, group: str | None = None
) -> PairedChange | None:
    """The paired change over the items both evaluations scored (only those of ``group``, a
    :func:`stratum_of` name, when given); None when they share none (results written without
    their items, or two different held-out sets).

    >>> from posttrain.trainer.evaluation.heldout import EvalItem
    >>> item = lambda tid, ok: EvalItem(tid, "a", "p", "e", "c", ok, float(ok))
    >>> res = lambda step, *oks: EvalResult(step, "heldout", {}, {}, 0.0,
    ...                                     [item(str(i), ok) for i, ok in enumerate(oks)])
    >>> paired_change(res(0, False, False, True, True), res(4, True, True, True, False))
    PairedChange(n=4, fixed=2, broken=1)
    """
    earlier = {(i.domain, i.task_id): i.passed for i in before.items}
    shared = [
        (earlier[key], i.passed)
        for i in after.items
        if (key := (i.domain, i.task_id)) in earlier and group in (None, stratum_of(i))
    ]
    if not shared:
        return None
    fixed = sum(1 for was, now in shared if now and not was)
    broken = sum(1 for was, now in shared if was and not now)
    return PairedChange(len(shared), fixed, broken)


def stratum_changes(before: EvalResult, after: EvalResult) -> dict[str, PairedChange]:
    """:func:`paired_change` per :func:`strata` name of ``after`` (empty when no domain has
    several strata): where a change happened, which the overall figure can hide."""
    changes = {group: paired_change(before, after, group) for group in strata(after)}
    return {group: change for group, change in changes.items() if change is not None}


def change_text(before: EvalResult, after: EvalResult) -> str:
    """The paired change with its error (:meth:`PairedChange.text`), or the plain difference
    of the overall accuracies when the two share no item."""
    paired = paired_change(before, after)
    return f"{after.overall - before.overall:+.1%}" if paired is None else paired.text()


def stratum_of(item: EvalItem) -> str:
    """``domain/difficulty``, the unit a curriculum promotes through."""
    return f"{item.domain}/{item.difficulty or 'default'}"


def strata(result: EvalResult) -> list[str]:
    """The :func:`stratum_of` names of ``result``'s items, in order of first appearance; empty
    when no domain has more than one (then a per-stratum table would repeat the domain's).

    >>> item = lambda tid, level: EvalItem(tid, "a", "p", "e", "c", True, 1.0, level)
    >>> strata(EvalResult(0, "heldout", {}, {}, 0.0, [item("1", "easy"), item("2", "hard")]))
    ['a/easy', 'a/hard']
    >>> strata(EvalResult(0, "heldout", {}, {}, 0.0, [item("1", "")]))
    []
    """
    names = list(dict.fromkeys(stratum_of(i) for i in result.items))
    domains = [name.split("/", 1)[0] for name in names]
    return names if len(domains) > len(set(domains)) else []
