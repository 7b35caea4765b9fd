"""Pure formatting for ``posttrain get/describe/watch``: objects (plain dicts as the
apiserver returns them) in, strings and rich tables out.

Kept free of API calls so every row and every describe section is unit-testable and
``get`` and ``watch`` cannot disagree about how a number is shown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich.table import Table

MISSING = "-"
MAX_DOMAINS_SHOWN = 4  # a run may have hundreds of domains; a table cell shows the first few


def parse_time(value: str | None) -> datetime | None:
    """An RFC 3339 timestamp from the apiserver (``2026-01-02T03:04:05Z``).

    >>> parse_time("2026-01-02T03:04:05Z").hour
    3
    """
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_age(value: str | None, now: datetime | None = None) -> str:
    """kubectl-style age: 45s, 7m, 5h, 3d.

    >>> format_age("2026-01-01T00:00:00Z", datetime(2026, 1, 1, 0, 7, 30, tzinfo=UTC))
    '7m'
    >>> format_age("2026-01-01T00:00:00Z", datetime(2026, 1, 4, 1, 0, 0, tzinfo=UTC))
    '3d'
    """
    started = parse_time(value)
    if started is None:
        return MISSING
    seconds = max(0, int(((now or datetime.now(UTC)) - started).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 120 * 60:
        return f"{seconds // 60}m"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def format_number(value: float | int | None, digits: int = 3) -> str:
    """A status number, or ``-`` when the field is not set yet.

    >>> format_number(0.41666), format_number(None), format_number(3)
    ('0.417', '-', '3')
    """
    if value is None:
        return MISSING
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{float(value):.{digits}f}"


def format_float(value: float | int | None, digits: int = 3) -> str:
    """A measured value (reward, accuracy) always with ``digits`` decimals; JSON turns 1.0
    into 1 on the way through the apiserver, and a reward of 1 should still read 1.000.

    >>> format_float(1), format_float(None)
    ('1.000', '-')
    """
    return MISSING if value is None else f"{float(value):.{digits}f}"


def format_duration_ms(value: float | int | None) -> str:
    """A sandbox program's run time: milliseconds below a second (most unit-test programs
    run in tens of them, which as ``0.02s`` read as nothing), seconds above.

    >>> format_duration_ms(23.4), format_duration_ms(0.4), format_duration_ms(1534), format_duration_ms(None)
    ('23ms', '0.4ms', '1.53s', '-')
    """
    if value is None:
        return MISSING
    ms = float(value)
    if ms >= 1000:
        return f"{ms / 1000:.2f}s"
    return f"{ms:.0f}ms" if ms >= 1 else f"{ms:.1f}ms"


def format_domains(values: Mapping[str, float] | None, limit: int = MAX_DOMAINS_SHOWN) -> str:
    """``name=value`` per domain (sorted), the first ``limit`` of them.

    >>> format_domains({"code": 0.25, "arith": 0.5})
    'arith=0.50 code=0.25'
    >>> format_domains({f"d{i}": 1.0 for i in range(6)}, limit=2)
    'd0=1.00 d1=1.00 (+4 more)'
    """
    if not values:
        return MISSING
    names = sorted(values)
    shown = " ".join(f"{name}={float(values[name]):.2f}" for name in names[:limit])
    hidden = len(names) - limit
    return f"{shown} (+{hidden} more)" if hidden > 0 else shown


def format_step(status: Mapping[str, Any]) -> str:
    """``step/max`` progress.

    >>> format_step({"step": 3, "maxSteps": 20}), format_step({})
    ('3/20', '-')
    """
    step, max_steps = status.get("step"), status.get("maxSteps")
    if step is None and max_steps is None:
        return MISSING
    return f"{format_number(step)}/{format_number(max_steps)}"


def short_uri(uri: str | None, keep: int = 48) -> str:
    """A checkpoint URI shortened from the left (the step is at the end).

    >>> short_uri("s3://bucket/runs/default/demo/checkpoints/step-000010", keep=24)
    '…/checkpoints/step-000010'
    """
    if not uri:
        return MISSING
    return uri if len(uri) <= keep else "…" + uri[-keep:]


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata", {})


def _status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("status") or {}


RUN_HEADERS = ("NAME", "PHASE", "STEP", "REWARD", "DOMAIN REWARDS", "EVAL ACC", "CHECKPOINT", "AGE")
POOL_HEADERS = ("NAME", "PHASE", "READY", "MODEL", "ENGINE", "WEIGHTS", "ENDPOINT", "AGE")
TASK_HEADERS = ("NAME", "PHASE", "REWARD", "DURATION", "EXIT", "REASON", "ATTEMPTS", "AGE")
WARM_POOL_HEADERS = ("NAME", "READY", "CLAIMED", "IMAGE", "NETWORK", "AGE")


def run_row(obj: Mapping[str, Any], now: datetime | None = None) -> list[str]:
    """One TrainingRun as a ``get`` row (headers: :data:`RUN_HEADERS`)."""
    status = _status(obj)
    return [
        _meta(obj).get("name", MISSING),
        status.get("phase") or MISSING,
        format_step(status),
        format_float(status.get("rewardMean")),
        format_domains(status.get("domainRewards")),
        format_domains(status.get("evalAccuracy")),
        short_uri(status.get("lastCheckpoint"), keep=32),
        format_age(_meta(obj).get("creationTimestamp"), now),
    ]


def pool_row(obj: Mapping[str, Any], now: datetime | None = None) -> list[str]:
    """One RolloutPool as a ``get`` row (headers: :data:`POOL_HEADERS`)."""
    spec, status = obj.get("spec", {}), _status(obj)
    desired = spec.get("replicas", 1)
    version = status.get("weightVersion")
    return [
        _meta(obj).get("name", MISSING),
        status.get("phase") or MISSING,
        f"{status.get('readyReplicas', 0)}/{desired}",
        spec.get("model", MISSING),
        spec.get("engine", "vllm"),
        MISSING if version is None else f"v{version}",
        status.get("endpoint") or MISSING,
        format_age(_meta(obj).get("creationTimestamp"), now),
    ]


def task_row(obj: Mapping[str, Any], now: datetime | None = None) -> list[str]:
    """One SandboxTask as a ``get`` row (headers: :data:`TASK_HEADERS`)."""
    status = _status(obj)
    return [
        _meta(obj).get("name", MISSING),
        status.get("phase") or MISSING,
        format_float(status.get("reward")),
        format_duration_ms(status.get("durationMs")),
        format_number(status.get("exitCode")),
        task_reason(status),
        str(status.get("attempts", 0)),
        format_age(_meta(obj).get("creationTimestamp"), now),
    ]


def task_reason(status: Mapping[str, Any]) -> str:
    """Why a task ended: what its sandbox reported, else the reason of its true Failed or
    Succeeded condition (a task the operator refused, InvalidSpec, never ran a sandbox).

    >>> task_reason({"reason": "Timeout"})
    'Timeout'
    >>> task_reason({"conditions": [{"type": "Failed", "status": "True", "reason": "InvalidSpec"}]})
    'InvalidSpec'
    >>> task_reason({"phase": "Running"})
    '-'
    """
    if status.get("reason"):
        return str(status["reason"])
    for cond in status.get("conditions") or []:
        if cond.get("type") in ("Failed", "Succeeded") and cond.get("status") == "True":
            return str(cond.get("reason") or MISSING)
    return MISSING


def warm_pool_row(obj: Mapping[str, Any], now: datetime | None = None) -> list[str]:
    """One SandboxWarmPool as a ``get`` row (headers: :data:`WARM_POOL_HEADERS`).

    >>> warm_pool_row({"metadata": {"name": "py"}, "spec": {"replicas": 3},
    ...                "status": {"readyReplicas": 2, "claimed": 5}})[:5]
    ['py', '2/3', '5', 'operator-default', 'none']
    """
    spec, status = obj.get("spec", {}), _status(obj)
    return [
        _meta(obj).get("name", MISSING),
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        str(status.get("claimed", 0)),
        spec.get("image") or "operator-default",  # the operator's sandbox image
        spec.get("network", "none"),
        format_age(_meta(obj).get("creationTimestamp"), now),
    ]


PHASE_STYLES = {
    "Succeeded": "green",
    "Ready": "green",
    "Running": "cyan",
    "Pending": "yellow",
    "Updating": "yellow",
    "Suspended": "magenta",
    "Degraded": "red",
    "Failed": "bold red",
}


def build_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], namespaces: Sequence[str] | None = None
) -> Table:
    """A borderless rich table like ``kubectl get``; NAMESPACE first when listing -A."""
    table = Table(box=None, pad_edge=False, header_style="bold", show_edge=False)
    if namespaces is not None:
        table.add_column("NAMESPACE", no_wrap=True)
    for header in headers:
        table.add_column(header, no_wrap=header not in ("DOMAIN REWARDS", "EVAL ACC"))
    phase = headers.index("PHASE") if "PHASE" in headers else None
    for index, row in enumerate(rows):
        cells = list(row)
        if phase is not None and cells[phase] in PHASE_STYLES:
            cells[phase] = f"[{PHASE_STYLES[cells[phase]]}]{cells[phase]}[/]"
        table.add_row(*([namespaces[index]] if namespaces is not None else []), *cells)
    return table


def aligned(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Rows as left-aligned text columns (what describe prints for conditions/events).

    >>> aligned([["TYPE", "STATUS"], ["Ready", "True"]])
    ['  TYPE   STATUS', '  Ready  True']
    """
    if not rows:
        return []
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return [
        indent + "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def describe_run_spec(spec: Mapping[str, Any]) -> list[str]:
    """The spec summary: model, algorithm, rollout/sandbox, domains with weights."""
    algorithm = spec.get("algorithm", {})
    resources = spec.get("resources", {})
    rollout = spec.get("rollout", {})
    lines = [
        f"Model:        {spec.get('model', MISSING)}",
        "Algorithm:    "
        f"{algorithm.get('name', 'grpo')} (groupSize={algorithm.get('groupSize', 8)}, "
        f"promptsPerStep={algorithm.get('promptsPerStep', 8)}, "
        f"maxSteps={algorithm.get('maxSteps', 20)}, lr={algorithm.get('learningRate', 1e-6)}, "
        f"klCoef={algorithm.get('klCoef', 0.0)})",
        "Rollout:      "
        + (
            f"pool {rollout['pool']}"
            if rollout.get("pool")
            else ", ".join(rollout.get("endpoints", []))
            or "none set (a local run starts a CPU server)"
        ),
        f"Sandbox:      {spec.get('sandbox', {}).get('mode', 'local')}",
        f"Trainer:      {resources.get('nodes', 1)} node(s) x "
        f"{resources.get('gpusPerNode', 0)} GPU, cpu={resources.get('cpu', '2')}, "
        f"memory={resources.get('memory', '8Gi')}",
        f"Suspend:      {spec.get('suspend', False)}",
    ]
    domains = spec.get("domains", [])
    lines.append(f"Domains ({len(domains)}):")
    rows = [["NAME", "WEIGHT", "VERIFIER", "DATASET"]]
    for domain in domains:
        rows.append(
            [
                domain.get("name", MISSING),
                f"{float(domain.get('weight', 1.0)):g}",
                domain.get("verifier", {}).get("kind", MISSING),
                domain.get("dataset", MISSING),
            ]
        )
    return lines + aligned(rows)


def describe_run_status(status: Mapping[str, Any]) -> list[str]:
    """The status figures the trainer and operator report."""
    lines = [
        f"Phase:        {status.get('phase') or 'unknown (the operator has not seen it yet)'}",
        f"Step:         {format_step(status)}",
        f"Reward mean:  {format_float(status.get('rewardMean'))}",
        f"Checkpoint:   {status.get('lastCheckpoint') or MISSING}",
        f"Started from: {status.get('resumedFrom') or MISSING}",
        f"Weights:      {format_number(status.get('weightVersion'))}",
        f"Restarts:     {status.get('restarts', 0)}",
        f"Outputs:      {status.get('reportsUri') or MISSING}",
    ]
    wait = status.get("rolloutWait")
    if wait:  # what a RolloutPool's spec.autoscaling acts on
        lines.append(
            f"Rollout wait: {float(wait.get('fraction', 0)):.0%} of step time "
            f"(last {wait.get('steps', '?')} step(s))"
        )
    sandbox = status.get("sandbox")
    if sandbox:
        state = "available" if sandbox.get("available", True) else "UNAVAILABLE"
        lines.append(
            f"Sandbox:      {sandbox.get('mode')} {sandbox.get('endpoint', '')}: {state}, "
            f"{sandbox.get('infraFailures', 0)} failure(s) retried"
        )
    if status.get("message"):
        lines.append(f"Message:      {status['message']}")
    domains = sorted(set(status.get("domainRewards", {})) | set(status.get("evalAccuracy", {})))
    if domains:
        rows = [["DOMAIN", "REWARD", "EVAL ACC"]]
        for name in domains:
            rows.append(
                [
                    name,
                    format_float(status.get("domainRewards", {}).get(name)),
                    format_float(status.get("evalAccuracy", {}).get(name)),
                ]
            )
        lines += ["Per domain:", *aligned(rows)]
    return lines


def describe_conditions(
    conditions: Sequence[Mapping[str, Any]], now: datetime | None = None
) -> list[str]:
    """Conditions with reason, age and message (the why of the current phase)."""
    if not conditions:
        return ["  <none> (the operator has not reconciled this object yet)"]
    rows = [["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]]
    for cond in conditions:
        rows.append(
            [
                cond.get("type", MISSING),
                cond.get("status", MISSING),
                cond.get("reason", MISSING),
                format_age(cond.get("lastTransitionTime"), now),
                cond.get("message", ""),
            ]
        )
    return aligned(rows)


def event_time(event: Mapping[str, Any]) -> str | None:
    """The most recent timestamp an Event carries (core/v1 and events/v1 fill different ones)."""
    return (
        event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("series") or {}).get("lastObservedTime")
        or event.get("firstTimestamp")
        or _meta(event).get("creationTimestamp")
    )


def describe_events(
    events: Sequence[Mapping[str, Any]], now: datetime | None = None, limit: int = 15
) -> list[str]:
    """The newest ``limit`` Events, oldest first (reading order), like kubectl describe."""
    if not events:
        return ["  <none>"]
    ordered = sorted(events, key=lambda e: event_time(e) or "")[-limit:]
    rows = [["TYPE", "REASON", "AGE", "FROM", "MESSAGE"]]
    for event in ordered:
        source = (
            (event.get("source") or {}).get("component")
            or event.get("reportingComponent")
            or MISSING
        )
        count = event.get("count") or 1
        age = format_age(event_time(event), now) + (f" (x{count})" if count > 1 else "")
        rows.append(
            [
                event.get("type", "Normal"),
                event.get("reason", MISSING),
                age,
                source,
                str(event.get("message", "")).strip(),
            ]
        )
    return aligned(rows)


def describe_children(children: Sequence[tuple[str, str, str, str]], selector: str) -> list[str]:
    """(kind, name, phase, age) rows of the pods and jobs found by the label ``selector``.

    >>> describe_children([], "posttrain.io/task=add")
    ['  <none> (no pod or job has the label posttrain.io/task=add yet)']
    """
    if not children:
        return [f"  <none> (no pod or job has the label {selector} yet)"]
    return aligned([["KIND", "NAME", "PHASE", "AGE"], *[list(c) for c in children]])


WATCH_FIXED_HEADERS = ("STEP", "PHASE", "REWARD")


def watch_row(status: Mapping[str, Any], domains: Sequence[str]) -> list[str]:
    """One line of ``posttrain watch``: step, phase, mean and per-domain reward, eval, checkpoint.

    >>> watch_row({"step": 2, "maxSteps": 4, "phase": "Running", "rewardMean": 0.5,
    ...            "domainRewards": {"arith": 0.75}}, ["arith"])
    ['2/4', 'Running', '0.500', '0.750', '-', '-']
    """
    rewards = status.get("domainRewards") or {}
    return [
        format_step(status),
        status.get("phase") or MISSING,
        format_float(status.get("rewardMean")),
        *[format_float(rewards.get(d)) for d in domains],
        format_domains(status.get("evalAccuracy")),
        short_uri(status.get("lastCheckpoint"), keep=32),
    ]


def watch_headers(domains: Sequence[str]) -> list[str]:
    """Column names matching :func:`watch_row`.

    >>> watch_headers(["arith"])
    ['STEP', 'PHASE', 'REWARD', 'r:arith', 'EVAL ACC', 'CHECKPOINT']
    """
    return [*WATCH_FIXED_HEADERS, *[f"r:{d}" for d in domains], "EVAL ACC", "CHECKPOINT"]
