"""spec.sandbox in a cluster, end to end: operator + node agent + MinIO + a cpu pool.

The code domain (unit_tests verifier) is verified in ``runner`` mode (the operator's own
runner Deployment) and in ``task`` mode (one SandboxTask pod per execution); every stored
trajectory's reward equals what the local bubblewrap executor gives the same completion. In
runner mode the run's outputs (eval, audit, metrics, report) are in MinIO after its pods are
gone, where ``posttrain report s3://...`` renders them. A runnerUrl that never answers fails
the run with the SandboxAvailable condition naming it and no trained step; a runner that goes
down after step 1 and comes back makes the condition False, then True, and the run finishes
with every sample scored as the local executor scores it (no zero for a failed execution).

Kept small (one or two steps, one or two prompts x two samples): these are CPU-heavy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import free_port
from posttrain.sandboxes.executor import ExecRequest, ExecResult, Executor, SandboxError
from posttrain.storage.store import S3Store
from posttrain.storage.trajectories import read_trajectories

from .conftest import wait_logged
from .test_trainingrun_e2e import Cluster, running_operator

log = logging.getLogger(__name__)

# Each test trains a real model on two shared cores: the waits below are deadlines on
# conditions, generous enough for a machine under heavy load; pytest's own limit is above
# the sum of them.
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.minio,
    pytest.mark.slow,
    pytest.mark.timeout(7200),
]

CODE_DOMAIN = {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}}


@contextlib.contextmanager
def runner_on(port: int, executor: Any = None) -> Iterator[str]:
    """A real runner (`posttrain sandbox serve`'s app) on 127.0.0.1:``port`` in a thread,
    serving with ``executor`` (default: a fresh bubblewrap Executor)."""
    import uvicorn

    from posttrain.sandboxes.runner import create_app

    if executor is None:
        executor = Executor()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(executor, concurrency=2, max_queue=16),
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            loop="asyncio",
            http="h11",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "runner did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        executor.close()


@pytest.fixture
def cluster(
    crds_installed: None,
    kube_api: Any,
    kubeconfig: Path,
    minio_server: MinioServer,
    agent: NodeAgent,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Cluster]:
    """As test_trainingrun_e2e's, plus sandbox artifact storage (task mode reads the
    program's output from the log its pod stores there). The operator signs the upload URLs
    with its own S3 client, which reads POSTTRAIN_S3_ENDPOINT and the keys from its
    environment (the chart's operator ConfigMap sets them): the in-process operator gets the
    session MinIO's. Without them every SandboxTask ran without a stored log."""
    for key, value in minio_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"e2e-{namespace}"
    minio = minio_server.client()
    if not minio.bucket_exists(bucket):
        minio.make_bucket(bucket)
    with running_operator(
        kube_api,
        kubeconfig,
        minio_server,
        namespace,
        sandbox_artifacts_uri=f"s3://{bucket}/sandboxes",
        max_workers=4,
    ) as c:
        c.create(
            "rolloutpools",
            {
                "kind": "RolloutPool",
                "metadata": {"name": "pool"},
                "spec": {
                    "model": "smollm2-135m-instruct",
                    "replicas": 1,
                    "engine": "cpu",
                    "port": free_port(),
                    "resources": {"cpu": "1", "memory": "2Gi"},
                },
            },
        )
        wait_logged(
            lambda: c.status("rolloutpools", "pool").get("phase") == "Ready", 1800, "pool Ready"
        )
        yield c


def code_run(
    name: str,
    sandbox: dict[str, Any],
    max_steps: int = 1,
    backoff_limit: int = 0,
    prompts: int = 2,
    eval_items: int = 2,
) -> dict[str, Any]:
    """A code-domain run: ``prompts`` x 2 samples per step, 48 new tokens, inline evaluation
    of ``eval_items`` held-out tasks at step 0 and at the end (each is one more execution)."""
    return {
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": "smollm2-135m-instruct",
            "algorithm": {
                "groupSize": 2,
                "promptsPerStep": prompts,
                "maxSteps": max_steps,
                "maxNewTokens": 48,
                "microBatchSize": 4,
                "dynamicSampling": False,
            },
            "domains": [CODE_DOMAIN],
            "rollout": {"pool": "pool", "timeoutSeconds": 900},
            "sandbox": sandbox,
            "resources": {"cpu": "1", "memory": "4Gi", "gpusPerNode": 0},
            "checkpoint": {"everySteps": 1, "keepLast": 1},
            "evaluation": {"everySteps": 100, "maxItemsPerDomain": eval_items},
            "backoffLimit": backoff_limit,
        },
    }


def run_store(minio_server: MinioServer, c: Cluster, run: str) -> S3Store:
    return S3Store(
        minio_server.endpoint,
        c.bucket,
        c.run_prefix(run),
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
    )


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def assert_rewards_match_the_local_executor(records: list[dict[str, Any]]) -> None:
    """Re-verify every stored completion with the local bubblewrap executor."""
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.trainer.data.rundata import domain_tasks
    from posttrain.trainer.rewards.verification import build_verification

    train, heldout = domain_tasks("code", "builtin:code", None)
    tasks = {t.task_id: t for t in train + heldout}
    local = build_verification(SandboxPolicy(mode="local")).verify
    assert records
    for record in records:
        task = tasks[record["task_id"]]
        expected = local("unit_tests", record["completion"], task.to_dict(), {})
        assert record["reward"] == pytest.approx(expected.reward), (
            f"completion {record['completion']!r}\nin the cluster: {record.get('verifier')}"
            f"\nlocal executor: {expected.details}"
        )


# Generous: these runs share two cores with whatever else runs; a slow run is not a failure.
RUN_TIMEOUT_S = 3600


def wait_finished(c: Cluster, name: str) -> dict[str, Any]:
    return wait_logged(
        lambda: (s := c.status("trainingruns", name)).get("phase") in ("Succeeded", "Failed") and s,
        RUN_TIMEOUT_S,
        f"TrainingRun {name} finished",
    )


def while_running(
    c: Cluster, name: str, agent: NodeAgent, pod: str, predicate: Callable[[], Any]
) -> Callable[[], Any]:
    """``predicate``, failing at once (with the trainer's log) if the run ended meanwhile: a
    wait for something mid-run must not sit out its whole deadline after a failure."""

    def check() -> Any:
        got = predicate()
        if got:
            return got
        phase = c.status("trainingruns", name).get("phase")
        if phase in ("Succeeded", "Failed"):
            log_file = agent.log_path(c.namespace, pod)
            tail = log_file.read_text()[-3000:] if log_file.exists() else "(no trainer log)"
            raise AssertionError(f"TrainingRun {name} ended ({phase}) while waiting\n{tail}")
        return got

    return check


def finished(c: Cluster, name: str, agent: NodeAgent, pod: str) -> dict[str, Any]:
    final = wait_finished(c, name)
    log_file = agent.log_path(c.namespace, pod)
    assert final["phase"] == "Succeeded", (
        log_file.read_text()[-3000:] if log_file.exists() else final
    )
    return final


def test_runner_mode_uses_the_operators_runner_and_outputs_outlive_the_pods(
    cluster: Cluster,
    minio_server: MinioServer,
    agent: NodeAgent,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster.create("trainingruns", code_run("rn", {"mode": "runner", "maxConcurrency": 2}))
    final = finished(cluster, "rn", agent, "rn-g0-0")
    url = f"http://rn-sandbox-runner.{cluster.namespace}.svc:8090"
    assert final["sandbox"]["mode"] == "runner" and final["sandbox"]["endpoint"] == url
    available = condition(final, "SandboxAvailable")
    assert available is not None and available["status"] == "True"
    # The operator's runner served the verifications (its pod ran), and went with the run.
    assert agent.log_path(cluster.namespace, "rn-sandbox-runner-0").exists()
    wait_logged(
        lambda: (
            cluster.status("trainingruns", "rn")
            and not any(
                p.metadata.name.startswith("rn-sandbox-runner")
                for p in cluster.core.list_namespaced_pod(cluster.namespace).items
            )
        ),
        1800,
        "runner pods deleted after the run",
    )
    store = run_store(minio_server, cluster, "rn")
    assert_rewards_match_the_local_executor(list(read_trajectories(store, "trajectories")))

    # Every pod of the run gone: the outputs are in MinIO, uploaded while it ran.
    for pod in cluster.core.list_namespaced_pod(cluster.namespace).items:
        if pod.metadata.name.startswith("rn-"):
            cluster.core.delete_namespaced_pod(
                pod.metadata.name, cluster.namespace, grace_period_seconds=0
            )
    reports = set(store.list("reports/"))
    for key in (
        "reports/metrics.jsonl",
        "reports/report.md",
        "reports/audit/spot_checks.jsonl",
        "reports/eval/history.jsonl",
    ):
        assert key in reports, sorted(reports)
    assert any(k.startswith("reports/eval/heldout_step") for k in reports), sorted(reports)
    assert final["reportsUri"] == f"s3://{cluster.bucket}/{cluster.run_prefix('rn')}/reports"

    from posttrain.ctl.report import report_command

    for key, value in minio_server.env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "rn.html"
    report_command(argparse.Namespace(run_dir=final["reportsUri"], out=out, manifest=None))
    assert "<img" in out.read_text() and "code" in out.read_text()


def test_a_runner_url_that_never_answers_fails_the_run_with_a_condition_naming_it(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cluster.create(
        "trainingruns",
        code_run("dead", {"mode": "runner", "runnerUrl": url, "unavailableTimeoutSeconds": 20}),
    )
    final = wait_finished(cluster, "dead")
    assert final["phase"] == "Failed"
    down = condition(final, "SandboxAvailable")
    assert down is not None and down["status"] == "False" and url in down["message"]
    log = agent.log_path(cluster.namespace, "dead-g0-0").read_text()
    assert "VerificationUnavailable" in log and url in log
    # Nothing was trained on: no step reported, no trajectory stored.
    assert not final.get("step")
    assert list(read_trajectories(run_store(minio_server, cluster, "dead"), "trajectories")) == []


def test_task_mode_verifies_with_sandbox_tasks_and_scores_like_the_local_executor(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    cluster.create(
        "trainingruns",
        code_run("tk", {"mode": "task", "maxConcurrency": 4}, prompts=1, eval_items=1),
    )
    final = finished(cluster, "tk", agent, "tk-g0-0")
    assert final["sandbox"]["mode"] == "task"
    available = condition(final, "SandboxAvailable")
    assert available is not None and available["status"] == "True", available
    records = list(read_trajectories(run_store(minio_server, cluster, "tk"), "trajectories"))
    assert len(records) == 2  # one prompt x two samples
    assert_rewards_match_the_local_executor(records)
    # Every execution ran as a SandboxTask pod the agent ran: one per stored sample at least
    # (and one per evaluated item), each named after the run.
    pods = list(agent.workdir.glob(f"{cluster.namespace}_tk-verify-*.log"))
    assert len(pods) >= len(records), [p.name for p in pods]
    # The trainer deletes each task once it read its result (TTL is only the fallback).
    wait_logged(
        lambda: (
            not cluster.custom.list_namespaced_custom_object(
                "posttrain.io", "v1alpha1", cluster.namespace, "sandboxtasks"
            )["items"]
        ),
        1800,
        "the run's SandboxTasks deleted",
    )


class OutageAfterStep1(Executor):
    """A runner's executor that serves until the run has finished step 1, then fails every
    execution (the runner answers 500, a sandbox failure) and tells the test, which then
    stops the runner altogether (connection refused).

    Why keyed on step 1's trajectories in MinIO: the trainer stores them before it
    checkpoints step 1, so the first execution that sees them belongs to step 2 (or to a later
    evaluation) whatever the machine's load. Racing a stop of the runner against the
    trainer's progress would sometimes let step 2 be verified before the outage."""

    def __init__(self, step1_stored: Callable[[], bool]) -> None:
        super().__init__()
        self.step1_stored = step1_stored
        self.down = threading.Event()
        self.served = 0

    async def run_async(self, request: ExecRequest) -> ExecResult:
        if not self.down.is_set() and await asyncio.to_thread(self.step1_stored):
            log.info("step 1 is stored after %d execution(s): the runner goes down", self.served)
            self.down.set()
        if self.down.is_set():
            raise SandboxError("the test's runner is down (a sandbox outage mid-run)")
        result = await super().run_async(request)
        self.served += 1
        return result


def test_a_runner_outage_mid_run_is_a_condition_and_a_wait_not_zero_rewards(
    cluster: Cluster, minio_server: MinioServer, agent: NodeAgent
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"  # the agent's pods share the host network

    def step1_stored() -> bool:  # asked only once the trainer runs, after `store` is set
        return any(r["step"] >= 1 for r in read_trajectories(store, "trajectories"))

    executor = OutageAfterStep1(step1_stored)
    with runner_on(port, executor):
        cluster.create(
            "trainingruns",
            code_run(
                "ou",
                # The outage lasts as long as this test takes to see it (minutes at most):
                # the run must wait it out, not fail.
                {"mode": "runner", "runnerUrl": url, "unavailableTimeoutSeconds": RUN_TIMEOUT_S},
                max_steps=2,
                prompts=1,
                eval_items=1,
            ),
        )
        store = run_store(minio_server, cluster, "ou")  # its uid exists from here on
        wait_logged(
            while_running(cluster, "ou", agent, "ou-g0-0", executor.down.is_set),
            RUN_TIMEOUT_S,
            "an execution after step 1 (the outage)",
        )
    assert executor.served >= 2  # step 1's two samples (and the base evaluation) were served
    down = wait_logged(
        while_running(
            cluster,
            "ou",
            agent,
            "ou-g0-0",
            lambda: (
                (c := condition(cluster.status("trainingruns", "ou"), "SandboxAvailable"))
                and c["status"] == "False"
                and c
            ),
        ),
        RUN_TIMEOUT_S,
        "SandboxAvailable=False",
    )
    assert down["reason"] == "SandboxUnavailable" and url in down["message"], down
    assert cluster.status("trainingruns", "ou").get("phase") == "Running"
    with runner_on(port):  # the runner is back
        final = finished(cluster, "ou", agent, "ou-g0-0")
    available = condition(final, "SandboxAvailable")
    assert available is not None and available["status"] == "True", available
    assert final["sandbox"]["infraFailures"] >= 1 and final["restarts"] == 0
    records = list(read_trajectories(store, "trajectories"))
    assert sorted(r["step"] for r in records) == [1, 1, 2, 2]
    assert_rewards_match_the_local_executor(records)
