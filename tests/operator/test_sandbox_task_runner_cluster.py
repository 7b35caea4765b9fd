"""``sandbox.mode: task`` against the real apiserver: the trainer's SandboxTaskRunner creates a
SandboxTask per execution and tells the program's outcome from the sandbox's. No operator or
kubelet runs here: the test plays them by writing the task's status (the end-to-end path with
both is tests/e2e/test_sandbox_modes_e2e.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from posttrain.operator.kube import KubeError
from posttrain.sandboxes.client import SandboxUnavailable
from posttrain.sandboxes.executor import ExecRequest
from posttrain.sandboxes.tasks import SandboxConfigError, SandboxTaskRunner

from .conftest import cr_path, wait_for

pytestmark = pytest.mark.cluster

REQUEST = ExecRequest(
    ["python3", "-I", "harness.py"],
    files={"harness.py": "print('hi')"},
    timeout_s=4.2,
    memory_mb=300,
)


def runner(
    kube_api: Any, namespace: str, logs: dict[str, str] | None = None, **kwargs: Any
) -> SandboxTaskRunner:
    from kubernetes import client

    return SandboxTaskRunner(
        namespace,
        api=client.CustomObjectsApi(kube_api),
        read_log=lambda uri: (logs or {})[uri],
        poll_s=0.05,
        **kwargs,
    )


@pytest.fixture
def served(crds_installed: None, kube: Any, namespace: str) -> None:
    """SandboxTasks can be listed (a freshly installed CRD answers 429 while its storage
    initialises)."""

    def listable() -> bool:
        try:
            tasks(kube, namespace)
        except KubeError as exc:
            if exc.status != 429:
                raise
            return False
        return True

    wait_for(listable, what="sandboxtasks served")


def tasks(kube: Any, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kube.request("GET", cr_path("sandboxtasks", namespace))[1][
        "items"
    ]
    return items


def play_operator(kube: Any, namespace: str, status: dict[str, Any]) -> dict[str, Any]:
    """Wait for the runner's task, check it, then write ``status`` as the operator would."""
    (task,) = wait_for(lambda: tasks(kube, namespace), what="the SandboxTask")
    name = task["metadata"]["name"]
    kube.patch(cr_path("sandboxtasks", namespace, name), {"status": status}, "status")
    return task


def test_a_finished_task_is_an_exec_result_read_from_its_stored_log(
    served: None, kube: Any, kube_api: Any, namespace: str
) -> None:
    uri = "s3://b/sandboxes/x/logs.txt"
    r = runner(
        kube_api,
        namespace,
        logs={uri: "some output\n__RESULT__ [1]\n"},
        runtime_class_name="gvisor",
        cpu="500m",
    )
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(r.run, REQUEST)
        task = play_operator(
            kube,
            namespace,
            {
                "phase": "Failed",
                "reason": "Error",
                "exitCode": 3,
                "durationMs": 12.5,
                "logsUri": uri,
            },
        )
        result = pending.result(timeout=60)
    assert (result.status, result.exit_code, result.duration_ms) == ("error", 3, 12.5)
    assert "__RESULT__ [1]" in result.stdout
    spec = task["spec"]
    assert spec["command"] == REQUEST.command and spec["files"] == REQUEST.files
    assert spec["timeoutSeconds"] == 5
    assert (spec["resources"]["cpu"], spec["resources"]["memory"]) == ("500m", "300Mi")
    assert (spec["network"], spec["runtimeClassName"]) == ("none", "gvisor")
    # Read once, then deleted: nothing piles up in etcd.
    wait_for(lambda: tasks(kube, namespace) == [], what="the task deleted")


def test_task_mode_gives_each_task_pod_the_runs_task_cpu(
    served: None,
    kube: Any,
    namespace: str,
    kubeconfig: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """spec.sandbox.taskCpu reaches every SandboxTask the trainer creates (its pod's request
    and limit): with the fixed 1 CPU of before, task pods never scheduled on a 2-CPU node
    beside a 1-CPU trainer and a CPU pool (tests/real_cluster/test_chart.py runs that)."""
    from kubernetes import client, config

    from posttrain.api.env import TrainerEnv
    from posttrain.api.trainingrun import SandboxPolicy
    from posttrain.trainer.rewards.verification import build_verification

    # The trainer's own path to the apiserver: kubeconfig, as outside a pod (the library
    # reads $KUBECONFIG once, at import). The default configuration it sets is put back.
    monkeypatch.setattr(config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.setattr(client.Configuration, "_default", client.Configuration._default)
    policy = SandboxPolicy.model_validate({"mode": "task", "taskCpu": "250m"})
    verification = build_verification(
        policy, contract=TrainerEnv(run_namespace=namespace, run_name="r")
    )
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(verification.executor.run, REQUEST)
        task = play_operator(kube, namespace, {"phase": "Failed", "reason": "SandboxFailed"})
        with pytest.raises(SandboxUnavailable):
            pending.result(timeout=60)
    resources = task["spec"]["resources"]
    assert (resources["cpu"], resources["memory"]) == ("250m", "300Mi"), task["spec"]
    assert task["metadata"]["name"].startswith("r-verify-"), task["metadata"]


def test_the_sandbox_failing_is_unavailability_not_a_result(
    served: None, kube: Any, kube_api: Any, namespace: str
) -> None:
    r = runner(kube_api, namespace)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(r.run, REQUEST)
        play_operator(
            kube, namespace, {"phase": "Failed", "reason": "SandboxFailed", "attempts": 2}
        )
        with pytest.raises(SandboxUnavailable, match="failed on all 2 attempt"):
            pending.result(timeout=60)


def test_a_task_that_never_starts_is_unavailability_and_is_deleted(
    served: None, kube: Any, kube_api: Any, namespace: str
) -> None:
    r = runner(kube_api, namespace, start_timeout_s=1.0)
    with pytest.raises(SandboxUnavailable, match="did not start within 1 s"):
        r.run(REQUEST)
    assert tasks(kube, namespace) == []


def test_without_sandbox_artifact_storage_task_mode_says_what_to_configure(
    served: None, kube: Any, kube_api: Any, namespace: str
) -> None:
    r = runner(kube_api, namespace)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(r.run, REQUEST)
        play_operator(kube, namespace, {"phase": "Succeeded", "reason": "Completed", "exitCode": 0})
        with pytest.raises(SandboxConfigError, match="artifactsUri"):
            pending.result(timeout=60)
