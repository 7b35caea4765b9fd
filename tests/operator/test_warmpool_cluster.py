"""SandboxWarmPool against the real apiserver with the operator in-process.

There is no kubelet: the tests play it by patching pod status (set_pod_running makes an idle
pod ready to be claimed; set_pod_terminated ends the claimed program).
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest

from posttrain.api import SandboxTask
from posttrain.api.labels import ANNOTATION_CLAIM, LABEL_WARM_POOL
from posttrain.devenv.controlplane import ControlPlane
from posttrain.operator.kube import KubeClient, KubeError, resource_path
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.warmpool.builders import build_claim_patch

from .conftest import create_cr, get_cr, list_pods, set_pod_running, set_pod_terminated, wait_for

pytestmark = pytest.mark.cluster

POOLS = "sandboxwarmpools"


@pytest.fixture(scope="module", autouse=True)
def warm_pool_crd(control_plane: ControlPlane, kube_api: Any, crds_installed: None) -> None:
    """crds_installed applies every CRD in crds/; wait until this one is served too."""
    control_plane.wait_for_crd(kube_api, f"{POOLS}.posttrain.io")


def pool_body(name: str, replicas: int, **spec: object) -> dict[str, object]:
    return {
        "kind": "SandboxWarmPool",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, **spec},
    }


def task_body(name: str, pool: str | None = "py", **spec: object) -> dict[str, object]:
    body: dict[str, Any] = {
        "command": ["python", "main.py"],
        "files": {"main.py": "print(7)"},
        **spec,
    }
    if pool:
        body["warmPoolRef"] = pool
    return {"kind": "SandboxTask", "metadata": {"name": name}, "spec": body}


def idle_pods(kube: KubeClient, namespace: str, pool: str) -> list[dict[str, Any]]:
    pods = list_pods(kube, namespace, f"{LABEL_WARM_POOL}={pool},!posttrain.io/task")
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pool_status(kube: KubeClient, namespace: str, pool: str) -> dict[str, Any]:
    return (get_cr(kube, POOLS, namespace, pool) or {}).get("status") or {}


def task_status(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    return (get_cr(kube, "sandboxtasks", namespace, name) or {}).get("status") or {}


def fill_ready(kube: KubeClient, namespace: str, pool: str, n: int) -> list[str]:
    """Wait for n idle pods, then start them all (the kubelet's part)."""
    pods = wait_for(
        lambda: (p := idle_pods(kube, namespace, pool)) and len(p) == n and p,
        what=f"{n} idle pods of {pool}",
    )
    names = [p["metadata"]["name"] for p in pods]
    for name in names:
        set_pod_running(kube, namespace, name)
    wait_for(
        lambda: pool_status(kube, namespace, pool).get("readyReplicas") == n,
        what=f"{pool} readyReplicas={n}",
    )
    return names


def events_of(kube: KubeClient, namespace: str, name: str) -> set[str]:
    items = kube.request(
        "GET",
        resource_path("v1", "events", namespace) + f"?fieldSelector=involvedObject.name={name}",
    )[1]["items"]
    return {e["reason"] for e in items}


def test_pool_fills_scales_and_reports_ready(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    pool = create_cr(kube, POOLS, namespace, pool_body("py", 3))
    pods = wait_for(
        lambda: (p := idle_pods(kube, namespace, "py")) and len(p) == 3 and p, what="3 idle pods"
    )
    pod = pods[0]
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("SandboxWarmPool", pool["metadata"]["uid"])
    spec = pod["spec"]
    # Restricted like a cold sandbox, and no deadline until a task claims it.
    assert "activeDeadlineSeconds" not in spec
    assert spec["automountServiceAccountToken"] is False
    assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["metadata"]["labels"]["posttrain.io/sandbox-network"] == "none"
    status = wait_for(
        lambda: (s := pool_status(kube, namespace, "py")).get("replicas") == 3 and s,
        what="status.replicas=3",
    )
    assert status["readyReplicas"] == 0
    assert status["selector"] == f"{LABEL_WARM_POOL}=py,!posttrain.io/task"

    fill_ready(kube, namespace, "py", 3)
    ready = {c["type"]: c for c in pool_status(kube, namespace, "py")["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "IdlePodsReady")

    # kubectl scale goes through the scale subresource.
    scale_path = resource_path("posttrain.io/v1alpha1", POOLS, namespace, "py") + "/scale"
    kube.patch(scale_path, {"spec": {"replicas": 5}})
    wait_for(lambda: len(idle_pods(kube, namespace, "py")) == 5, what="scale up to 5")
    kube.patch(scale_path, {"spec": {"replicas": 1}})
    remaining = wait_for(
        lambda: (p := idle_pods(kube, namespace, "py")) and len(p) == 1 and p,
        what="scale down to 1",
    )
    # Scale-down removes the not-ready (just created) pods before the ready ones.
    assert (remaining[0].get("status") or {}).get("phase") == "Running"
    assert kube.request("GET", scale_path)[1]["status"]["replicas"] == 1
    wait_for(
        lambda: {"WarmPodsCreated", "WarmPodsDeleted"} <= events_of(kube, namespace, "py"),
        what="pool events",
    )


def test_claims_are_exclusive_under_concurrency(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """20 tasks race for 10 ready pods: 10 claims, 10 cold pods, no pod claimed twice."""
    create_cr(kube, POOLS, namespace, pool_body("py", 10))
    ready_pods = set(fill_ready(kube, namespace, "py", 10))

    with ThreadPoolExecutor(20) as pool:
        list(
            pool.map(
                lambda i: create_cr(kube, "sandboxtasks", namespace, task_body(f"t{i}")), range(20)
            )
        )

    def placed() -> dict[str, dict[str, Any]] | None:
        pods = list_pods(kube, namespace, "posttrain.io/task")
        by_task: dict[str, list[dict[str, Any]]] = {}
        for p in pods:
            by_task.setdefault(p["metadata"]["labels"]["posttrain.io/task"], []).append(p)
        return (
            {t: ps[0] for t, ps in by_task.items()}
            if len(by_task) == 20 and all(len(ps) == 1 for ps in by_task.values())
            else None
        )

    pods = wait_for(placed, what="one pod for each of the 20 tasks")
    warm = {t: p for t, p in pods.items() if LABEL_WARM_POOL in p["metadata"]["labels"]}
    cold = {t: p for t, p in pods.items() if t not in warm}
    assert len(warm) == 10 and len(cold) == 10
    assert {p["metadata"]["name"] for p in warm.values()} == ready_pods  # each pod once
    assert all(p["metadata"]["name"] == f"{t}-1" for t, p in cold.items())
    for task, pod in warm.items():
        meta = pod["metadata"]
        assert meta["ownerReferences"][0]["kind"] == "SandboxTask"
        assert meta["ownerReferences"][0]["name"] == task
        claim = json.loads(meta["annotations"][ANNOTATION_CLAIM])
        assert claim["task"] == task and claim["files"] == {"main.py": "print(7)"}
        assert pod["spec"]["activeDeadlineSeconds"] >= 60  # pod age + timeoutSeconds
        status = wait_for(
            lambda t=task: (s := task_status(kube, namespace, t)).get("phase") == "Running" and s,
            what=f"{task} Running",
        )
        assert status["warmPool"] == "py" and status["podName"] == meta["name"]
    assert all("warmPool" not in task_status(kube, namespace, t) for t in cold)

    # The pool refills: 10 new idle pods, the 10 claimed ones counted apart.
    wait_for(lambda: len(idle_pods(kube, namespace, "py")) == 10, what="refill to 10")
    wait_for(lambda: pool_status(kube, namespace, "py").get("claimed") == 10, what="claimed=10")
    assert not ready_pods & {p["metadata"]["name"] for p in idle_pods(kube, namespace, "py")}


def test_claimed_task_runs_to_completion(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, POOLS, namespace, pool_body("py", 1))
    (pod_name,) = fill_ready(kube, namespace, "py", 1)
    create_cr(kube, "sandboxtasks", namespace, task_body("t", stdin="x"))
    status = wait_for(
        lambda: (s := task_status(kube, namespace, "t")).get("phase") == "Running" and s,
        what="claimed and Running",
    )
    assert status["podName"] == pod_name
    assert (
        json.loads(
            kube.get("v1", "Pod", namespace, pod_name)["metadata"]["annotations"][ANNOTATION_CLAIM]
        )["stdin"]
        == "x"
    )
    result = {"exit_code": 0, "reward": 0.5, "duration_ms": 9.0, "reason": "Completed"}
    set_pod_terminated(kube, namespace, pod_name, 0, json.dumps(result))
    final = wait_for(
        lambda: (s := task_status(kube, namespace, "t")).get("phase") == "Succeeded" and s,
        what="Succeeded",
    )
    assert (final["reward"], final["warmPool"], final["attempts"]) == (0.5, "py", 1)
    # The finished pod left the pool: it is not counted idle and not replaced twice.
    wait_for(lambda: len(idle_pods(kube, namespace, "py")) == 1, what="refilled")


def test_claim_precondition_refuses_a_second_claim(kube: KubeClient, namespace: str) -> None:
    """The apiserver itself enforces exclusivity: a claim built from a stale resourceVersion
    is refused with 409 once another claim changed the pod."""
    pod = kube.request(
        "POST",
        resource_path("v1", "pods", namespace),
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "idle", "labels": {LABEL_WARM_POOL: "py"}},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        },
    )[1]
    tasks = [
        SandboxTask.model_validate(
            {
                "metadata": {"name": n, "namespace": namespace, "uid": f"uid-{n}"},
                "spec": {"command": ["true"]},
            }
        )
        for n in ("a", "b")
    ]
    now = datetime.now(UTC)
    path = resource_path("v1", "pods", namespace, "idle")
    kube.patch(path, build_claim_patch(tasks[0], pod, now))
    with pytest.raises(KubeError) as refused:
        kube.patch(path, build_claim_patch(tasks[1], pod, now))
    assert refused.value.status == 409
    assert (
        kube.get("v1", "Pod", namespace, "idle")["metadata"]["labels"]["posttrain.io/task"] == "a"
    )


def test_missing_or_different_pool_falls_back_to_a_cold_pod(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, POOLS, namespace, pool_body("py", 1))
    fill_ready(kube, namespace, "py", 1)
    create_cr(kube, "sandboxtasks", namespace, task_body("nopool", pool="nosuch"))
    create_cr(kube, "sandboxtasks", namespace, task_body("bigger", resources={"cpu": "2"}))
    for name, reason in (("nopool", "WarmPoolNotFound"), ("bigger", "WarmPoolMismatch")):
        wait_for(lambda n=name: kube.get("v1", "Pod", namespace, f"{n}-1"), what=f"cold {name}")
        wait_for(lambda n=name, r=reason: r in events_of(kube, namespace, n), what=reason)
    # The idle pod was not used by either.
    assert len(idle_pods(kube, namespace, "py")) == 1


def test_pool_deletion_removes_idle_pods_and_keeps_claimed_ones(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, POOLS, namespace, pool_body("py", 3))
    fill_ready(kube, namespace, "py", 3)
    create_cr(kube, "sandboxtasks", namespace, task_body("t"))
    claimed = wait_for(lambda: task_status(kube, namespace, "t").get("podName"), what="claim")
    wait_for(lambda: len(idle_pods(kube, namespace, "py")) == 3, what="refill")
    kube.delete("posttrain.io/v1alpha1", "SandboxWarmPool", namespace, "py")
    wait_for(lambda: not idle_pods(kube, namespace, "py"), what="idle pods deleted")
    assert kube.get("v1", "Pod", namespace, claimed) is not None
    owners = Counter(
        o["kind"] for o in kube.get("v1", "Pod", namespace, claimed)["metadata"]["ownerReferences"]
    )
    assert owners == Counter({"SandboxTask": 1})
