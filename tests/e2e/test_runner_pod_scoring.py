"""The operator's sandbox-runner pod, run by the node agent, scores completions exactly as the
local executor does (no model, no trainer: the runner Deployment the operator builds, and
unit-test verifications sent to it concurrently).

Why it exists: the runner-mode end-to-end run once scored every completion 0.0. Bubblewrap
inside the runner pod could not mount its /proc (the pod's /proc was masked, and the pod
asks for ``procMount: Unmasked``), and the executor reported that setup failure as the
program's exit (127) instead of a SandboxError, so the verifier scored it. This test takes
a minute or two; the whole run takes far longer (test_sandbox_modes_e2e.py).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from posttrain.devenv.nodeagent import NodeAgent

from .conftest import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

COMPLETIONS = (
    "```python\ndef is_multiple(x):\n    return x % 21 == 0\n```",
    "```python\ndef is_multiple(x):\n    return x % 7 == 0\n```",
    "```python\ndef is_multiple(x):\n    return",  # cut off at maxNewTokens
    "Sure! Here is the function you asked for: it checks",
    "```python\nimport os\ndef is_multiple(x):\n    os.fork()\n    return False\n```",
)


def test_the_operators_runner_pod_scores_like_the_local_executor(
    kube_api: Any, namespace: str, agent: NodeAgent
) -> None:
    from kubernetes import client

    from posttrain.api import TrainingRun
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.trainingrun.sandbox_runner import (
        SANDBOX_RUNNER_PORT,
        build_runner_deployment,
    )
    from posttrain.sandboxes.client import SandboxClient
    from posttrain.trainer.data.rundata import domain_tasks
    from posttrain.trainer.rewards.verification import build_verification

    run = TrainingRun.model_validate(
        {
            "metadata": {"name": "rp", "namespace": namespace, "uid": "u-1"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "domains": [
                    {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}}
                ],
                "sandbox": {"mode": "runner", "maxConcurrency": 2},
            },
        }
    )
    deployment = build_runner_deployment(run, OperatorConfig())
    deployment["metadata"].pop("ownerReferences", None)
    client.AppsV1Api(kube_api).create_namespaced_deployment(namespace, deployment)
    core = client.CoreV1Api(kube_api)

    def ready_ip() -> str | None:
        pods = core.list_namespaced_pod(namespace).items
        for pod in pods:
            conditions = pod.status.conditions or []
            if any(c.type == "Ready" and c.status == "True" for c in conditions):
                return str(pod.status.pod_ip)
        return None

    ip = wait_for(ready_ip, 900, "runner pod Ready")  # generous: a loaded machine
    remote = SandboxClient(f"http://{ip}:{SANDBOX_RUNNER_PORT}")
    local = build_verification(SandboxPolicy(mode="local")).verify
    from posttrain.sandboxes.verifiers import verify

    train, _ = domain_tasks("code", "builtin:code", None)
    task = train[0].to_dict()
    jobs = [c for c in COMPLETIONS for _ in range(3)]

    def both(completion: str) -> tuple[Any, Any]:
        return (
            verify("unit_tests", completion, task, {}, executor=remote),
            local("unit_tests", completion, task, {}),
        )

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(both, jobs))
    for completion, (got, want) in zip(jobs, results, strict=True):
        assert got.reward == want.reward, (
            f"{completion!r}\nrunner: {json.dumps(got.details)[:3000]}\n"
            f"local: {json.dumps(want.details)[:1500]}\n"
            f"runner log: {agent.log_path(namespace, 'rp-sandbox-runner-0').read_text()[-2000:]}"
        )


@pytest.mark.minio
def test_sandbox_task_pods_score_like_the_local_executor(
    kube_api: Any,
    kubeconfig: Any,
    crds_installed: None,
    namespace: str,
    agent: NodeAgent,
    minio_server: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sandbox.mode task without a model: the operator turns each SandboxTask into a pod the
    agent runs, whose entrypoint stores the harness's output in MinIO. (The harness signals
    every process it may when it is done: in a pod of its own pid namespace the entrypoint is
    pid 1 and survives it, so the log is stored.)"""
    from kubernetes import client

    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread
    from posttrain.sandboxes.tasks import SandboxTaskRunner
    from posttrain.sandboxes.verifiers import verify
    from posttrain.trainer.data.rundata import domain_tasks
    from posttrain.trainer.rewards.verification import build_verification

    env = minio_server.env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    bucket = f"tasks-{namespace}"
    minio = minio_server.client()
    if not minio.bucket_exists(bucket):
        minio.make_bucket(bucket)
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint=env["POSTTRAIN_S3_ENDPOINT"],
        s3_bucket=bucket,
        sandbox_artifacts_uri=f"s3://{bucket}/sandboxes",
        max_workers=4,
    )
    operator = OperatorThread(config).start()
    try:
        tasks_api = client.CustomObjectsApi(kube_api)
        runner = SandboxTaskRunner(namespace, api=tasks_api, start_timeout_s=900)
        local = build_verification(SandboxPolicy(mode="local")).verify
        train, _ = domain_tasks("code", "builtin:code", None)
        task = train[0].to_dict()
        for completion in COMPLETIONS[:3]:
            got = verify("unit_tests", completion, task, {}, executor=runner)
            want = local("unit_tests", completion, task, {})
            assert got.reward == want.reward, (
                f"{completion!r}\ntask pod: {json.dumps(got.details)[:3000]}\n"
                f"local: {json.dumps(want.details)[:1500]}"
            )
    finally:
        operator.stop()
