"""Admission through Kueue and managedBy, as pure decisions (no cluster): the Workload's
manifest, reading Kueue's answer, and what a run does while waiting, admitted, evicted,
suspended and finished."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from posttrain.api import TrainingRun
from posttrain.api import labels as api_labels
from posttrain.api.reasons import Reason
from posttrain.operator.config import OperatorConfig
from posttrain.operator.shared.builders import owner_reference
from posttrain.operator.shared.views import PodView
from posttrain.operator.trainingrun import builders as run_builders
from posttrain.operator.trainingrun.kueue import (
    QUEUE_NAME_LABEL,
    WorkloadView,
    build_workload,
    workload_view,
)
from posttrain.operator.trainingrun.plan import KueueGate, managed_elsewhere, plan_training_run

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def queued_run(status: dict[str, Any] | None = None, **spec: Any) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "metadata": {
                "name": "r",
                "namespace": "ns",
                "uid": "u",
                "generation": 1,
                "labels": {QUEUE_NAME_LABEL: "team-a"},
            },
            "spec": {
                "model": "m",
                "domains": [{"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}],
                "resources": {"nodes": 2, "cpu": "4", "memory": "16Gi", "gpusPerNode": 1},
                **spec,
            },
            "status": status or {},
        }
    )


def condition(plan_status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in plan_status["conditions"] if c["type"] == kind)


def test_workload_is_one_gang_sized_pod_set_owned_by_the_run() -> None:
    run = queued_run()
    pod = run_builders.build_trainer_pod(run, OperatorConfig(), 0, 0)
    labels = {api_labels.LABEL_RUN: "r"}
    workload = build_workload(run, pod, labels, owner_reference(run))
    assert workload["metadata"]["name"] == "trainingrun-r"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert workload["spec"]["queueName"] == "team-a"
    (pod_set,) = workload["spec"]["podSets"]
    assert pod_set["count"] == 2 and "minCount" not in pod_set  # all or nothing
    container = pod_set["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"] == "4"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_kueue_answer_is_read_from_conditions_and_admission() -> None:
    pending = workload_view(
        {
            "metadata": {"name": "w"},
            "status": {
                "conditions": [
                    {
                        "type": "QuotaReserved",
                        "status": "False",
                        "reason": "Pending",
                        "message": "couldn't assign flavors: insufficient quota for cpu",
                    }
                ]
            },
        }
    )
    assert not pending.admitted and "insufficient quota" in pending.pending_message
    evicted = workload_view(
        {
            "metadata": {"name": "w"},
            "spec": {"active": False},
            "status": {
                "conditions": [
                    {
                        "type": "Evicted",
                        "status": "True",
                        "reason": "Preempted",
                        "message": "preempted by a higher priority workload",
                    }
                ]
            },
        }
    )
    assert (evicted.admitted, evicted.evicted_reason, evicted.active) == (False, "Preempted", False)


def test_waiting_run_has_no_pods_and_says_why() -> None:
    plan = plan_training_run(queued_run(), [], 0, NOW, kueue=KueueGate("team-a", None))
    assert plan.create_workload and plan.create_ranks == [] and not plan.ensure_children
    assert plan.status_patch["phase"] == "Pending"
    suspended = condition(plan.status_patch, "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", Reason.WAITING_FOR_ADMISSION)
    assert "LocalQueue team-a" in suspended["message"]
    assert "startTime" not in plan.status_patch  # waiting in the queue is not running time
    assert [e.reason for e in plan.events] == [Reason.WAITING_FOR_ADMISSION]
    # Kueue answered "no quota": the message says so, and no second event.
    waiting = queued_run(status=plan.status_patch)
    wl = WorkloadView("trainingrun-r", admitted=False, pending_message="insufficient quota")
    again = plan_training_run(waiting, [], 0, NOW, kueue=KueueGate("team-a", wl))
    assert not again.create_workload and again.events == []
    assert "insufficient quota" in again.status_patch["message"]


def test_admission_starts_the_gang_and_eviction_deletes_it() -> None:
    waiting = queued_run(
        status=plan_training_run(
            queued_run(), [], 0, NOW, kueue=KueueGate("team-a", None)
        ).status_patch
    )
    admitted = WorkloadView("trainingrun-r", admitted=True, cluster_queue="cq")
    start = plan_training_run(waiting, [], 0, NOW, kueue=KueueGate("team-a", admitted))
    assert start.create_ranks == [0, 1] and start.ensure_children
    assert condition(start.status_patch, "Suspended")["reason"] == Reason.ADMITTED
    assert Reason.ADMITTED in [e.reason for e in start.events]

    running = queued_run(status={**waiting.status.to_wire(), **start.status_patch})
    pods = [
        PodView(
            f"r-g0-{i}",
            {api_labels.LABEL_GANG: "0", api_labels.LABEL_RANK: str(i)},
            phase="Running",
        )
        for i in range(2)
    ]
    evicted = WorkloadView("trainingrun-r", admitted=False, evicted_reason="Preempted")
    stop = plan_training_run(running, pods, 0, NOW, kueue=KueueGate("team-a", evicted))
    assert sorted(stop.delete_pods) == ["r-g0-0", "r-g0-1"] and stop.create_ranks == []
    assert condition(stop.status_patch, "Suspended")["reason"] == Reason.EVICTED
    assert "restarts" not in stop.status_patch  # an eviction is not a failure

    # Admitted again: a new incarnation (the old pods may still be terminating).
    after = queued_run(status={**running.status.to_wire(), **stop.status_patch})
    again = plan_training_run(after, [], 0, NOW, kueue=KueueGate("team-a", admitted))
    assert again.incarnation == 1 and again.create_ranks == [0, 1]


def test_suspend_deactivates_the_workload_and_finishing_releases_it() -> None:
    admitted = WorkloadView("trainingrun-r", admitted=True)
    plan = plan_training_run(
        queued_run(suspend=True), [], 0, NOW, kueue=KueueGate("team-a", admitted)
    )
    assert plan.workload_active is False
    inactive = WorkloadView("trainingrun-r", admitted=False, active=False)
    resumed = plan_training_run(
        queued_run(status=plan.status_patch), [], 0, NOW, kueue=KueueGate("team-a", inactive)
    )
    assert resumed.workload_active is True and resumed.create_ranks == []
    done = plan_training_run(
        queued_run(status={"phase": "Succeeded"}), [], 0, NOW, kueue=KueueGate("team-a", admitted)
    )
    assert done.finish_workload
    finished = WorkloadView("trainingrun-r", admitted=True, finished=True)
    assert not plan_training_run(
        queued_run(status={"phase": "Succeeded"}), [], 0, NOW, kueue=KueueGate("team-a", finished)
    ).finish_workload


def test_managed_by_another_controller_is_left_alone() -> None:
    assert managed_elsewhere(None) is None
    assert managed_elsewhere("posttrain.io/trainingrun-controller") is None
    why = managed_elsewhere("kueue.x-k8s.io/multikueue")
    assert why is not None and "kueue.x-k8s.io/multikueue" in why
