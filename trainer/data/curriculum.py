"""Which prompts go into the next batch: weighted domains, difficulty strata, replay.

Why a curriculum: with group-relative advantages a prompt the policy always fails (or
always solves) gives zero gradient, so sampling where the pass rate is informative is
what makes small RL budgets work. Each domain starts on its easiest stratum and is
promoted when the rolling pass rate over the last ``window`` samples reaches
``promote_at``. A slice of each batch (``replay_fraction``) replays tasks that were
solved before, to keep earlier skills from decaying. Everything, including the RNG, is
in :meth:`Curriculum.state_dict` so a resumed run samples exactly what it would have.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any

from posttrain.trainer.data.datasets import Task, group_by_stratum

REPLAY_CAPACITY = 256  # solved tasks remembered per domain for replay


@dataclass
class DomainPool:
    """One domain's training tasks by stratum, with its sampling weight."""

    name: str
    strata: dict[str, list[Task]]  # ordered easiest first
    weight: float = 1.0

    @classmethod
    def from_tasks(
        cls, name: str, tasks: list[Task], weight: float = 1.0, strata: list[str] | None = None
    ) -> DomainPool:
        grouped = group_by_stratum(tasks)
        if strata:  # the spec's order wins; strata it does not list are ignored
            missing = [s for s in strata if s not in grouped]
            if missing:
                raise ValueError(
                    f"domain {name!r}: strata {missing} have no tasks; "
                    f"the dataset has {list(grouped)}"
                )
            grouped = {s: grouped[s] for s in strata}
        return cls(name=name, strata=grouped, weight=weight)


def allocate_slots(
    n: int, weights: dict[str, float], min_fraction: float, rng: random.Random
) -> list[str]:
    """Assign ``n`` batch slots to domains: a guaranteed quota, the rest drawn by weight.

    Each domain first gets ``floor(min_fraction * n)`` slots; the remaining slots are
    sampled with probability proportional to weight. Output order is shuffled.

    With many domains the quotas can exceed the batch (300 domains, quota 1, 64 slots).
    Then this batch's quota slots go to domains drawn by weight without replacement
    (Efraimidis-Spirakis keys ``u ** (1 / w)``), so over the steps each domain receives
    quota slots in proportion to its weight; taking them in name order instead would give
    every quota slot of every batch to the alphabetically first domains.

    >>> sorted(allocate_slots(4, {"a": 1.0, "b": 0.0}, 0.25, random.Random(0)))
    ['a', 'a', 'a', 'b']
    >>> len(set(allocate_slots(3, {f"d{i}": 1.0 for i in range(9)}, 0.34, random.Random(0))))
    3
    """
    names = sorted(weights)
    quota = int(min_fraction * n)
    total = sum(weights[x] for x in names)
    if total <= 0:
        raise ValueError(f"domain weights must not all be zero: {weights}")
    if quota * len(names) <= n:
        slots = [name for name in names for _ in range(quota)]
    else:
        drawn = [x for x in names if weights[x] > 0]  # weight 0 never wins a draw
        keys = {x: rng.random() ** (1.0 / weights[x]) for x in drawn}
        winners = sorted(drawn, key=lambda x: keys[x], reverse=True)
        slots = [name for name in winners for _ in range(quota)][:n]
    if len(slots) < n:
        slots += rng.choices(names, weights=[weights[x] for x in names], k=n - len(slots))
    rng.shuffle(slots)
    return slots


class Curriculum:
    """Stateful prompt sampler; call :meth:`next_prompts` then :meth:`observe` each step."""

    def __init__(
        self,
        pools: list[DomainPool],
        *,
        enabled: bool = True,
        promote_at: float = 0.7,
        window: int = 32,
        replay_fraction: float = 0.1,
        min_domain_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not pools:
            raise ValueError("a curriculum needs at least one domain")
        self.pools = {p.name: p for p in pools}
        self.enabled = enabled
        self.promote_at = promote_at
        self.window = window
        self.replay_fraction = replay_fraction
        self.min_domain_fraction = min_domain_fraction
        self.rng = random.Random(seed)
        self.level = {name: 0 for name in self.pools}  # index into the domain's strata
        # 1.0 pass / 0.0 fail
        self.recent: dict[str, deque[float]] = {name: deque(maxlen=window) for name in self.pools}
        self.replay: dict[str, list[dict[str, Any]]] = {name: [] for name in self.pools}
        self.promotions: list[dict[str, Any]] = []

    def current_stratum(self, domain: str) -> str:
        strata = list(self.pools[domain].strata)
        return strata[min(self.level[domain], len(strata) - 1)]

    def next_prompts(self, n: int) -> list[Task]:
        """Choose ``n`` tasks for the next batch (each will be sampled ``group_size`` times)."""
        domains = allocate_slots(
            n, {k: p.weight for k, p in self.pools.items()}, self.min_domain_fraction, self.rng
        )
        return [self._draw(domain) for domain in domains]

    def _draw(self, domain: str) -> Task:
        replay = self.replay[domain]
        if replay and self.rng.random() < self.replay_fraction:
            return Task.from_dict(self.rng.choice(replay))
        pool = self.pools[domain]
        if self.enabled:
            tasks = pool.strata[self.current_stratum(domain)]
        else:  # uniform over every stratum
            tasks = [t for stratum in pool.strata.values() for t in stratum]
        return self.rng.choice(tasks)

    def observe(self, task: Task, pass_rate: float, step: int) -> str | None:
        """Record one prompt's group pass rate; returns the new stratum on a promotion.

        Replayed tasks below the current stratum are not counted, so easy replays do not
        push the domain up early.
        """
        domain = task.domain
        if pass_rate > 0 and len(self.replay[domain]) < REPLAY_CAPACITY:
            record = task.to_dict()
            if record not in self.replay[domain]:
                self.replay[domain].append(record)
        if not self.enabled or task.difficulty != self.current_stratum(domain):
            return None
        self.recent[domain].append(pass_rate)
        window = self.recent[domain]
        can_promote = self.level[domain] < len(self.pools[domain].strata) - 1
        if can_promote and len(window) == self.window and self.pass_rate(domain) >= self.promote_at:
            self.level[domain] += 1
            window.clear()
            new = self.current_stratum(domain)
            self.promotions.append({"step": step, "domain": domain, "stratum": new})
            return new
        return None

    def pass_rate(self, domain: str) -> float:
        """Rolling pass rate at the current stratum (0.0 before any observation)."""
        window = self.recent[domain]
        return sum(window) / len(window) if window else 0.0

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (RNG included) for checkpoints."""
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "level": dict(self.level),
            "recent": {k: list(v) for k, v in self.recent.items()},
            "replay": {k: list(v) for k, v in self.replay.items()},
            "promotions": list(self.promotions),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.level = {k: int(state["level"].get(k, 0)) for k in self.pools}
        self.recent = {k: deque(state["recent"].get(k, []), maxlen=self.window) for k in self.pools}
        self.replay = {k: list(state["replay"].get(k, [])) for k in self.pools}
        self.promotions = list(state["promotions"])
