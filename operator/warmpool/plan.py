"""The SandboxWarmPool decision: keep ``spec.replicas`` idle pods of the current template and
mirror the counts into status. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.api import SandboxWarmPool
from posttrain.api.base import ConditionStatus, set_condition
from posttrain.api.labels import ANNOTATION_SPEC_HASH, LABEL_TASK
from posttrain.api.reasons import ConditionType, Reason

from ..shared.views import EventSpec, PodView, status_diff
from .builders import idle_selector, is_idle


@dataclass
class WarmPoolPlan:
    """What to do for one SandboxWarmPool."""

    create: int = 0
    delete_pods: list[str] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)


def plan_warm_pool(
    pool: SandboxWarmPool,
    pods: list[PodView],
    want_hash: str,
    reserved: frozenset[str] = frozenset(),
) -> WarmPoolPlan:
    """Keep ``spec.replicas`` idle pods of the current template; mirror counts into status.

    Idle pods that finished (crashed before a claim) or carry an old template hash are
    replaced; on scale-down the pods least likely to be claimed soon go first (not ready,
    then newest). ``reserved`` are idle pods a claim is patching right now: never deleted.

    >>> from posttrain.api import SandboxWarmPool
    >>> pool = SandboxWarmPool.model_validate({"metadata": {"name": "p"}, "spec": {"replicas": 2}})
    >>> plan_warm_pool(pool, [], "h").create
    2
    """
    plan = WarmPoolPlan()
    name = pool.metadata.name
    want = pool.spec.replicas
    live = [p for p in pods if not p.deleting]
    claimed = sum(1 for p in live if LABEL_TASK in p.labels)
    broken = [p for p in live if LABEL_TASK not in p.labels and p.finished]
    stale = [
        p
        for p in live
        if is_idle(p)
        and p.annotations.get(ANNOTATION_SPEC_HASH) != want_hash
        and p.name not in reserved
    ]
    idle = [p for p in live if is_idle(p) and p not in stale]
    plan.delete_pods = [p.name for p in broken + stale]
    if len(idle) > want:
        # Not-ready first, then by name descending (generated suffixes are random, so this is
        # just a deterministic order); reserved pods are about to be claimed.
        candidates = sorted(
            (p for p in idle if p.name not in reserved), key=lambda p: (p.ready, p.name)
        )
        extra = candidates[: len(idle) - want]
        plan.delete_pods += [p.name for p in extra]
        idle = [p for p in idle if p not in extra]
    plan.create = max(0, want - len(idle))
    ready = sum(1 for p in idle if p.phase == "Running" and p.ready)
    if plan.create:
        plan.events.append(
            EventSpec(
                "Normal",
                Reason.WARM_PODS_CREATED,
                f"creating {plan.create} idle pod(s) ({len(idle)}/{want})",
            )
        )
    if plan.delete_pods:
        plan.events.append(_deleted_event(len(plan.delete_pods), len(broken), len(stale)))
    gen = pool.metadata.generation
    status = pool.status
    cond: ConditionStatus
    if ready >= want:
        cond, reason, message = "True", Reason.WARM_POOL_READY, f"{ready}/{want} idle pod(s) ready"
    else:
        cond, reason = "False", Reason.WARM_POOL_FILLING
        message = f"{ready}/{want} idle pod(s) ready; the rest are starting"
    conditions = set_condition(
        list(status.conditions), ConditionType.READY, cond, reason, message, gen
    )
    desired = {
        "observedGeneration": gen,
        "replicas": len(idle) + plan.create,
        "readyReplicas": ready,
        "claimed": claimed,
        "selector": idle_selector(name),
        "conditions": [c.to_wire() for c in conditions],
    }
    plan.status_patch = status_diff(status.to_wire(), desired)
    return plan


def _deleted_event(removed: int, broken: int, stale: int) -> EventSpec:
    """Why ``removed`` pods go: ended unclaimed, an old template, or above spec.replicas.

    >>> _deleted_event(3, 1, 0).message
    'deleting 3 pod(s): 1 ended unclaimed, 2 above spec.replicas'
    """
    why = []
    if broken:
        why.append(f"{broken} ended unclaimed")
    if stale:
        why.append(f"{stale} from an old template")
    if removed - broken - stale:
        why.append(f"{removed - broken - stale} above spec.replicas")
    return EventSpec(
        "Normal", Reason.WARM_PODS_DELETED, f"deleting {removed} pod(s): {', '.join(why)}"
    )
