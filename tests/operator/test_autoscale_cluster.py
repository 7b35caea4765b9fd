"""RolloutPool spec.autoscaling against the real apiserver: a run's reported rollout wait
scales its pool up through /scale with an Event, and a low one scales it down only after the
stabilization window. The trainer's own status writer reports the signal."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import pytest

from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread
from posttrain.trainer.observe.rollout_wait import RolloutWaitWindow
from posttrain.trainer.observe.status import KubeStatusReporter, RunStatus

from .conftest import create_cr, get_cr, run_body, set_pod_running, wait_for
from .test_rolloutpool_cluster import pool_status, set_deployment_status

pytestmark = pytest.mark.cluster

WINDOW_S = 4


def report_wait(reporter: KubeStatusReporter, fraction: float) -> None:
    """What the trainer writes after its RL steps: ``fraction`` of 4 steps spent waiting,
    the steps starting now (after any scale the operator made so far)."""
    window = RolloutWaitWindow()
    for _ in range(4):
        window.record(10.0 * fraction, 10.0, datetime.now(UTC))
    reporter.report(RunStatus(step=4, rollout_wait=window.to_wire()))


def pool_events(kube: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    path = resource_path("v1", "events", namespace)
    items = kube.request("GET", f"{path}?fieldSelector=involvedObject.name%3D{name}")[1]["items"]
    return [e for e in items if e["involvedObject"]["kind"] == "RolloutPool"]


def spec_replicas(kube: KubeClient, namespace: str, name: str) -> int:
    pool = get_cr(kube, "rolloutpools", namespace, name)
    assert pool is not None
    return int(pool["spec"]["replicas"])


def autoscaling(kube: KubeClient, namespace: str) -> dict[str, Any]:
    return pool_status(kube, namespace, "auto").get("autoscaling") or {}


def test_run_wait_scales_pool_up_then_down_after_the_window(
    operator: OperatorThread, kube: KubeClient, kube_api: Any, kubectl: Any, namespace: str
) -> None:
    from kubernetes import client

    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "auto"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "engine": "cpu",
                "replicas": 1,
                "resources": {"cpu": "1", "memory": "2Gi"},
                "autoscaling": {
                    "minReplicas": 1,
                    "maxReplicas": 4,
                    "targetRolloutWaitFraction": 0.1,
                    "scaleDownStabilizationSeconds": WINDOW_S,
                },
            },
        },
    )
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "auto"), what="Deployment")
    set_deployment_status(kube, namespace, "auto", ready=1)
    create_cr(kube, "trainingruns", namespace, run_body("r", rollout={"pool": "auto"}))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "r-g0-0"), what="trainer pod")
    set_pod_running(kube, namespace, "r-g0-0")
    wait_for(lambda: (get_cr(kube, "trainingruns", namespace, "r") or {}).get("status", {})
             .get("phase") == "Running", what="run Running")  # fmt: skip
    # No step yet: nothing to act on.
    wait_for(lambda: autoscaling(kube, namespace).get("reason") == "NoSignal", what="NoSignal")
    assert spec_replicas(kube, namespace, "auto") == 1

    # The trainer waited 30% of its steps (target 10%): ceil(1 * 3) = 3 replicas, via /scale.
    reporter = KubeStatusReporter("r", namespace, api=client.CustomObjectsApi(kube_api))
    report_wait(reporter, 0.3)
    wait_for(lambda: spec_replicas(kube, namespace, "auto") == 3, what="scaled up to 3")
    wait_for(
        lambda: kube.get("apps/v1", "Deployment", namespace, "auto")["spec"]["replicas"] == 3,
        what="Deployment at 3",
    )
    scaled_up = wait_for(
        lambda: [e for e in pool_events(kube, namespace, "auto") if e["reason"] == "ScaledUp"],
        what="ScaledUp event",
    )
    assert "1 -> 3 replica(s)" in scaled_up[0]["message"]
    assert "run r waited 0.300" in scaled_up[0]["message"]
    assert autoscaling(kube, namespace)["lastScaleTime"]
    # The /scale subresource reports what the operator wrote (an HPA would read the same).
    out = kubectl("get", "-n", namespace, "--subresource=scale", "rolloutpool/auto",
                  "-o", "jsonpath={.spec.replicas}").stdout  # fmt: skip
    assert out == "3"

    # The 0.3 was measured before that scale: it no longer counts, the pool holds at 3.
    set_deployment_status(kube, namespace, "auto", ready=3)
    wait_for(lambda: autoscaling(kube, namespace).get("reason") == "NoSignal", what="stale")
    assert spec_replicas(kube, namespace, "auto") == 3
    wide = kubectl("get", "-n", namespace, "rp", "auto", "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert header.split()[:4] == ["NAME", "READY", "DESIRED", "VERSION"]
    assert {"MIN", "MAX", "WAIT", "SCALING"} <= set(header.split())
    assert row.split()[1:3] == ["3", "3"]

    # Hardly any wait: ceil(3 * 0.2) = 1, at most halving -> 2, after the window only.
    def reported_low() -> dict[str, Any] | bool:
        # Step after step, as a trainer reports: some step starts after the scale's second.
        report_wait(reporter, 0.02)
        return (s := autoscaling(kube, namespace)).get("reason") == "ScaleDownPending" and s

    pending = wait_for(reported_low, what="ScaleDownPending", interval_s=0.5)
    assert pending["scaleDownPendingReplicas"] == 2
    wait_for(lambda: spec_replicas(kube, namespace, "auto") == 2, what="scaled down to 2")
    # The operator writes /scale, then status.autoscaling: two requests, so a read between
    # them sees the new size beside the old status (on a loaded machine, seconds apart).
    done = wait_for(
        lambda: "scaleDownPendingSince" not in (s := autoscaling(kube, namespace)) and s,
        what="the scale-down recorded in status.autoscaling",
    )
    waited = datetime.fromisoformat(done["lastScaleTime"]) - datetime.fromisoformat(
        pending["scaleDownPendingSince"]
    )
    assert waited.total_seconds() >= WINDOW_S
    assert "scaleDownPendingSince" not in done
    reasons = [e["reason"] for e in pool_events(kube, namespace, "auto")]
    assert "ScaleDownPending" in reasons
    wait_for(
        lambda: "ScaledDown" in [e["reason"] for e in pool_events(kube, namespace, "auto")],
        what="ScaledDown event",
    )
    wait_for(
        lambda: kube.get("apps/v1", "Deployment", namespace, "auto")["spec"]["replicas"] == 2,
        what="Deployment at 2",
    )


def test_pool_without_autoscaling_is_left_to_kubectl_scale(
    operator: OperatorThread, kube: KubeClient, kube_api: Any, namespace: str
) -> None:
    """No spec.autoscaling: a run's wait changes nothing (an HPA or a person owns replicas)."""
    from kubernetes import client

    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "fixed"},
            "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1},
        },
    )
    wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "fixed"), what="Deployment")
    set_deployment_status(kube, namespace, "fixed", ready=1)
    create_cr(kube, "trainingruns", namespace, run_body("rf", rollout={"pool": "fixed"}))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "rf-g0-0"), what="trainer pod")
    set_pod_running(kube, namespace, "rf-g0-0")
    reporter = KubeStatusReporter("rf", namespace, api=client.CustomObjectsApi(kube_api))
    report_wait(reporter, 0.9)
    wait_for(
        lambda: (get_cr(kube, "trainingruns", namespace, "rf") or {}).get("status", {})
        .get("rolloutWait"),
        what="reported wait",
    )  # fmt: skip
    wait_for(lambda: pool_status(kube, namespace, "fixed").get("phase") == "Ready", what="Ready")
    time.sleep(3)  # several resyncs (1 s here) see the wait: none may move the pool
    assert "autoscaling" not in pool_status(kube, namespace, "fixed")
    assert spec_replicas(kube, namespace, "fixed") == 1
    assert kube.get("apps/v1", "Deployment", namespace, "fixed")["spec"]["replicas"] == 1


def test_apiserver_refuses_min_above_max(
    crds_installed: None, kube: KubeClient, namespace: str
) -> None:
    """The CRD's CEL rule says what the pydantic model says, before any operator sees it."""
    body = {
        "apiVersion": "posttrain.io/v1alpha1",
        "kind": "RolloutPool",
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"model": "m", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
    }
    status, answer = kube.request(
        "POST", resource_path("posttrain.io/v1alpha1", "rolloutpools", namespace), body,
        ok=(201, 422),
    )  # fmt: skip
    assert status == 422
    assert "autoscaling.minReplicas must be <= autoscaling.maxReplicas" in answer["message"]


def test_a_new_pool_below_min_starts_at_min(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """replicas: 0 with minReplicas: 2: raised through /scale, and the Deployment is created
    with 2 in that same reconcile (generation 1: never created at 0 and patched)."""
    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "low"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "engine": "cpu",
                "replicas": 0,
                "autoscaling": {"minReplicas": 2, "maxReplicas": 3},
            },
        },
    )
    dep = wait_for(lambda: kube.get("apps/v1", "Deployment", namespace, "low"), what="Deployment")
    assert dep["spec"]["replicas"] == 2 and dep["metadata"]["generation"] == 1
    assert spec_replicas(kube, namespace, "low") == 2
    event = wait_for(
        lambda: [e for e in pool_events(kube, namespace, "low") if e["reason"] == "ScaledUp"],
        what="ScaledUp event",
    )
    assert "0 -> 2 replica(s): 0 replica(s) outside [2, 3]" in event[0]["message"]
