"""The decision functions, driven with hand-written observations (no cluster)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from posttrain.api import RolloutPool, SandboxTask, TrainingRun
from posttrain.api import labels as api_labels
from posttrain.operator.config import OperatorConfig
from posttrain.operator.rolloutpool import builders as pool_builders
from posttrain.operator.rolloutpool.plan import plan_rollout_pool
from posttrain.operator.sandboxtask.plan import parse_sandbox_result, plan_sandbox
from posttrain.operator.shared.views import PodView, Terminated, pod_view
from posttrain.operator.trainingrun.plan import plan_training_run

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def task(status: dict[str, Any] | None = None, **spec: Any) -> SandboxTask:
    return SandboxTask.model_validate(
        {
            "metadata": {"name": "t", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"command": ["true"], **spec},
            "status": status or {},
        }
    )


def run(status: dict[str, Any] | None = None, **spec: Any) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "metadata": {"name": "r", "namespace": "ns", "uid": "u", "generation": 2},
            "spec": {
                "model": "m",
                "domains": [{"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}],
                **spec,
            },
            "status": status or {},
        }
    )


def trainer_pod(incarnation: int, rank: int, phase: str = "Running") -> PodView:
    return PodView(
        f"r-g{incarnation}-{rank}",
        {api_labels.LABEL_GANG: str(incarnation), api_labels.LABEL_RANK: str(rank)},
        phase=phase,
        terminated=Terminated(1) if phase == "Failed" else None,
    )


def test_new_task_costs_one_pod_create_and_no_status_write() -> None:
    plan = plan_sandbox(task(), [], NOW)
    assert plan.create_attempt == 1
    assert plan.status_patch == {} and plan.events == []
    # The pod exists but has not started: still nothing to write.
    pending = plan_sandbox(task(), [PodView("t-1", {}, phase="Pending")], NOW)
    assert pending.create_attempt is None and pending.status_patch == {}


def test_running_pod_records_attempt_and_is_idempotent() -> None:
    pod = PodView("t-1", {}, phase="Running", start_time=NOW)
    first = plan_sandbox(task(), [pod], NOW)
    assert first.status_patch["phase"] == "Running"
    assert (first.status_patch["attempts"], first.status_patch["podName"]) == (1, "t-1")
    assert first.status_patch["startTime"] == "2026-01-01T12:00:00Z"
    again = plan_sandbox(task(first.status_patch), [pod], NOW)
    assert again.create_attempt is None and again.status_patch == {} and again.events == []


def test_missing_pod_is_recreated_under_the_same_name() -> None:
    """Cache lag or an external delete: create-or-adopt with the deterministic name."""
    status = {"attempts": 1, "podName": "t-1", "phase": "Pending", "observedGeneration": 1}
    plan = plan_sandbox(task(status), [], NOW)
    assert plan.create_attempt == 1 and plan.status_patch == {}


def test_result_protocol_json_and_fallbacks() -> None:
    ok = PodView(
        "p",
        {},
        phase="Succeeded",
        terminated=Terminated(
            0,
            "Completed",
            '{"exit_code": 0, "reward": 0.25, "duration_ms": 9, "reason": "Completed"}',
        ),
    )
    assert parse_sandbox_result(ok).reward == 0.25
    logs = PodView("p", {}, phase="Failed", terminated=Terminated(2, "Error", "Traceback ..."))
    result = parse_sandbox_result(logs)
    assert (result.exit_code, result.reward, result.reason) == (2, 0.0, "Error")
    oom = PodView("p", {}, phase="Failed", terminated=Terminated(137, "OOMKilled"))
    assert parse_sandbox_result(oom).reason == "OOMKilled"
    timeout = PodView("p", {}, phase="Failed", reason="DeadlineExceeded")
    assert parse_sandbox_result(timeout).reason == "Timeout"
    assert not parse_sandbox_result(timeout).sandbox_failed
    evicted = PodView("p", {}, phase="Failed", reason="Evicted")
    assert parse_sandbox_result(evicted).sandbox_failed


def test_timeout_is_a_program_failure_not_retried() -> None:
    status = {"attempts": 1, "podName": "t-1", "phase": "Running"}
    pod = PodView("t-1", {}, phase="Failed", reason="DeadlineExceeded")
    plan = plan_sandbox(task(status, retries=3), [pod], NOW)
    assert plan.create_attempt is None
    assert plan.status_patch["phase"] == "Failed"
    assert plan.status_patch["reason"] == "Timeout"


def test_ttl_deletes_only_after_expiry() -> None:
    done = {"phase": "Succeeded", "attempts": 1, "completionTime": NOW.isoformat()}
    assert not plan_sandbox(task(done, ttlSecondsAfterFinished=60), [], NOW).delete_task
    later = NOW + timedelta(seconds=61)
    assert plan_sandbox(task(done, ttlSecondsAfterFinished=60), [], later).delete_task
    keep = task(done, ttlSecondsAfterFinished=None)
    assert not plan_sandbox(keep, [], later + timedelta(days=365)).delete_task


def test_run_first_reconcile_creates_gang_and_status() -> None:
    plan = plan_training_run(run(resources={"nodes": 2}), [], 0, NOW)
    assert plan.create_ranks == [0, 1] and plan.ensure_children and plan.incarnation == 0
    patch = plan.status_patch
    assert patch["phase"] == "Pending" and patch["observedGeneration"] == 2
    assert patch["maxSteps"] == 20 and patch["startTime"]
    # Never a trainer-owned field.
    trainer_fields = {
        "step",
        "rewardMean",
        "domainRewards",
        "evalAccuracy",
        "lastCheckpoint",
        "weightVersion",
    }
    assert not trainer_fields & patch.keys()


def test_run_gang_failure_restarts_whole_gang() -> None:
    status = {"phase": "Running", "restarts": 0, "startTime": NOW.isoformat(), "step": 4}
    pods = [trainer_pod(0, 0), trainer_pod(0, 1, "Failed")]
    plan = plan_training_run(run(status, resources={"nodes": 2}), pods, 0, NOW)
    assert sorted(plan.delete_pods) == ["r-g0-0", "r-g0-1"]
    assert plan.incarnation == 1 and plan.create_ranks == [0, 1]
    assert plan.status_patch["restarts"] == 1
    assert "step" not in plan.status_patch


def test_run_suspend_and_resume() -> None:
    status = {"phase": "Running", "startTime": NOW.isoformat()}
    plan = plan_training_run(run(status, suspend=True), [trainer_pod(0, 0)], 0, NOW)
    assert plan.delete_pods == ["r-g0-0"] and plan.create_ranks == []
    assert plan.status_patch["phase"] == "Suspended"
    resumed = plan_training_run(
        run({"phase": "Suspended", "startTime": NOW.isoformat()}), [], 0, NOW
    )
    assert resumed.incarnation == 1 and resumed.create_ranks == [0]
    assert [e.reason for e in resumed.events][:1] == ["Resumed"]


def test_run_success_only_from_rank_zero_and_cleans_workers() -> None:
    status = {"phase": "Running", "startTime": NOW.isoformat()}
    pods = [trainer_pod(0, 0, "Succeeded"), trainer_pod(0, 1, "Running")]
    plan = plan_training_run(run(status, resources={"nodes": 2}), pods, 0, NOW)
    assert plan.status_patch["phase"] == "Succeeded"
    assert plan.delete_pods == ["r-g0-1"]


def test_a_failed_run_keeps_the_failed_pod_whose_log_says_why() -> None:
    """The documented pod policy (docs/operator.md, "Trainer pods after a run"): a run that
    ended deletes its running pods and keeps the finished ones, failed as well as succeeded,
    so `posttrain logs` still shows why; later reconciles keep them too."""
    status = {"phase": "Running", "restarts": 1, "startTime": NOW.isoformat(), "step": 2}
    pods = [trainer_pod(1, 0, "Failed"), trainer_pod(1, 1, "Running")]
    plan = plan_training_run(run(status, resources={"nodes": 2}, backoffLimit=1), pods, 1, NOW)
    assert plan.status_patch["phase"] == "Failed"
    assert plan.delete_pods == ["r-g1-1"] and plan.create_ranks == []
    after = plan_training_run(
        run({**status, "phase": "Failed"}, resources={"nodes": 2}, backoffLimit=1),
        [trainer_pod(1, 0, "Failed")],
        1,
        NOW,
    )
    assert after.delete_pods == []


def test_pool_plan_scales_and_reports_selector() -> None:
    pool = RolloutPool.model_validate(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": "m", "engine": "cpu", "replicas": 3},
        }
    )
    desired = pool_builders.build_rollout_deployment(pool, OperatorConfig())
    have = {
        **desired,
        "spec": {**desired["spec"], "replicas": 1},
        "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }
    plan = plan_rollout_pool(pool, desired, have, [], "sel", "http://p")
    assert plan.patch_deployment == {"spec": {"replicas": 3}}
    assert plan.status_patch["selector"] == "sel"
    assert plan.status_patch["phase"] == "Degraded"


def _vllm_pool_with(pod_status: dict[str, Any], model: str) -> dict[str, Any]:
    pool = RolloutPool.model_validate(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": model, "replicas": 1},
        }
    )
    desired = pool_builders.build_rollout_deployment(pool, OperatorConfig())
    have = {**desired, "status": {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1}}
    pod = pod_view({"metadata": {"name": "p-abc"}, "status": pod_status})
    plan = plan_rollout_pool(pool, desired, have, [pod], "sel", "http://p")
    (ready,) = [c for c in plan.status_patch["conditions"] if c["type"] == "Ready"]
    return ready


def test_pool_unreachable_model_is_not_ready_naming_the_uri() -> None:
    uri = "s3://models/missing-checkpoint"
    ready = _vllm_pool_with(
        {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "fetch-model",
                    "restartCount": 2,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 1,
                            "message": f"cannot fetch model {uri}: no objects under that prefix",
                        }
                    },
                }
            ],
        },
        uri,
    )
    assert ready["status"] == "False"
    assert ready["reason"] == "ModelUnavailable"
    assert uri in ready["message"] and "p-abc" in ready["message"]


def test_pool_crash_looping_replica_surfaces_in_status() -> None:
    ready = _vllm_pool_with(
        {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "server",
                    "restartCount": 4,
                    "ready": False,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {"exitCode": 1, "message": "RuntimeError: out of memory"}
                    },
                }
            ],
        },
        "smollm2-135m-instruct",
    )
    assert ready["status"] == "False"
    assert ready["reason"] == "ReplicaCrashLooping"
    assert "4 restart(s)" in ready["message"] and "out of memory" in ready["message"]
    healthy = _vllm_pool_with(
        {
            "phase": "Running",
            "containerStatuses": [{"name": "server", "restartCount": 0, "state": {"running": {}}}],
        },
        "m",
    )
    assert healthy["reason"] == "ReplicasUnavailable"


def test_pod_view_reads_kubelet_status() -> None:
    view = pod_view(
        {
            "metadata": {"name": "p", "labels": {"a": "b"}, "deletionTimestamp": "x"},
            "status": {
                "phase": "Failed",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [
                    {
                        "state": {
                            "terminated": {
                                "exitCode": 3,
                                "reason": "Error",
                                "message": "m",
                                "startedAt": "2026-01-01T00:00:00Z",
                                "finishedAt": "2026-01-01T00:00:01Z",
                            }
                        }
                    }
                ],
            },
        }
    )
    assert view.deleting and not view.ready and view.terminated is not None
    assert view.terminated.exit_code == 3
    assert parse_sandbox_result(view).duration_ms == 1000.0


def test_sandbox_health_from_the_trainer_becomes_the_sandbox_available_condition() -> None:
    url = "http://gone.ns.svc:8090"
    status = {
        "phase": "Running",
        "startTime": NOW.isoformat(),
        "sandbox": {
            "mode": "runner",
            "endpoint": url,
            "available": False,
            "infraFailures": 7,
            "lastError": f"sandbox runner {url} failed 5 times",
        },
    }
    plan = plan_training_run(run(status), [trainer_pod(0, 0)], 0, NOW)
    (cond,) = [c for c in plan.status_patch["conditions"] if c["type"] == "SandboxAvailable"]
    assert (cond["status"], cond["reason"]) == ("False", "SandboxUnavailable")
    assert url in cond["message"] and "7 time(s)" in cond["message"]
    assert [(e.type, e.reason) for e in plan.events] == [("Warning", "SandboxUnavailable")]
    # The operator never writes the trainer's sandbox report itself.
    assert "sandbox" not in plan.status_patch

    recovered = dict(
        status,
        conditions=plan.status_patch["conditions"],
        sandbox={**status["sandbox"], "available": True},
    )
    again = plan_training_run(run(recovered), [trainer_pod(0, 0)], 0, NOW)
    (cond,) = [c for c in again.status_patch["conditions"] if c["type"] == "SandboxAvailable"]
    assert (cond["status"], cond["reason"]) == ("True", "SandboxWorking")
    assert [e.reason for e in again.events] == ["SandboxWorking"]


def test_a_run_without_sandbox_reports_has_no_sandbox_condition() -> None:
    plan = plan_training_run(
        run({"phase": "Running", "startTime": NOW.isoformat()}), [trainer_pod(0, 0)], 0, NOW
    )
    assert all(c["type"] != "SandboxAvailable" for c in plan.status_patch.get("conditions", []))


def test_pool_weight_version_is_cleared_when_a_ready_replica_is_unknown() -> None:
    """A replica replaced since the last reconcile, not yet answering the operator's probe:
    the pool's weightVersion is removed (merge patch null), not left at the old number."""
    pool = RolloutPool.model_validate(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"model": "m", "replicas": 2},
            "status": {"weightVersion": 3},
        }
    )
    desired = pool_builders.build_rollout_deployment(pool, OperatorConfig())
    have = {**desired, "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}
    ready = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}  # fmt: skip
    pods = [
        pod_view({"metadata": {"name": f"p-{i}"}, "status": {**ready, "podIP": f"10.0.0.{i}"}})
        for i in (1, 2)
    ]
    plan = plan_rollout_pool(pool, desired, have, pods, "sel", "http://p", served={"p-1": 3})
    assert plan.status_patch["weightVersion"] is None
    assert [r.get("weightVersion") for r in plan.status_patch["replicaWeights"]] == [3, None]
    both = plan_rollout_pool(pool, desired, have, pods, "sel", "http://p",
                             served={"p-1": 5, "p-2": 4})  # fmt: skip
    assert both.status_patch["weightVersion"] == 4  # the lowest served
