"""200 SandboxTasks created at once all reach a terminal phase (the test plays the kubelet)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import cr_path, create_cr, list_pods, set_pod_terminated, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TASKS = 200


def test_200_tasks_all_finish(operator: OperatorThread, kube: KubeClient, namespace: str) -> None:
    stop = threading.Event()
    completed: set[str] = set()

    def kubelet() -> None:
        """Complete each new sandbox pod: even tasks succeed with a JSON result, odd exit 1."""
        while not stop.is_set():
            for pod in list_pods(kube, namespace, "posttrain.io/component=sandbox"):
                name = pod["metadata"]["name"]
                if name in completed:
                    continue
                index = int(name.split("-")[1])
                if index % 2 == 0:
                    result = {
                        "exit_code": 0,
                        "reward": 1.0,
                        "duration_ms": 5,
                        "reason": "Completed",
                    }
                    set_pod_terminated(kube, namespace, name, 0, json.dumps(result))
                else:
                    set_pod_terminated(kube, namespace, name, 1, "boom")
                completed.add(name)
            time.sleep(0.2)

    thread = threading.Thread(target=kubelet, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda i: create_cr(
                        kube,
                        "sandboxtasks",
                        namespace,
                        {
                            "kind": "SandboxTask",
                            "metadata": {"name": f"task-{i}"},
                            "spec": {"command": ["true"]},
                        },
                    ),
                    range(TASKS),
                )
            )

        def phases() -> dict[str, int]:
            items = kube.request("GET", cr_path("sandboxtasks", namespace))[1]["items"]
            counts: dict[str, int] = {}
            for item in items:
                phase = (item.get("status") or {}).get("phase", "None")
                counts[phase] = counts.get(phase, 0) + 1
            return counts

        counts = wait_for(
            lambda: (c := phases()).get("Succeeded", 0) + c.get("Failed", 0) == TASKS and c,
            timeout_s=180,
            what=f"{TASKS} terminal tasks",
        )
    finally:
        stop.set()
        thread.join(10)
    elapsed = time.monotonic() - started
    assert counts == {"Succeeded": TASKS // 2, "Failed": TASKS // 2}
    # Exactly one pod per task: no duplicates, no spurious retries for program failures.
    assert len(list_pods(kube, namespace, "posttrain.io/component=sandbox")) == TASKS
    print(f"{TASKS} tasks terminal in {elapsed:.1f} s")
