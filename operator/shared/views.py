"""What every plan reads and returns: observed pods reduced to :class:`PodView`, the
:class:`EventSpec` a plan asks to post, and :func:`status_diff` (send only what changed).

Plans are pure ``(resource, observed children, now) -> plan`` functions, level-triggered:
they look at the whole observed state, never at "what just happened", so replaying one after
an operator restart yields the same actions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from posttrain.api.base import Condition

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Terminated:
    """A container's terminated state (what the kubelet reports)."""

    exit_code: int
    reason: str = ""
    message: str = ""
    started_at: datetime | None = None
    finished_at: datetime | None = None


@dataclass(frozen=True)
class PodView:
    """The parts of a Pod the decisions depend on."""

    name: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    phase: str = "Pending"
    reason: str = ""
    message: str = ""
    deleting: bool = False
    ready: bool = False
    terminated: Terminated | None = None
    start_time: datetime | None = None
    # Long-running servers (pool replicas) restart in place: what the kubelet says about it.
    restarts: int = 0
    ip: str = ""  # status.podIP
    waiting_reason: str = ""  # main container waiting, e.g. CrashLoopBackOff
    last_message: str = ""  # main container's last termination message
    init_failure: str = ""  # a failed init container's termination message (or reason)
    finalizers: tuple[str, ...] = ()  # metadata.finalizers

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL


def _time(value: Any) -> datetime | None:
    if not value:
        return None
    if isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def pod_view(pod: dict[str, Any]) -> PodView:
    """Reduce a Pod manifest (as the apiserver returns it) to a PodView.

    >>> pod_view({"metadata": {"name": "p"}, "status": {"phase": "Running"}}).phase
    'Running'
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    terminated = None
    for cs in status.get("containerStatuses") or []:
        state = (cs.get("state") or {}).get("terminated")
        # The main (first) container decides; init containers are ignored.
        if state is not None:
            terminated = Terminated(
                exit_code=int(state.get("exitCode", 0)),
                reason=state.get("reason") or "",
                message=state.get("message") or "",
                started_at=_time(state.get("startedAt")),
                finished_at=_time(state.get("finishedAt")),
            )
            break
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    main = (status.get("containerStatuses") or [{}])[0]
    last = ((main.get("lastState") or {}).get("terminated")) or {}
    return PodView(
        name=meta.get("name", ""),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        phase=status.get("phase") or "Pending",
        reason=status.get("reason") or "",
        message=status.get("message") or "",
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(meta.get("finalizers") or ()),
        ready=ready,
        terminated=terminated,
        start_time=_time(status.get("startTime")),
        restarts=int(main.get("restartCount") or 0),
        ip=status.get("podIP") or "",
        waiting_reason=((main.get("state") or {}).get("waiting") or {}).get("reason") or "",
        last_message=(last.get("message") or "").strip(),
        init_failure=_init_failure(status.get("initContainerStatuses") or []),
    )


def _init_failure(statuses: list[dict[str, Any]]) -> str:
    """The termination message (else reason) of an init container that exited non-zero.

    >>> _init_failure([{"name": "fetch-model", "lastState": {"terminated": {
    ...     "exitCode": 1, "message": "cannot fetch model s3://b/m: no such key"}}}])
    'fetch-model: cannot fetch model s3://b/m: no such key'
    """
    for cs in statuses:
        for state in (cs.get("state") or {}, cs.get("lastState") or {}):
            done = state.get("terminated")
            if done and int(done.get("exitCode") or 0) != 0:
                why = (done.get("message") or "").strip() or done.get("reason") or "failed"
                return f"{cs.get('name', 'init')}: {why}"
    return ""


@dataclass(frozen=True)
class EventSpec:
    """A Kubernetes Event to post on the parent: type Normal/Warning, reason, message."""

    type: str
    reason: str
    message: str


def conditions_wire(conditions: list[Condition]) -> list[dict[str, Any]]:
    return [c.to_wire() for c in conditions]


def iso_time(value: datetime | None) -> str | None:
    return value.isoformat().replace("+00:00", "Z") if value else None


def status_diff(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """Keys of ``desired`` whose value differs from ``current`` (a minimal merge patch).

    >>> status_diff({"phase": "Pending", "step": 3}, {"phase": "Running"})
    {'phase': 'Running'}
    """
    return {k: v for k, v in desired.items() if current.get(k) != v}
