"""Group-relative advantages and dynamic sampling.

Every prompt is sampled ``group_size`` times; a completion's advantage is its reward
relative to its siblings, so no value network is needed (GRPO). Dr. GRPO drops the
division by the group's standard deviation, which otherwise up-weights groups that
are nearly all right or all wrong. A group whose rewards are all equal carries no
learning signal (every advantage is 0) and only dilutes the loss normaliser, so DAPO's
*dynamic sampling* drops such groups before the loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

STD_EPS = 1e-6  # keeps a near-constant group from blowing up its advantages


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


def is_degenerate(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when every reward in the group is the same (zero learning signal).

    >>> is_degenerate([1.0, 1.0]), is_degenerate([0.0, 0.5])
    (True, False)
    """
    return max(rewards) - min(rewards) <= tol


def compute_advantages(
    groups: Sequence[Sequence[float]], *, algorithm: str, dynamic_sampling: bool
) -> list[GroupAdvantages]:
    """Advantages for every group of a batch; algorithm is ``grpo``, ``dapo`` or ``dr_grpo``.

    >>> out = compute_advantages([[1, 1], [1, 0]], algorithm="dr_grpo", dynamic_sampling=True)
    >>> [(g.kept, g.advantages) for g in out]
    [(False, [0.0, 0.0]), (True, [0.5, -0.5])]
    """
    if algorithm not in {"grpo", "dapo", "dr_grpo"}:
        raise ValueError(f"unknown algorithm {algorithm!r}; use grpo, dapo or dr_grpo")
    out = []
    for rewards in groups:
        advantages = group_advantages(rewards, scale_by_std=algorithm != "dr_grpo")
        kept = not (dynamic_sampling and is_degenerate(rewards))
        out.append(GroupAdvantages(advantages=advantages, kept=kept))
    return out
