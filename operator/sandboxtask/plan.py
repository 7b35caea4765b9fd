"""The SandboxTask decision: ``(task, observed attempt pods, now) -> SandboxPlan`` (which
attempt to create or delete, the result parsed from the pod, the status patch, Events). Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from posttrain.api import SandboxTask
from posttrain.api.base import Condition, set_condition
from posttrain.api.labels import ANNOTATION_LOGS_URI, ANNOTATION_SNAPSHOT_URI, LABEL_ATTEMPT
from posttrain.api.reasons import ConditionType, Reason, SandboxExitReason

from ..shared.views import TERMINAL, EventSpec, PodView, conditions_wire, iso_time, status_diff
from .builders import sandbox_pod_name


@dataclass(frozen=True)
class SandboxResult:
    """What one attempt produced."""

    exit_code: int | None
    reward: float | None
    duration_ms: float | None
    reason: str
    sandbox_failed: bool
    """True when the sandbox (not the program) failed: eviction, start error, lost pod."""
    logs_uri: str | None = None
    """Where the entrypoint stored the full log (only when it says the upload worked)."""
    snapshot_uri: str | None = None
    """Where the entrypoint stored the workdir tar (spec.snapshot)."""


# Container termination reasons that mean the program never really ran.
_INFRA_REASONS = {"ContainerCannotRun", "StartError", "CreateContainerError", "Evicted"}


def parse_sandbox_result(pod: PodView) -> SandboxResult:
    """Read the result protocol from a finished sandbox pod.

    The program's wrapper writes ``{"exit_code", "reward", "duration_ms", "reason"}`` to
    /dev/termination-log; with FallbackToLogsOnError a crash leaves log text there instead,
    so anything that is not that JSON falls back to the exit code (reward 1 on exit 0).

    >>> from posttrain.operator.shared.views import Terminated
    >>> t = Terminated(exit_code=0, message='{"exit_code": 0, "reward": 0.5, "duration_ms": 7}')
    >>> parse_sandbox_result(PodView("p", {}, phase="Succeeded", terminated=t)).reward
    0.5
    """
    if pod.reason == "DeadlineExceeded":
        return SandboxResult(
            exit_code=pod.terminated.exit_code if pod.terminated else None,
            reward=0.0,
            duration_ms=None,
            reason=SandboxExitReason.TIMEOUT,
            sandbox_failed=False,
        )
    term = pod.terminated
    if term is None or term.reason in _INFRA_REASONS:
        return SandboxResult(None, None, None, SandboxExitReason.SANDBOX_FAILED, True)
    duration_ms = None
    if term.started_at and term.finished_at:
        duration_ms = (term.finished_at - term.started_at).total_seconds() * 1000.0
    result: dict[str, Any] = {}
    try:
        parsed = json.loads(term.message) if term.message.strip().startswith("{") else {}
        result = parsed if isinstance(parsed, dict) else {}
    except ValueError:
        result = {}
    exit_code = int(result.get("exit_code", term.exit_code))
    if term.reason == "OOMKilled":
        reason = SandboxExitReason.OOM_KILLED
    else:
        reason = str(
            result.get("reason")
            or (SandboxExitReason.COMPLETED if exit_code == 0 else SandboxExitReason.ERROR)
        )
    reward = result.get("reward")
    if reward is None:
        reward = 1.0 if exit_code == 0 and reason == SandboxExitReason.COMPLETED else 0.0
    if result.get("duration_ms") is not None:
        duration_ms = float(result["duration_ms"])
    # The pod's annotations say where its entrypoint was told to store; its result says
    # whether that worked.
    logs_uri = pod.annotations.get(ANNOTATION_LOGS_URI) if result.get("logs_uploaded") else None
    snapshot_uri = (
        pod.annotations.get(ANNOTATION_SNAPSHOT_URI) if result.get("snapshot_uploaded") else None
    )
    return SandboxResult(
        exit_code,
        float(reward),
        duration_ms,
        reason,
        False,
        logs_uri=logs_uri,
        snapshot_uri=snapshot_uri,
    )


@dataclass
class SandboxPlan:
    """What to do for one SandboxTask."""

    create_attempt: int | None = None
    delete_pods: list[str] = field(default_factory=list)
    status_patch: dict[str, Any] = field(default_factory=dict)
    events: list[EventSpec] = field(default_factory=list)
    delete_task: bool = False


def plan_sandbox(task: SandboxTask, pods: list[PodView], now: datetime) -> SandboxPlan:
    """Decide the next step of a SandboxTask from its pods.

    Attempts: the pod of attempt n is ``<task>-<n>``; a sandbox failure (not a program
    failure) starts attempt n+1 while ``n < 1 + spec.retries``. Finished tasks are deleted
    ``ttlSecondsAfterFinished`` after completionTime.
    """
    status = task.status
    if status.phase in TERMINAL:
        return _plan_finished(task, pods, now)
    plan = SandboxPlan()
    gen = task.metadata.generation
    # Attempt 1 is implied: its pod is created without a status write, so a burst of tasks
    # costs one pod create each; attempts/podName are written with the first transition.
    attempts = max(status.attempts, 1)
    current_name = sandbox_pod_name(task.metadata.name, attempts)
    desired: dict[str, Any] = {
        "observedGeneration": gen,
        "attempts": attempts,
        "podName": current_name,
    }
    conditions = list(status.conditions)
    current = next((p for p in pods if p.name == current_name), None)
    if current is None:
        # A pod claimed from a SandboxWarmPool keeps its generated name; its attempt label
        # says which attempt it serves.
        current = next((p for p in pods if attempt_of(p) == attempts and not p.deleting), None)
        if current is not None:
            desired["podName"] = current_name = current.name
    if current is None:
        # New task, cache lag, or deleted by someone: create-or-adopt is idempotent.
        plan.create_attempt = attempts
        if status.attempts == 0:
            return plan  # nothing to record yet
    elif not current.finished:
        if current.phase == "Running" and status.phase != "Running":
            desired.update(
                phase="Running", startTime=iso_time(status.start_time or current.start_time or now)
            )
            conditions = set_condition(
                conditions,
                ConditionType.READY,
                "True",
                Reason.POD_RUNNING,
                "the program is running",
                gen,
            )
        elif status.attempts == 0:
            return plan  # created, not started: still nothing to record
    else:
        result = parse_sandbox_result(current)
        if result.sandbox_failed and attempts < 1 + task.spec.retries:
            _retry(task, current, attempts + 1, desired, plan)
        else:
            desired["startTime"] = iso_time(status.start_time or current.start_time or now)
            _finish_sandbox(task, result, attempts, now, desired, plan)
            conditions = _sandbox_final_conditions(conditions, desired, gen)
    desired["conditions"] = conditions_wire(conditions)
    plan.status_patch = status_diff(task.status.to_wire(), desired)
    return plan


def _plan_finished(task: SandboxTask, pods: list[PodView], now: datetime) -> SandboxPlan:
    """A finished task is deleted, with its pods, ``ttlSecondsAfterFinished`` after it ended."""
    plan = SandboxPlan()
    ttl = task.spec.ttl_seconds_after_finished
    done_at = task.status.completion_time
    if ttl is not None and done_at is not None and now >= done_at + timedelta(seconds=ttl):
        plan.delete_task = True
        plan.delete_pods = [p.name for p in pods if not p.deleting]
        plan.events.append(
            EventSpec("Normal", Reason.TTL_EXPIRED, f"deleted {ttl} s after it finished")
        )
    return plan


def _retry(
    task: SandboxTask, failed: PodView, attempt: int, desired: dict[str, Any], plan: SandboxPlan
) -> None:
    """The sandbox (not the program) failed and retries remain: start ``attempt``."""
    plan.create_attempt = attempt
    desired.update(
        attempts=attempt,
        podName=sandbox_pod_name(task.metadata.name, attempt),
        phase="Pending",
    )
    why = failed.reason or failed.message or "the pod failed before the program ran"
    plan.events.append(
        EventSpec(
            "Warning",
            Reason.SANDBOX_RETRY,
            f"attempt {attempt - 1} failed ({why}); retrying as {desired['podName']} "
            f"({attempt}/{1 + task.spec.retries})",
        )
    )


def _finish_sandbox(
    task: SandboxTask,
    result: SandboxResult,
    attempts: int,
    now: datetime,
    desired: dict[str, Any],
    plan: SandboxPlan,
) -> None:
    succeeded = (
        not result.sandbox_failed
        and result.exit_code == 0
        and (result.reason == SandboxExitReason.COMPLETED)
    )
    desired.update(
        phase="Succeeded" if succeeded else "Failed",
        exitCode=result.exit_code,
        reward=result.reward if result.reward is not None else 0.0,
        durationMs=result.duration_ms,
        reason=result.reason,
        completionTime=iso_time(now),
        logsUri=result.logs_uri,
        snapshotUri=result.snapshot_uri,
    )
    for key in [k for k, v in desired.items() if v is None]:
        del desired[key]  # e.g. no duration known: leave the field unset, not null
    if succeeded:
        plan.events.append(
            EventSpec("Normal", Reason.COMPLETED, f"exit 0, reward {desired['reward']}")
        )
    elif result.sandbox_failed:
        plan.events.append(
            EventSpec(
                "Warning",
                Reason.SANDBOX_FAILED,
                f"the sandbox failed on all {attempts} attempt(s) (spec.retries="
                f"{task.spec.retries}); check node capacity, the image and the RuntimeClass",
            )
        )
    else:
        plan.events.append(
            EventSpec(
                "Warning",
                Reason.PROGRAM_FAILED,
                f"the program ended with {result.reason} (exit {result.exit_code})",
            )
        )


def _sandbox_final_conditions(
    conditions: list[Condition], desired: dict[str, Any], gen: int | None
) -> list[Condition]:
    ok = desired["phase"] == "Succeeded"
    reason = desired.get("reason", "")
    if ok:
        conditions = set_condition(
            conditions,
            ConditionType.SUCCEEDED,
            "True",
            Reason.COMPLETED,
            "the program exited 0",
            gen,
        )
    else:
        why = (
            Reason.SANDBOX_FAILED
            if reason == SandboxExitReason.SANDBOX_FAILED
            else Reason.PROGRAM_FAILED
        )
        conditions = set_condition(
            conditions,
            ConditionType.FAILED,
            "True",
            why,
            f"ended with {reason} (exit {desired.get('exitCode')})",
            gen,
        )
    return set_condition(
        conditions,
        ConditionType.READY,
        "False",
        Reason.COMPLETED if ok else Reason.PROGRAM_FAILED,
        "finished",
        gen,
    )


def attempt_of(pod: PodView) -> int:
    """The attempt number a sandbox pod belongs to (0 when unlabelled)."""
    value = pod.labels.get(LABEL_ATTEMPT, "0")
    return int(value) if value.isdigit() else 0
