"""Progress reporting: a ``status.json`` locally, the TrainingRun ``/status`` in a cluster.

The operator reconciles TrainingRuns from ``.status``; the trainer is the only one who
knows the step, rewards and checkpoints, so it patches the status subresource itself
(merge patch: it only touches the fields it owns). ``phase``, ``message``, ``conditions``
and ``observedGeneration`` belong to the operator alone: it moves the run to Succeeded when
the trainer pod exits 0, with the Succeeded condition, completionTime and an event. (A
trainer that wrote ``phase: Succeeded`` itself made the operator treat the run as already
finished and skip all of that.) ``status.json`` of a local run, which has no operator, keeps
the phase. Reporting must never kill a run: API errors are logged and the next report
retries with fresh numbers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from posttrain.api.env import TrainerEnv
from posttrain.kubeapi import custom_objects_api

log = logging.getLogger(__name__)

# Shows in managedFields who owns step/rewardMean/...: the operator owns phase and conditions.
FIELD_MANAGER = "posttrain-trainer"
OPERATOR_OWNED = ("phase", "message")
"""RunStatus fields a trainer in a cluster never patches: the operator writes them."""


@dataclass
class RunStatus:
    """The trainer-owned part of ``TrainingRunStatus`` (snake_case here, camelCase on the wire)."""

    phase: str = "Running"  # Running | Succeeded: status.json only (see OPERATOR_OWNED)
    step: int = 0
    max_steps: int = 0
    reward_mean: float | None = None
    domain_rewards: dict[str, float] = field(default_factory=dict)
    eval_accuracy: dict[str, float] = field(default_factory=dict)
    last_checkpoint: str | None = None
    weight_version: int | None = None
    message: str | None = None
    stage: str | None = None  # the pipeline stage being trained
    stages: list[dict[str, Any]] = field(default_factory=list)  # StageStatus wire dicts
    sandbox: dict[str, Any] | None = None  # verification.SandboxHealth.to_wire()
    reports_uri: str | None = None  # where the outputs are uploaded as they are written
    resumed_from: str | None = None  # the checkpoint URI the trainer started from, or FRESH_START
    rollout_wait: dict[str, Any] | None = None  # rollout_wait.RolloutWaitWindow.to_wire()

    def to_wire(self) -> dict[str, Any]:
        """camelCase, Nones dropped (a merge patch with null would *delete* the field).

        >>> RunStatus(step=3, reward_mean=0.5).to_wire()["rewardMean"]
        0.5
        """
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if value is None:
                continue
            head, *rest = key.split("_")
            out[head + "".join(word.title() for word in rest)] = value
        return out


class StatusReporter(Protocol):
    """Where the trainer's progress goes."""

    def report(self, status: RunStatus) -> None: ...

    def event(self, type_: str, reason: str, message: str) -> None:
        """Record a Kubernetes-style Event (stage started/finished): only the trainer sees
        stage boundaries, so it posts these itself; the operator posts the pod-level ones."""
        ...


# Event reasons the trainer posts (CamelCase, as the operator's in api/reasons.py).
STAGE_STARTED = "StageStarted"
STAGE_SUCCEEDED = "StageSucceeded"


class LocalStatusReporter:
    """Writes ``status.json`` atomically (readers never see half a file)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / "status.json"

    def report(self, status: RunStatus) -> None:
        payload = {**status.to_wire(), "updatedAt": datetime.now(UTC).isoformat()}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(self.path)

    def event(self, type_: str, reason: str, message: str) -> None:
        """Append to ``events.jsonl`` beside ``status.json`` (and log it)."""
        log.info("event %s %s: %s", type_, reason, message)
        record = {
            "type": type_,
            "reason": reason,
            "message": message,
            "time": datetime.now(UTC).isoformat(),
        }
        with (self.path.parent / "events.jsonl").open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class KubeStatusReporter:
    """Merge-patches ``trainingruns/<name>/status`` through the Kubernetes API."""

    def __init__(self, name: str, namespace: str, api: Any | None = None) -> None:
        self.name = name
        self.namespace = namespace
        if api is None:
            api = custom_objects_api()
        self.api = api

    def report(self, status: RunStatus) -> None:
        self.patch({k: v for k, v in status.to_wire().items() if k not in OPERATOR_OWNED})

    def patch(self, wire: dict[str, Any]) -> None:
        """Merge-patch these trainer-owned status fields (camelCase) and nothing else."""
        from posttrain.api.base import GROUP, VERSION

        try:
            self.api.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                self.namespace,
                "trainingruns",
                self.name,
                {"status": wire},
                field_manager=FIELD_MANAGER,
            )
        except Exception as exc:  # a flaky apiserver must not stop training
            log.warning("could not patch status of %s/%s: %s", self.namespace, self.name, exc)

    def event(self, type_: str, reason: str, message: str) -> None:
        """Create a core/v1 Event on the TrainingRun (``kubectl describe tr`` lists it)."""
        from kubernetes import client

        from posttrain.api.base import API_VERSION, GROUP, VERSION

        now = datetime.now(UTC)
        try:
            run = self.api.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, "trainingruns", self.name
            )
            body = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{self.name}.", "namespace": self.namespace},
                "involvedObject": {
                    "apiVersion": API_VERSION,
                    "kind": "TrainingRun",
                    "name": self.name,
                    "namespace": self.namespace,
                    "uid": run["metadata"]["uid"],
                },
                "type": type_,
                "reason": reason,
                "message": message,
                "source": {"component": FIELD_MANAGER},
                "firstTimestamp": now.isoformat(),
                "lastTimestamp": now.isoformat(),
                "count": 1,
            }
            event = client.CoreV1Event.model_validate(body)  # what the client would do itself
            client.CoreV1Api(self.api.api_client).create_namespaced_event(self.namespace, event)
        except Exception as exc:  # an Event is a courtesy: never a reason to stop training
            log.warning(
                "could not post event %s on %s/%s: %s", reason, self.namespace, self.name, exc
            )


class FanOutStatusReporter:
    """Reports to several sinks (status.json is always kept, even in a pod)."""

    def __init__(self, reporters: list[StatusReporter]) -> None:
        self.reporters = reporters

    def report(self, status: RunStatus) -> None:
        for reporter in self.reporters:
            reporter.report(status)

    def event(self, type_: str, reason: str, message: str) -> None:
        for reporter in self.reporters:
            reporter.event(type_, reason, message)


def rollout_health_reporter(contract: TrainerEnv) -> Callable[[dict[str, Any]], None] | None:
    """Writes ``status.rollout`` of the pod's TrainingRun (None outside a cluster): what
    the trainer saw of its RolloutPool while waiting for a ready replica."""
    name, namespace = contract.run_name, contract.run_namespace
    if not name:
        return None
    reporter = KubeStatusReporter(name, namespace or "default")
    return lambda health: reporter.patch({"rollout": health})


def status_reporter(out_dir: Path, contract: TrainerEnv) -> StatusReporter:
    """Local file always; plus the TrainingRun status when the operator named the run."""
    reporters: list[StatusReporter] = [LocalStatusReporter(out_dir)]
    name, namespace = contract.run_name, contract.run_namespace
    if name:
        reporters.append(KubeStatusReporter(name, namespace or "default"))
        log.info("reporting progress to TrainingRun %s/%s", namespace or "default", name)
    return FanOutStatusReporter(reporters)
