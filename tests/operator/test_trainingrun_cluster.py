"""TrainingRun against the real apiserver with the operator in-process."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.operator.kube import KubeClient, KubeError, resource_path
from posttrain.operator.runtime import OperatorThread

from .conftest import (
    cr_path,
    create_cr,
    get_cr,
    list_pods,
    run_body,
    run_status,
    set_pod_running,
    set_pod_terminated,
    wait_for,
)

pytestmark = pytest.mark.cluster


def wait_phase(kube: KubeClient, namespace: str, name: str, phase: str) -> dict[str, object]:
    return wait_for(
        lambda: (s := run_status(kube, namespace, name)).get("phase") == phase and s,
        what=f"{name} phase {phase}",
    )


def pod_names(kube: KubeClient, namespace: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in list_pods(kube, namespace)
        if not p["metadata"].get("deletionTimestamp")
    )


def as_trainer(namespace: str, run: str) -> dict[str, str]:
    """Impersonate the run's trainer ServiceAccount (checks the Role really is that narrow)."""
    return {"Impersonate-User": f"system:serviceaccount:{namespace}:{run}-trainer"}


def test_single_node_run_children_status_split_and_success(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    run = create_cr(
        kube,
        "trainingruns",
        namespace,
        run_body(
            "r1",
            resources={"gpusPerNode": 2, "cpu": "4", "memory": "16Gi"},
            algorithm={"maxSteps": 7},
        ),
    )
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "r1-g0-0"), what="trainer pod")
    owner = pod["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"]) == ("TrainingRun", run["metadata"]["uid"])
    main = pod["spec"]["containers"][0]
    assert main["command"] == [
        "posttrain",
        "run",
        "/etc/posttrain/run.yaml",
        "--out",
        "/workspace",
        "--metrics-port",
        "9090",
    ]
    assert main["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e for e in main["env"]}
    assert env["WORLD_SIZE"]["value"] == "1" and env["RANK"]["value"] == "0"
    assert env["POSTTRAIN_RUN_NAME"]["value"] == "r1"
    assert env["POSTTRAIN_RUN_NAMESPACE"]["value"] == namespace
    assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "posttrain-s3"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert pod["spec"]["serviceAccountName"] == "r1-trainer"
    config_map = kube.get("v1", "ConfigMap", namespace, "r1-config")
    assert config_map is not None and "maxSteps: 7" in config_map["data"]["run.yaml"]
    uid = get_cr(kube, "trainingruns", namespace, "r1")["metadata"]["uid"]
    assert f"s3://posttrain/runs/{namespace}/r1/{uid}" in config_map["data"]["run.yaml"]
    assert env["POSTTRAIN_RUN_UID"]["value"] == uid  # whose checkpoints are whose
    role = kube.get("rbac.authorization.k8s.io/v1", "Role", namespace, "r1-trainer")
    assert role is not None
    assert {r["resources"][0] for r in role["rules"]} == {
        "trainingruns/status",
        "trainingruns",
        "events",
    }
    assert all(r["resourceNames"] == ["r1"] for r in role["rules"] if r["resources"] != ["events"])
    # No cleanup needed -> no finalizer.
    assert not get_cr(kube, "trainingruns", namespace, "r1")["metadata"].get("finalizers")

    status = wait_phase(kube, namespace, "r1", "Pending")
    assert status["maxSteps"] == 7 and status["restarts"] == 0
    set_pod_running(kube, namespace, "r1-g0-0")
    wait_phase(kube, namespace, "r1", "Running")

    # The trainer reports progress through its own narrow identity...
    progress = {"status": {"step": 5, "rewardMean": 0.4, "lastCheckpoint": "s3://b/ckpt/5"}}
    kube.request(
        "PATCH",
        cr_path("trainingruns", namespace, "r1") + "/status",
        progress,
        content_type="application/merge-patch+json",
        headers=as_trainer(namespace, "r1"),
    )
    # ...and cannot touch another run or the spec of its own.
    create_cr(kube, "trainingruns", namespace, run_body("other", suspend=True))
    with pytest.raises(KubeError, match="403"):
        kube.request(
            "PATCH",
            cr_path("trainingruns", namespace, "other") + "/status",
            progress,
            content_type="application/merge-patch+json",
            headers=as_trainer(namespace, "r1"),
        )
    with pytest.raises(KubeError, match="403"):
        kube.request(
            "PATCH",
            cr_path("trainingruns", namespace, "r1"),
            {"spec": {"suspend": True}},
            content_type="application/merge-patch+json",
            headers=as_trainer(namespace, "r1"),
        )

    set_pod_terminated(kube, namespace, "r1-g0-0", 0)
    status = wait_phase(kube, namespace, "r1", "Succeeded")
    # The operator's patches never clobber the trainer's fields.
    assert (status["step"], status["rewardMean"], status["lastCheckpoint"]) == (
        5,
        0.4,
        "s3://b/ckpt/5",
    )
    assert status["completionTime"] and status["startTime"]
    succeeded = next(c for c in status["conditions"] if c["type"] == "Succeeded")
    assert (succeeded["status"], succeeded["reason"]) == ("True", "TrainerSucceeded")


def test_gang_restart_then_backoff_limit(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube, "trainingruns", namespace, run_body("g", resources={"nodes": 2}, backoffLimit=1)
    )
    wait_for(lambda: pod_names(kube, namespace) == ["g-g0-0", "g-g0-1"], what="gang 0")
    head = kube.get("v1", "Service", namespace, "g-head")
    assert head is not None and head["spec"]["clusterIP"] == "None"
    assert head["spec"]["selector"]["posttrain.io/gang"] == "0"
    worker = kube.get("v1", "Pod", namespace, "g-g0-1")["spec"]["containers"][0]
    # Every pod of the plain gang runs the trainer; torchrun's rendezvous joins them (#17).
    assert worker["command"][:2] == ["posttrain", "run"]
    assert {e["name"]: e.get("value") for e in worker["env"]}["MASTER_ADDR"] == (
        f"g-head.{namespace}.svc"
    )
    for name in ("g-g0-0", "g-g0-1"):
        set_pod_running(kube, namespace, name)
    wait_phase(kube, namespace, "g", "Running")

    # One worker fails: the whole gang is replaced, one restart counted.
    set_pod_terminated(kube, namespace, "g-g0-1", 137, reason="Error")
    wait_for(lambda: pod_names(kube, namespace) == ["g-g1-0", "g-g1-1"], what="gang 1")
    status = wait_for(
        lambda: (s := run_status(kube, namespace, "g")).get("restarts") == 1 and s,
        what="restarts == 1",
    )
    assert status["phase"] == "Pending"
    # MASTER_ADDR now names gang 1's rank 0 only, never the old one while it terminates.
    head = kube.get("v1", "Service", namespace, "g-head")
    assert head is not None and head["spec"]["selector"]["posttrain.io/gang"] == "1"

    # Failing again exceeds backoffLimit=1: Failed, a condition says why, the running rank
    # deleted and the failed one kept, so its log says why (docs/operator.md, "Trainer pods
    # after a run").
    set_pod_terminated(kube, namespace, "g-g1-0", 1)
    status = wait_phase(kube, namespace, "g", "Failed")
    assert status["restarts"] == 2
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "backoffLimit=1" in failed["message"]
    wait_for(lambda: pod_names(kube, namespace) == ["g-g1-0"], what="running rank deleted")
    events = kube.request(
        "GET", resource_path("v1", "events", namespace) + "?fieldSelector=involvedObject.name=g"
    )[1]["items"]
    assert {"GangRestart", "BackoffLimitExceeded"} <= {e["reason"] for e in events}


def test_suspend_and_resume(operator: OperatorThread, kube: KubeClient, namespace: str) -> None:
    create_cr(kube, "trainingruns", namespace, run_body("s"))
    wait_for(lambda: pod_names(kube, namespace) == ["s-g0-0"], what="first pod")
    set_pod_running(kube, namespace, "s-g0-0")
    wait_phase(kube, namespace, "s", "Running")
    kube.patch(
        cr_path("trainingruns", namespace, "s") + "/status",
        {"status": {"lastCheckpoint": "s3://b/ckpt/10"}},
    )

    kube.patch(cr_path("trainingruns", namespace, "s"), {"spec": {"suspend": True}})
    status = wait_phase(kube, namespace, "s", "Suspended")
    wait_for(lambda: pod_names(kube, namespace) == [], what="pods deleted on suspend")
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("True", "Suspended")
    assert get_cr(kube, "trainingruns", namespace, "s") is not None

    kube.patch(cr_path("trainingruns", namespace, "s"), {"spec": {"suspend": False}})
    # A new incarnation: never confused with a still-terminating pod of the old one.
    wait_for(lambda: pod_names(kube, namespace) == ["s-g1-0"], what="pod after resume")
    status = wait_phase(kube, namespace, "s", "Pending")
    suspended = next(c for c in status["conditions"] if c["type"] == "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("False", "Resumed")
    assert status["restarts"] == 0  # suspending is not a failure
    assert status["lastCheckpoint"] == "s3://b/ckpt/10"


def test_active_deadline_fails_the_run(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "trainingruns", namespace, run_body("d", activeDeadlineSeconds=2))
    wait_for(lambda: pod_names(kube, namespace) == ["d-g0-0"], what="pod")
    assert kube.get("v1", "Pod", namespace, "d-g0-0")["spec"]["activeDeadlineSeconds"] == 2
    status = wait_phase(kube, namespace, "d", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    wait_for(lambda: pod_names(kube, namespace) == [], what="pods deleted at the deadline")


def test_trainer_pod_is_pointed_at_its_rollout_pool(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "gen"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "engine": "vllm",
                "engineArgs": {"dtype": "bfloat16"},
                "port": 8011,
            },
        },
    )
    create_cr(kube, "trainingruns", namespace, run_body("r-pool", rollout={"pool": "gen"}))
    pod = wait_for(lambda: kube.get("v1", "Pod", namespace, "r-pool-g0-0"), what="trainer pod")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["POSTTRAIN_ROLLOUT_ENDPOINTS"] == f"http://gen.{namespace}.svc:8011"
    assert env["POSTTRAIN_ROLLOUT_POOL"] == "gen"
    assert env["POSTTRAIN_ROLLOUT_DTYPE"] == "bfloat16"  # publish in the pool's serving dtype


def test_a_colocated_run_waits_for_its_template_pool_then_gets_its_replicas_as_sidecars(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """rollout.colocated through the reconciler: without the pool the run gets no pod but a
    RolloutPoolNotFound Warning (retried); once the pool exists (replicas 0: only a
    template), the trainer pod carries its servers as native sidecars, stored by the real
    apiserver, and the trainer's Role may not read the pool."""
    create_cr(kube, "trainingruns", namespace, run_body(
        "r-coloc", rollout={"pool": "tmpl", "colocated": {"replicas": 2}}))  # fmt: skip

    def warned() -> bool:
        path = (
            resource_path("v1", "events", namespace) + "?fieldSelector=involvedObject.name=r-coloc"
        )
        return any(
            e["reason"] == "RolloutPoolNotFound" for e in kube.request("GET", path)[1]["items"]
        )

    wait_for(warned, what="the RolloutPoolNotFound event")
    assert kube.get("v1", "Pod", namespace, "r-coloc-g0-0") is None
    create_cr(kube, "rolloutpools", namespace, {
        "kind": "RolloutPool", "metadata": {"name": "tmpl"},
        "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 0, "port": 8020,
                 "resources": {"gpus": 0, "cpu": "500m", "memory": "2Gi"}},
    })  # fmt: skip
    pod = wait_for(  # the retry's backoff: seconds, not the next resync
        lambda: kube.get("v1", "Pod", namespace, "r-coloc-g0-0"), what="trainer pod"
    )
    sidecars = [c for c in pod["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]
    assert [(c["name"], c["ports"][0]["containerPort"]) for c in sidecars] == [
        ("rollout-0", 8020),
        ("rollout-1", 8021),
    ]
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["POSTTRAIN_ROLLOUT_ENDPOINTS"] == "http://127.0.0.1:8020,http://127.0.0.1:8021"
    assert "POSTTRAIN_ROLLOUT_POOL" not in env
    status, _ = kube.request(
        "GET", cr_path("rolloutpools", namespace, "tmpl"),
        headers=as_trainer(namespace, "r-coloc"), ok=(200, 403),
    )  # fmt: skip
    assert status == 403  # nothing to discover: the Role names no pool
    policy = kube.get(
        "networking.k8s.io/v1", "NetworkPolicy", namespace, "r-coloc-colocated-rollout"
    )
    assert policy is not None  # stored by the real apiserver: the sidecars' ports stay closed
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_the_operator_alone_ends_the_run_after_the_trainer_reported_its_last_step(
    operator: OperatorThread, kube: KubeClient, kube_api: object, kubectl: Any, namespace: str
) -> None:
    """The order a real run produces: the trainer's final report (step = maxSteps, as
    ``Run.finish`` sends it), then its pod exits 0. Only the pod's exit ends the run, and the
    operator then writes everything a user waits for."""
    from kubernetes import client

    from posttrain.trainer.observe.status import KubeStatusReporter, RunStatus

    create_cr(kube, "trainingruns", namespace, run_body("fin", algorithm={"maxSteps": 3}))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "fin-g0-0"), what="trainer pod")
    set_pod_running(kube, namespace, "fin-g0-0")
    wait_phase(kube, namespace, "fin", "Running")

    reporter = KubeStatusReporter("fin", namespace, api=client.CustomObjectsApi(kube_api))
    reporter.report(
        RunStatus(
            phase="Succeeded",
            step=3,
            max_steps=3,
            reward_mean=0.5,
            last_checkpoint="s3://b/fin/step-3",
        )
    )
    reported = wait_for(
        lambda: (s := run_status(kube, namespace, "fin")).get("step") == 3 and s,
        what="the trainer's last report",
    )
    assert reported["phase"] == "Running"  # the report is progress, not the end of the run

    set_pod_terminated(kube, namespace, "fin-g0-0", 0)
    done = kubectl(
        "wait",
        "--for=condition=Succeeded",
        "trainingrun/fin",
        "-n",
        namespace,
        "--timeout=120s",
        check=False,
    )
    assert done.returncode == 0, done.stderr
    status = run_status(kube, namespace, "fin")
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Succeeded" and status["completionTime"]
    assert status["message"] == "trainer finished at step 3"
    assert (conditions["Succeeded"]["status"], conditions["Succeeded"]["reason"]) == (
        "True",
        "TrainerSucceeded",
    )
    assert conditions["Ready"]["status"] == "False"
    events = kube.request("GET", resource_path("v1", "events", namespace))[1]["items"]
    assert any(
        e["reason"] == "TrainerSucceeded" and e["involvedObject"]["name"] == "fin" for e in events
    )


def test_a_run_that_does_not_evaluate_inline_gets_its_evaluator_job_until_it_fails(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """evaluation.inline: false → the operator starts the run's evaluator as a Job owned by
    the run (the garbage collector deletes it with the run); when the run fails, no more
    checkpoints will come, and the operator deletes the Job rather than let it wait."""
    create_cr(kube, "trainingruns", namespace, run_body("inl"))
    run = create_cr(
        kube,
        "trainingruns",
        namespace,
        run_body("ev", evaluation={"inline": False}, backoffLimit=0),
    )
    job = wait_for(
        lambda: kube.get("batch/v1", "Job", namespace, "ev-evaluator"), what="Job", timeout_s=120
    )
    (owner,) = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "TrainingRun",
        "ev",
        run["metadata"]["uid"],
    )
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:3] == ["posttrain", "eval-checkpoints", "/etc/posttrain/run.yaml"]
    # It mounts the run's own ConfigMap, which the operator made for the trainer.
    assert kube.get("v1", "ConfigMap", namespace, "ev-config") is not None
    # A run that evaluates inline gets none.
    wait_for(
        lambda: pod_names(kube, namespace) == ["ev-g0-0", "inl-g0-0"],
        what="trainer pods",
        timeout_s=120,
    )
    assert kube.get("batch/v1", "Job", namespace, "inl-evaluator") is None

    set_pod_running(kube, namespace, "ev-g0-0")
    wait_phase(kube, namespace, "ev", "Running")
    assert kube.get("batch/v1", "Job", namespace, "ev-evaluator") is not None
    set_pod_terminated(kube, namespace, "ev-g0-0", 1)
    wait_phase(kube, namespace, "ev", "Failed")
    wait_for(
        lambda: kube.get("batch/v1", "Job", namespace, "ev-evaluator") is None,
        120,
        "evaluator Job deleted after the run failed",
    )


def test_a_run_applied_again_under_its_name_gets_a_gang_of_its_own(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    """Deleted and applied again before the garbage collector ran (this control plane has
    none): the old object's finished rank 0, still labelled with the run's name, must not end
    the new run, and its ConfigMap must not be adopted; the new object gets its own (issue #35)."""
    create_cr(kube, "trainingruns", namespace, run_body("again"))
    wait_for(lambda: kube.get("v1", "Pod", namespace, "again-g0-0"), what="first pod")
    set_pod_terminated(kube, namespace, "again-g0-0", 0)
    wait_phase(kube, namespace, "again", "Succeeded")
    old_uid = get_cr(kube, "trainingruns", namespace, "again")["metadata"]["uid"]
    kube.delete("posttrain.io/v1alpha1", "TrainingRun", namespace, "again")
    wait_for(lambda: get_cr(kube, "trainingruns", namespace, "again") is None, what="deleted")
    # No garbage collector here: the old children are all still there.
    assert kube.get("v1", "Pod", namespace, "again-g0-0") is not None

    create_cr(kube, "trainingruns", namespace, run_body("again"))
    new_uid = get_cr(kube, "trainingruns", namespace, "again")["metadata"]["uid"]
    assert new_uid != old_uid

    def owned_by_the_new_run(kind: str, name: str) -> bool:
        obj = kube.get("v1", kind, namespace, name)
        return obj is not None and [o["uid"] for o in obj["metadata"]["ownerReferences"]] == [
            new_uid
        ]

    wait_for(lambda: owned_by_the_new_run("Pod", "again-g0-0"), what="the new run's own pod")
    wait_for(lambda: owned_by_the_new_run("ConfigMap", "again-config"), what="its own ConfigMap")
    status = run_status(kube, namespace, "again")
    assert status.get("phase") == "Pending", status  # not Succeeded on the old pod's behalf
