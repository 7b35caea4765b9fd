"""``posttrain get`` / ``describe`` against the real apiserver, and the kubectl experience:
the same progress in ``kubectl get tr``, conditions and events in ``kubectl describe tr``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cluster
CliRunner = Any

PROGRESS = dict(
    phase="Running",
    step=2,
    max_steps=3,
    reward_mean=0.4375,
    domain_rewards={"arith": 0.625, "code": 0.25},
    eval_accuracy={"arith": 0.5, "code": 0.125},
    last_checkpoint="s3://posttrain/runs/demo/checkpoints/step-000002",
    weight_version=2,
    stage="rl",
)


def row_of(output: str, name: str) -> list[str]:
    """The whitespace-split table row that starts with ``name``."""
    return next(line.split() for line in output.splitlines() if line.split()[:1] == [name])


def test_get_shows_the_trainers_progress(kcli: CliRunner, kube: Any) -> None:
    kube.create_run("demo")
    kube.create_run("fresh")
    kube.report_progress("demo", **PROGRESS)

    result = kcli("get", "tr")
    assert result.code == 0, result.err
    header = result.out.splitlines()[0].split()
    assert header[:4] == ["NAME", "PHASE", "STEP", "REWARD"]
    assert row_of(result.out, "demo")[:9] == [
        "demo",
        "Running",
        "2/3",
        "0.438",
        "arith=0.62",
        "code=0.25",
        "arith=0.50",
        "code=0.12",
        "…uns/demo/checkpoints/step-000002",
    ]
    assert row_of(result.out, "fresh")[:4] == ["fresh", "-", "-", "-"]  # not reconciled yet

    single = kcli("get", "trainingrun", "demo", "-o", "json")
    assert json.loads(single.out)["status"]["domainRewards"] == {"arith": 0.625, "code": 0.25}
    listed = kcli("get", "all", "-o", "yaml")
    assert "kind: List" in listed.out and "name: fresh" in listed.out


def test_kubectl_get_and_posttrain_get_agree(kcli: CliRunner, kube: Any, kubectl: Any) -> None:
    kube.create_run("demo")
    kube.report_progress("demo", **PROGRESS)
    ours = row_of(kcli("get", "tr").out, "demo")
    theirs = row_of(
        kubectl("get", "tr", "-n", kube.namespace, "-o", "wide").stdout, "demo"
    )  # NAME PHASE STEP MAX REWARD STAGE AGE CHECKPOINT MESSAGE
    assert theirs[1] == ours[1] == "Running"
    step, max_steps = ours[2].split("/")
    assert (theirs[2], theirs[3]) == (step, max_steps)
    assert float(theirs[4]) == pytest.approx(
        float(ours[3]), abs=6e-4
    )  # ours is rounded to 3 digits
    assert theirs[5] == "rl"
    assert theirs[7].endswith("step-000002") and ours[8].endswith("step-000002")


def test_get_errors_have_exit_codes(kcli: CliRunner, kube: Any) -> None:
    missing = kcli("get", "tr", "nope")
    assert missing.code == 1 and "'nope'" in missing.err and "not found" in missing.err
    bad_kind = kcli("get", "widgets")
    assert bad_kind.code == 2 and "unknown resource type 'widgets'" in bad_kind.err
    empty = kcli("get", "rp")
    assert empty.code == 0 and "No resources found" in empty.err


def test_describe_explains_conditions_events_and_children(
    kcli: CliRunner, kube: Any, kubectl: Any
) -> None:
    from kubernetes import client

    run = kube.create_run("demo")
    kube.report_progress("demo", **{**PROGRESS, "phase": "Failed"})
    kube.patch_status(
        "demo",
        {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "BackoffLimitExceeded",
                    "message": "trainer exited 137 (OOMKilled) 4 times; "
                    "raise spec.resources.memory",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                },
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "TrainerFailed",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                },
            ]
        },
    )
    kube.post_event(
        run, "TrainerRestarted", "trainer pod demo-g1-0 OOMKilled; restart 1 of 3", type_="Warning"
    )
    kube.core.create_namespaced_pod(
        kube.namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(
                name="demo-g1-0",
                labels={"posttrain.io/run": "demo", "posttrain.io/component": "trainer"},
            ),
            spec=client.V1PodSpec(containers=[client.V1Container(name="trainer", image="busybox")]),
        ),
    )

    result = kcli("describe", "tr", "demo")
    assert result.code == 0, result.err
    out = result.out
    assert "Model:        smollm2-135m-instruct" in out
    assert "arith" in out and "numeric" in out  # domains with weights and verifiers
    assert "Step:         2/3" in out
    assert "BackoffLimitExceeded" in out and "raise spec.resources.memory" in out
    assert "TrainerRestarted" in out and "posttrain-operator" in out
    assert "Pod   demo-g1-0  Pending (not scheduled)" in out

    described = kubectl("describe", "tr", "demo", "-n", kube.namespace).stdout
    assert "BackoffLimitExceeded" in described  # kubectl shows the same conditions...
    assert "TrainerRestarted" in described  # ...and the same events


def test_describe_shows_where_the_runs_reports_are(kcli: CliRunner, kube: Any) -> None:
    """status.reportsUri (written by the trainer, through its own reporter) is the prefix
    `posttrain report` renders; describe names it, and says so while it is not known."""
    kube.create_run("demo")
    kube.create_run("fresh")
    uri = f"s3://posttrain/runs/{kube.namespace}/demo/u-1/reports"
    began = f"s3://posttrain/runs/{kube.namespace}/demo/u-0/checkpoints/step-00000003"
    wait = {"fraction": 0.25, "waitSeconds": 5.0, "stepSeconds": 20.0, "steps": 4,
            "windowStart": "2026-12-06T07:00:00Z"}  # fmt: skip
    kube.report_progress("demo", **PROGRESS, reports_uri=uri, resumed_from=began, rollout_wait=wait)

    out = kcli("describe", "tr", "demo")
    assert out.code == 0, out.err
    lines = [line.strip() for line in out.out.splitlines()]
    assert f"Outputs:      {uri}" in lines, out.out
    assert f"Started from: {began}" in lines, out.out  # the apiserver kept status.resumedFrom
    assert "Rollout wait: 25% of step time (last 4 step(s))" in lines, out.out
    fresh = kcli("describe", "tr", "fresh")
    assert fresh.code == 0, fresh.err
    assert "Outputs:      -" in [line.strip() for line in fresh.out.splitlines()], fresh.out


def test_trainer_stage_events_and_records_reach_kubectl(kube: Any, kubectl: Any) -> None:
    """The trainer's stage boundary Events and status.stages, through its own reporter."""
    from posttrain.api import TrainingRun
    from posttrain.trainer.observe.status import STAGE_STARTED, KubeStatusReporter, RunStatus

    kube.create_run("staged")
    reporter = KubeStatusReporter("staged", kube.namespace, api=kube.custom)
    reporter.event("Normal", STAGE_STARTED, "stage sft (sft) started: steps 1-8, lr 2e-05")
    record = {
        "name": "sft",
        "type": "sft",
        "phase": "Running",
        "firstStep": 1,
        "lastStep": 8,
        "startTime": "2026-12-03T13:00:00+00:00",
        "skippedExamples": {"emptyCompletion": 2},
    }
    reporter.report(RunStatus(step=3, max_steps=12, reward_mean=0.5, stage="sft", stages=[record]))
    kube.patch_status("staged", {"phase": "Running"})  # the operator's field
    described = kubectl("describe", "tr", "staged", "-n", kube.namespace).stdout
    assert "StageStarted" in described and "stage sft (sft) started: steps 1-8" in described
    row = row_of(kubectl("get", "tr", "-n", kube.namespace).stdout, "staged")
    assert row[2:4] == ["3", "12"] and row[5] == "sft"  # STEP MAX ... STAGE
    stored = kube.get_run("staged")
    # what the trainer wrote is valid against the CRD and reads back through the API model
    status = TrainingRun.model_validate(
        {"metadata": {"name": "staged"}, "spec": stored["spec"], "status": stored["status"]}
    ).status
    assert status.stages[0].skipped_examples == {"emptyCompletion": 2}
    assert status.stage == "sft"


def test_describe_missing_run_is_exit_1(kcli: CliRunner, kube: Any) -> None:
    result = kcli("describe", "tr", "ghost")
    assert result.code == 1 and "not found" in result.err


def test_get_pools_and_tasks_and_all_namespaces(kcli: CliRunner, kube: Any) -> None:
    from posttrain.api.base import GROUP, VERSION

    def create(plural: str, body: dict[str, Any], status: dict[str, Any]) -> None:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, kube.namespace, plural, body)
        kube.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, kube.namespace, plural, body["metadata"]["name"], {"status": status}
        )

    create(
        "rolloutpools",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RolloutPool",
            "metadata": {"name": "pool"},
            "spec": {"model": "smollm2-135m-instruct", "replicas": 3, "engine": "cpu"},
        },
        {"phase": "Degraded", "readyReplicas": 2, "replicas": 3, "weightVersion": 7},
    )
    create(
        "sandboxtasks",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SandboxTask",
            "metadata": {"name": "task"},
            "spec": {"command": ["python3", "-c", "print(1)"]},
        },
        {
            "phase": "Succeeded",
            "reward": 1.0,
            "durationMs": 1234.0,
            "exitCode": 0,
            "reason": "Completed",
            "attempts": 1,
        },
    )

    pools = kcli("get", "rp")
    assert row_of(pools.out, "pool")[:6] == [
        "pool",
        "Degraded",
        "2/3",
        "smollm2-135m-instruct",
        "cpu",
        "v7",
    ]
    tasks = kcli("get", "st")
    assert row_of(tasks.out, "task")[:7] == [
        "task",
        "Succeeded",
        "1.000",
        "1.23s",
        "0",
        "Completed",
        "1",
    ]
    everything = kcli("get", "all", "-A")
    assert "rolloutpool.posttrain.io" in everything.out
    assert "sandboxtask.posttrain.io" in everything.out
    assert row_of(everything.out, kube.namespace)[:2] == [kube.namespace, "pool"]

    described = kcli("describe", "rp", "pool")
    assert described.code == 0 and "readyReplicas: 2" in described.out


def test_watch_live_table_on_a_terminal(kube: Any, kubeconfig: Any) -> None:
    """On a terminal watch redraws one rich Live table instead of appending lines."""
    import io

    from rich.console import Console

    from posttrain.ctl.follow import watch_run
    from posttrain.ctl.kube import connect

    kube.create_run("live")
    kube.report_progress(
        "live",
        phase="Succeeded",
        step=3,
        max_steps=3,
        reward_mean=0.75,
        domain_rewards={"arith": 0.5, "code": 1.0},
    )
    console = Console(file=io.StringIO(), force_terminal=True, width=120, record=True)
    code = watch_run(connect(str(kubeconfig), kube.namespace), "live", 30, console)
    assert code == 0
    screen = console.export_text()
    assert "r:arith" in screen and "r:code" in screen
    assert "3/3" in screen and "Succeeded" in screen and "0.750" in screen


def test_warm_pools_and_a_task_the_operator_refused(
    kcli: CliRunner, kube: Any, tmp_path: Path
) -> None:
    """SandboxWarmPool is a kind like the others (apply, get swp, describe swp); a task
    refused as InvalidSpec never ran, so it has no duration and its REASON is the
    condition's; describe of a task names the task's own label."""
    from posttrain.api.base import GROUP, VERSION

    def patch_status(plural: str, name: str, status: dict[str, Any]) -> None:
        kube.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, kube.namespace, plural, name, {"status": status}
        )

    manifest = tmp_path / "swp.yaml"
    manifest.write_text(
        f"apiVersion: {GROUP}/{VERSION}\nkind: SandboxWarmPool\nmetadata: {{name: py}}\n"
        "spec: {replicas: 3}\n"
    )
    applied = kcli("apply", "-f", str(manifest))
    assert applied.code == 0, applied.err
    assert applied.out.strip() == "sandboxwarmpool.posttrain.io/py created"
    patch_status("sandboxwarmpools", "py", {"readyReplicas": 2, "replicas": 3, "claimed": 1})
    kube.custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        kube.namespace,
        "sandboxtasks",
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SandboxTask",
            "metadata": {"name": "bad"},
            "spec": {"command": ["python3", "-c", "print(1)"]},
        },
    )
    refused = {
        "type": "Failed",
        "status": "True",
        "reason": "InvalidSpec",
        "message": "cannot build children: spec.snapshot needs the operator's S3 store",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    patch_status("sandboxtasks", "bad", {"phase": "Failed", "conditions": [refused]})

    pools = kcli("get", "swp")
    assert pools.code == 0, pools.err
    assert pools.out.splitlines()[0].split() == [
        "NAME",
        "READY",
        "CLAIMED",
        "IMAGE",
        "NETWORK",
        "AGE",
    ]
    assert row_of(pools.out, "py")[:5] == ["py", "2/3", "1", "operator-default", "none"]
    everything = kcli("get")
    assert "sandboxwarmpool.posttrain.io" in everything.out, everything.out
    tasks = kcli("get", "st")
    assert row_of(tasks.out, "bad")[:7] == ["bad", "Failed", "-", "-", "-", "InvalidSpec", "0"]

    task = kcli("describe", "st", "bad")
    assert task.code == 0, task.err
    assert "no pod or job has the label posttrain.io/task=bad yet" in task.out
    assert "run's label" not in task.out
    pool = kcli("describe", "sandboxwarmpool", "py")
    assert pool.code == 0 and "claimed: 1" in pool.out, pool.out
    assert "posttrain.io/warm-pool=py" in pool.out


def test_a_run_that_found_its_pool_keeps_no_stale_waiting_message(kube: Any) -> None:
    """The trainer reports status.rollout while it waits for the pool (ReplicasUnavailable)
    and again once it found replicas: that second merge patch must clear the waiting message,
    or a Succeeded run still says it waits (issue #35)."""
    from posttrain.api.base import GROUP, VERSION
    from posttrain.rollout.discovery import PoolDiscovery
    from posttrain.trainer.observe.status import KubeStatusReporter

    kube.create_run("demo")
    pool = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutPool",
        "metadata": {"name": "p"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1},
    }
    kube.custom.create_namespaced_custom_object(
        GROUP, VERSION, kube.namespace, "rolloutpools", pool
    )

    def pool_status(status: dict[str, Any]) -> None:
        kube.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, kube.namespace, "rolloutpools", "p", {"status": status}
        )

    waiting = {"type": "Ready", "status": "False", "reason": "ReplicasUnavailable",
               "message": "0/1 replica(s) ready", "lastTransitionTime": "2026-12-06T00:00:00Z"}  # fmt: skip
    pool_status({"conditions": [waiting]})
    reporter = KubeStatusReporter("demo", kube.namespace, api=kube.custom)
    report = lambda health: reporter.patch({"rollout": health})  # noqa: E731  (as the trainer)
    discovery = PoolDiscovery("p", kube.namespace, api=kube.custom)
    with pytest.raises(TimeoutError):
        discovery.wait_ready(timeout_s=0.5, poll_s=0.1, report=report)
    assert "ReplicasUnavailable" in kube.get_run("demo")["status"]["rollout"]["message"]

    pool_status({"replicaEndpoints": ["http://127.0.0.1:1"]})
    discovery.wait_ready(timeout_s=5, poll_s=0.1, report=report)
    rollout = kube.get_run("demo")["status"]["rollout"]
    assert rollout["available"] is True and rollout["readyReplicas"] == 1
    assert "message" not in rollout, rollout
