"""spec.sandbox in a cluster, end to end: operator + node agent + MinIO + a cpu pool.

The code domain (unit_tests verifier) is verified in ``runner`` mode (the operator's own
runner Deployment); every stored trajectory's reward equals what the local bubblewrap
executor gives the same completion, and the run's outputs (eval, audit, metrics, report) are
in MinIO after its pods are gone, where ``posttrain report s3://...`` renders them. A
runnerUrl that never answers fails the run with the SandboxAvailable condition naming it and
no trained step. (``task`` mode and a runner outage mid-run are in
sandbox_modes_e2e_pending.py.txt beside this file, not yet seen passing end to end;
``runner_on`` below serves them.)

Kept small (one or two steps, two prompts x two samples): these are CPU-heavy.
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import free_port
from posttrain.storage.store import S3Store
from posttrain.storage.trajectories import read_trajectories

from .conftest import wait_for
from .test_trainingrun_e2e import Cluster, running_operator

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
def runner_on(port: int) -> Iterator[str]:
    """A real runner (`posttrain sandbox serve`'s app) on 127.0.0.1:``port`` in a thread."""
    import uvicorn

    from posttrain.sandboxes.executor import Executor
    from posttrain.sandboxes.runner import create_app

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
) -> Iterator[Cluster]:
    """As test_trainingrun_e2e's, plus sandbox artifact storage (task mode reads the
    program's output from the log its pod stores there)."""
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
        wait_for(lambda: c.status("rolloutpools", "pool").get("phase") == "Ready", 900, "pool")
        yield c


def code_run(
    name: str, sandbox: dict[str, Any], max_steps: int = 1, backoff_limit: int = 0
) -> dict[str, Any]:
    return {
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": "smollm2-135m-instruct",
            "algorithm": {
                "groupSize": 2,
                "promptsPerStep": 2,
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
            "evaluation": {"everySteps": 100, "maxItemsPerDomain": 2},
            "backoffLimit": backoff_limit,
        },
    }


def run_store(minio_server: MinioServer, c: Cluster, run: str) -> S3Store:
    return S3Store(
        minio_server.endpoint,
        c.bucket,
        f"runs/{c.namespace}/{run}",
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
    )


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), None)


def assert_rewards_match_the_local_executor(records: list[dict[str, Any]]) -> None:
    """Re-verify every stored completion with the local bubblewrap executor."""
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.trainer.rundata import domain_tasks
    from posttrain.trainer.verification import build_verification

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


def status_or_empty(c: Cluster, name: str) -> dict[str, Any]:
    """The run's status; {} while an overloaded apiserver answers 5xx (polled again)."""
    from kubernetes.client.exceptions import ApiException

    try:
        return c.status("trainingruns", name)
    except ApiException as exc:
        if exc.status is None or exc.status < 500:
            raise
        return {}


def wait_finished(c: Cluster, name: str) -> dict[str, Any]:
    return wait_for(
        lambda: (s := status_or_empty(c, name)).get("phase") in ("Succeeded", "Failed") and s,
        RUN_TIMEOUT_S,
        f"TrainingRun {name} finished",
    )


def finished(c: Cluster, name: str, agent: NodeAgent, pod: str) -> dict[str, Any]:
    final = wait_finished(c, name)
    log = agent.log_path(c.namespace, pod)
    assert final["phase"] == "Succeeded", log.read_text()[-3000:] if log.exists() else final
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
    wait_for(
        lambda: (
            cluster.status("trainingruns", "rn")
            and not any(
                p.metadata.name.startswith("rn-sandbox-runner")
                for p in cluster.core.list_namespaced_pod(cluster.namespace).items
            )
        ),
        600,
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
    assert final["reportsUri"] == f"s3://{cluster.bucket}/runs/{cluster.namespace}/rn/reports"

    from posttrain.ctl_report import report_command

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
