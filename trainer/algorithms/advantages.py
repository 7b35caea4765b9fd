"""Group-relative advantages and dynamic sampling.

Every prompt is sampled ``group_size`` times; a completion's advantage is its reward
relative to its siblings, so no value network is needed. The estimators differ in how
they turn a group's rewards into advantages:

* ``grpo``, ``dapo``, ``gspo``: reward minus the group mean, divided by the group's std
  (GRPO, arXiv:2402.03300; GSPO changes the loss's ratio, not the advantage);
* ``dr_grpo``: without the division by the std, which otherwise up-weights groups that are
  nearly all right or all wrong (arXiv:2503.20783);
* ``rloo``: reward minus the mean of the *other* completions of the group (leave-one-out,
  arXiv:2402.14740), an unbiased baseline because it does not depend on the sample;
* ``reinforce_pp``: reward minus the group mean, then normalised over the whole batch
  (mean and std over every kept completion's tokens) instead of per group, so one
  group's tiny std cannot inflate its advantages (REINFORCE++, arXiv:2501.03262; verl's
  ``reinforce_plus_plus_baseline``).

A group whose rewards are all equal carries no learning signal (every group-relative
advantage is 0) and only dilutes the loss normaliser, so DAPO's *dynamic sampling* drops
such groups before the loss (and before the batch statistics of ``reinforce_pp``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STD_EPS = 1e-6  # keeps a near-constant group from blowing up its advantages
WHITEN_EPS = 1e-8  # verl's masked_whiten: (a - mean) / sqrt(var + eps)
ALGORITHMS = ("grpo", "dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp")


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one prompt's group, or why the group was dropped."""

    advantages: list[float]
    kept: bool


def group_advantages(rewards: Sequence[float], *, scale_by_std: bool) -> list[float]:
    """Reward minus the group mean, divided by the group std when ``scale_by_std``.

    The std is the population std (ddof=0), as in DAPO's and TRL's implementations.

    >>> group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=False)
    [0.5, -0.5, -0.5, 0.5]
    >>> [round(a, 4) for a in group_advantages([1.0, 0.0, 0.0, 1.0], scale_by_std=True)]
    [1.0, -1.0, -1.0, 1.0]
    """
    n = len(rewards)
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_by_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + STD_EPS) for c in centred]


def leave_one_out_advantages(rewards: Sequence[float]) -> list[float]:
    """RLOO: ``r_i - mean_{j != i} r_j`` (= ``n / (n - 1) * (r_i - mean)``); 0 for a lone sample.

    >>> leave_one_out_advantages([1.0, 0.0, 0.0, 0.0])
    [1.0, -0.3333333333333333, -0.3333333333333333, -0.3333333333333333]
    """
    n = len(rewards)
    if n < 2:  # no sibling to compare with: no signal (TRL zeroes it too)
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def batch_whiten(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """``(v - mean) / sqrt(var + eps)`` with weighted mean and unbiased weighted variance.

    With ``weights`` = token counts this is verl's ``masked_whiten`` of a sequence-constant
    advantage over the batch's tokens (a completion of 3 tokens counts 3 times).

    >>> [round(a, 4) for a in batch_whiten([1.0, -1.0], [1, 1])]
    [0.7071, -0.7071]
    """
    total = float(sum(weights))
    if total <= 1:
        return [0.0] * len(values)
    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights, strict=True)) / total
    var *= total / (total - 1)  # Bessel's correction over tokens, as torch.var and verl
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [(v - mean) * scale for v in values]


def is_degenerate(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward in the group is the same (zero learning signal).

    >>> is_degenerate([1.0, 1.0]), is_degenerate([0.0, 0.5])
    (True, False)
    """
    return max(rewards) - min(rewards) <= tol


def compute_advantages(
    groups: Sequence[Sequence[float]],
    *,
    algorithm: str,
    dynamic_sampling: bool,
    lengths: Sequence[Sequence[int]] | None = None,
) -> list[GroupAdvantages]:
    """Advantages for every group of a batch, ``algorithm`` one of :data:`ALGORITHMS`.

    ``lengths[i][j]`` (the completion's loss tokens) weighs ``reinforce_pp``'s batch
    statistics; without it every completion weighs the same. A dropped group keeps zero
    advantages and takes no part in the batch statistics.

    >>> out = compute_advantages([[1, 1], [1, 0]], algorithm="dr_grpo", dynamic_sampling=True)
    >>> [(g.kept, g.advantages) for g in out]
    [(False, [0.0, 0.0]), (True, [0.5, -0.5])]
    >>> out = compute_advantages([[1, 0], [1, 0, 0]], algorithm="reinforce_pp",
    ...                          dynamic_sampling=True)
    >>> [[round(a, 3) for a in g.advantages] for g in out]
    [[0.926, -0.926], [1.234, -0.617, -0.617]]
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    out = []
    for rewards in groups:
        if algorithm == "rloo":
            advantages = leave_one_out_advantages(rewards)
        else:
            scale = algorithm in ("grpo", "dapo", "gspo")
            advantages = group_advantages(rewards, scale_by_std=scale)
        kept = not (dynamic_sampling and is_degenerate(rewards))
        out.append(
            GroupAdvantages(advantages=advantages if kept else [0.0] * len(rewards), kept=kept)
        )
    if algorithm == "reinforce_pp":
        out = _whiten_kept(out, lengths)
    return out


def _whiten_kept(
    groups: list[GroupAdvantages], lengths: Sequence[Sequence[int]] | None
) -> list[GroupAdvantages]:
    """REINFORCE++'s global normalisation over the kept groups' completions."""
    values = [a for g in groups if g.kept for a in g.advantages]
    if lengths is None:
        weights: list[float] = [1.0] * len(values)
    else:
        weights = [float(n) for g, ns in zip(groups, lengths, strict=True) if g.kept for n in ns]
    whitened = iter(batch_whiten(values, weights))
    return [
        GroupAdvantages([next(whitened) for _ in g.advantages], True) if g.kept else g
        for g in groups
    ]
