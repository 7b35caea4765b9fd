"""``posttrain watch`` fed by the watch API while a thread reports steps like the trainer,
and ``posttrain logs`` when there is no pod (or no log) to read yet."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.cluster
CliRunner = Any


@pytest.fixture
def watch_started(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once `posttrain watch` has read the run and starts watching from its
    resourceVersion: every status patch after that reaches the watch however late the
    watch request itself is sent, so the test holds on a loaded machine."""
    from posttrain.ctl import follow as ctl_follow

    started = threading.Event()
    real = ctl_follow.run_events

    def run_events(*args: Any, **kwargs: Any) -> Any:
        started.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(ctl_follow, "run_events", run_events)
    return started


def report_steps_in_background(
    kube: Any, name: str, final_phase: str, watch_started: threading.Event
) -> threading.Thread:
    """Once the watch started, report steps 1..3 (as the trainer does), then the final phase."""

    def work() -> None:
        watch_started.wait(timeout=120)
        for step in (1, 2, 3):
            time.sleep(0.3)
            kube.report_progress(
                name,
                phase="Running",
                step=step,
                max_steps=3,
                reward_mean=0.1 * step,
                domain_rewards={"arith": 0.2 * step, "code": 0.05 * step},
                eval_accuracy={"arith": 0.25 * step} if step == 3 else {},
                last_checkpoint=f"s3://b/runs/{name}/checkpoints/step-{step:06d}",
            )
        time.sleep(0.3)
        if final_phase == "Failed":
            kube.patch_status(
                name,
                {
                    "phase": "Failed",
                    "conditions": [
                        {
                            "type": "Failed",
                            "status": "True",
                            "reason": "BackoffLimitExceeded",
                            "message": "trainer failed 4 times",
                            "lastTransitionTime": "2026-01-01T00:00:00Z",
                        }
                    ],
                },
            )
        else:
            kube.report_progress(name, phase=final_phase, step=3, max_steps=3, reward_mean=0.3)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_watch_prints_each_step_and_exits_0_on_success(
    kcli: CliRunner, kube: Any, watch_started: threading.Event
) -> None:
    kube.create_run("demo")
    writer = report_steps_in_background(kube, "demo", "Succeeded", watch_started)
    started = time.monotonic()
    result = kcli("watch", "tr", "demo", "--timeout", "60")
    writer.join(timeout=10)
    assert result.code == 0, result.err
    assert time.monotonic() - started < 30  # pushed by the watch, not a slow poll
    lines = result.out.splitlines()
    assert lines[0].split()[:5] == ["STEP", "PHASE", "REWARD", "r:arith", "r:code"]
    steps = [line.split()[:5] for line in lines[1:] if line.split()[:1] != ["trainingrun"]]
    assert ["1/3", "Running", "0.100", "0.200", "0.050"] in steps
    assert ["2/3", "Running", "0.200", "0.400", "0.100"] in steps
    assert ["3/3", "Running", "0.300", "0.600", "0.150"] in steps
    assert steps[-1][:2] == ["3/3", "Succeeded"]
    assert "trainingrun demo Succeeded at step 3/3" in result.out
    assert "arith=0.75" in result.out  # eval accuracy reported at step 3


def test_watch_exits_1_on_failure_with_the_reason(
    kcli: CliRunner, kube: Any, watch_started: threading.Event
) -> None:
    kube.create_run("doomed")
    writer = report_steps_in_background(kube, "doomed", "Failed", watch_started)
    result = kcli("watch", "tr", "doomed", "--timeout", "60")
    writer.join(timeout=10)
    assert result.code == 1
    assert "BackoffLimitExceeded: trainer failed 4 times" in result.err
    assert "posttrain logs tr doomed" in result.err


def test_watch_times_out_with_exit_1(kcli: CliRunner, kube: Any) -> None:
    kube.create_run("idle")
    started = time.monotonic()
    result = kcli("watch", "tr", "idle", "--timeout", "2")
    assert result.code == 1
    assert "timed out after 2s" in result.err and "still Pending" in result.err
    assert time.monotonic() - started < 10


def test_watch_of_a_finished_run_returns_at_once(kcli: CliRunner, kube: Any) -> None:
    kube.create_run("done")
    kube.report_progress("done", phase="Succeeded", step=3, max_steps=3, reward_mean=0.5)
    result = kcli("watch", "tr", "done", "--timeout", "30")
    assert result.code == 0 and "Succeeded at step 3/3" in result.out


def test_watch_and_logs_reject_other_kinds(kcli: CliRunner, kube: Any) -> None:
    assert kcli("watch", "rp", "x").code == 2
    assert kcli("logs", "st", "x").code == 2
    assert kcli("watch", "tr", "x", "--timeout", "0").code == 2


def test_logs_without_a_pod_says_why(kcli: CliRunner, kube: Any) -> None:
    kube.create_run("waiting")
    result = kcli("logs", "tr", "waiting")
    assert result.code == 1
    assert "no trainer pod yet: the run is Pending; see posttrain describe tr waiting" in result.err
    missing = kcli("logs", "tr", "ghost")
    assert missing.code == 1 and "not found" in missing.err


def test_logs_after_the_run_ended_say_where_the_log_went(
    kcli: CliRunner, kube: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kubeconfig: Path
) -> None:
    """A finished run's trainer pods are gone: not "no trainer pod yet". On the cluster of
    `posttrain dev up`, the log the dev node agent kept is printed, with its path."""
    kube.create_run("done")
    kube.report_progress("done", phase="Succeeded", step=3, max_steps=3, reward_mean=0.3)
    monkeypatch.setenv("POSTTRAIN_DEV_DIR", str(tmp_path / "no-dev-env"))
    gone = kcli("logs", "tr", "done")
    assert gone.code == 1 and "is Succeeded and its trainer pods are gone" in gone.err, gone.err

    # The same cluster recorded as the dev environment, with the agent's kept pod logs.
    dev = tmp_path / "dev"
    kept = dev / "env" / "nodeagent" / f"{kube.namespace}_done-g1-0.log"
    kept.parent.mkdir(parents=True)
    (kept.parent / f"{kube.namespace}_done-g0-0.log").write_text("older gang\n")
    kept.write_text("step 1\nstep 2\nrun finished: 3 steps\n")
    (dev / "state.json").write_text(
        json.dumps(
            {
                "workdir": str(dev / "env"),
                "kubeconfig": str(kubeconfig),
                "apiserver": "",
                "minio_endpoint": "",
                "minio_access_key": "",
                "minio_secret_key": "",
                "pids": [],
            }
        )
    )
    monkeypatch.setenv("POSTTRAIN_DEV_DIR", str(dev))
    shown = kcli("logs", "tr", "done", "--tail", "1")
    assert shown.code == 0, shown.err
    assert shown.out == "run finished: 3 steps\n"
    assert str(kept) in shown.err and "is gone (the run is Succeeded)" in shown.err


def test_logs_of_an_unscheduled_pod_says_it_has_no_logs_yet(kcli: CliRunner, kube: Any) -> None:
    from kubernetes import client

    kube.create_run("queued")
    kube.core.create_namespaced_pod(
        kube.namespace,
        client.V1Pod(
            metadata=client.V1ObjectMeta(
                name="queued-g1-0",
                labels={
                    "posttrain.io/run": "queued",
                    "posttrain.io/component": "trainer",
                    "posttrain.io/rank": "0",
                    "posttrain.io/gang": "1",
                },
            ),
            spec=client.V1PodSpec(containers=[client.V1Container(name="trainer", image="busybox")]),
        ),
    )  # no kubelet in the test cluster: it stays Pending, unscheduled
    result = kcli("logs", "tr", "queued")
    assert result.code == 1
    assert "trainer pod queued-g1-0 has no logs yet: Pending (not scheduled)" in result.err


def test_logs_stream_through_the_apiserver_from_the_trainer_pod(
    kcli: CliRunner, kube: Any, fake_kubelet_node: Any
) -> None:
    """Rank 0 of the newest gang is read, through pods/log, and -f streams to the end."""
    from kubernetes import client

    node, kubelet = fake_kubelet_node
    kube.create_run("talky")
    for gang, rank in (("1", "0"), ("2", "1"), ("2", "0")):
        pod_name = f"talky-g{gang}-{rank}"
        kube.core.create_namespaced_pod(
            kube.namespace,
            client.V1Pod(
                metadata=client.V1ObjectMeta(
                    name=pod_name,
                    labels={
                        "posttrain.io/run": "talky",
                        "posttrain.io/component": "trainer",
                        "posttrain.io/rank": rank,
                        "posttrain.io/gang": gang,
                    },
                ),
                spec=client.V1PodSpec(
                    node_name=node,
                    containers=[client.V1Container(name="trainer", image="posttrain")],
                ),
            ),
        )
        kube.core.patch_namespaced_pod_status(
            pod_name,
            kube.namespace,
            {
                "status": {
                    "phase": "Running",
                    "containerStatuses": [
                        {
                            "name": "trainer",
                            "image": "posttrain",
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                        }
                    ],
                }
            },
        )
        kubelet.logs[(kube.namespace, pod_name, "trainer")] = [
            f"{pod_name} step {i}" for i in range(1, 4)
        ]

    printed = kcli("logs", "tr", "talky")
    assert printed.code == 0, printed.err
    assert printed.out.splitlines() == [f"talky-g2-0 step {i}" for i in range(1, 4)]
    assert "# pod talky-g2-0 (Running), container trainer" in printed.err

    followed = kcli("logs", "tr", "talky", "-f", "--tail", "2")
    assert followed.code == 0, followed.err
    assert followed.out.splitlines() == ["talky-g2-0 step 2", "talky-g2-0 step 3"]
    assert any("follow=true" in r and "tailLines=2" in r for r in kubelet.requests)

    wrong = kcli("logs", "tr", "talky", "-c", "sidecar")
    assert wrong.code == 2 and "has containers ['trainer']" in wrong.err
