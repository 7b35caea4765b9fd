"""Admission through Kueue and spec.managedBy, against the real apiserver with Kueue's real
CRDs installed (vendored in tests/operator/crds from sigs.k8s.io/kueue@v0.17.0). No Kueue
controller runs here, so the tests play it: they write the Workload's status as Kueue does
when it admits (QuotaReserved + Admitted + status.admission) and when it evicts."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from posttrain.api import labels as api_labels
from posttrain.devenv.controlplane import ControlPlane
from posttrain.operator.kube import KubeClient, resource_path
from posttrain.operator.runtime import OperatorThread
from posttrain.operator.trainingrun.kueue import KUEUE_API_VERSION

from .conftest import (
    cr_path,
    create_cr,
    get_cr,
    list_pods,
    run_body,
    run_status,
    set_pod_terminated,
    wait_for,
)
from .test_rbac_cluster import operator_with_exactly_its_rbac

pytestmark = pytest.mark.cluster

CRDS = Path(__file__).parent / "crds"
KUEUE_CRDS = ["workloads", "localqueues", "clusterqueues", "resourceflavors"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def kueue_crds(crds_installed: None, kubectl: Any, kube: KubeClient) -> Iterator[None]:
    """Kueue's CRDs, for this module only (elsewhere runs start without admission)."""
    for name in KUEUE_CRDS:
        kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            "-f",
            str(CRDS / f"kueue.x-k8s.io_{name}.yaml"),
        )
    for name in KUEUE_CRDS:
        wait_for(lambda name=name: kube.serves(KUEUE_API_VERSION, name), what=f"{name} served")
    yield
    for name in KUEUE_CRDS:
        kubectl("delete", "crd", f"{name}.kueue.x-k8s.io", "--wait=true")


def workload(kube: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    return kube.get(KUEUE_API_VERSION, "Workload", namespace, name)


def _condition(kind: str, status: str, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def admit(
    kube: KubeClient, namespace: str, name: str, count: int, flavor: str = "default-flavor"
) -> None:
    """Play Kueue's scheduler: reserve quota in ClusterQueue ``posttrain`` and admit."""
    status = {
        "admission": {
            "clusterQueue": "posttrain",
            "podSetAssignments": [
                {
                    "name": "trainer",
                    "count": count,
                    "flavors": {"cpu": flavor},
                    "resourceUsage": {"cpu": str(2 * count)},
                }
            ],
        },
        "conditions": [
            _condition("QuotaReserved", "True", "QuotaReserved", "Quota reserved in posttrain"),
            _condition("Admitted", "True", "Admitted", "The workload is admitted"),
        ],
    }
    kube.patch(
        resource_path(KUEUE_API_VERSION, "workloads", namespace, name), {"status": status}, "status"
    )


def evict(kube: KubeClient, namespace: str, name: str) -> None:
    """Play Kueue's preemption: take the admission back (Evicted=True, Admitted=False)."""
    status = {
        "admission": None,
        "conditions": [
            _condition("QuotaReserved", "False", "Pending", "evicted: Preempted"),
            _condition("Admitted", "False", "NoReservation", "The workload has no reservation"),
            _condition("Evicted", "True", "Preempted", "Preempted to accommodate a workload"),
        ],
    }
    kube.patch(
        resource_path(KUEUE_API_VERSION, "workloads", namespace, name), {"status": status}, "status"
    )


def trainer_pods(kube: KubeClient, namespace: str, run: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in list_pods(kube, namespace, f"{api_labels.LABEL_RUN}={run}")
        if not p["metadata"].get("deletionTimestamp")
    )


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def wait_suspended(kube: Any, namespace: str, name: str, reason: str) -> dict[str, Any]:
    """The run's status once its Suspended condition has ``reason``."""
    status: dict[str, Any] = wait_for(
        lambda: (
            (s := run_status(kube, namespace, name))
            and condition(s, "Suspended").get("reason") == reason
            and s
        ),
        what=f"Suspended/{reason}",
    )
    return status


def events(kube: KubeClient, namespace: str, name: str) -> list[dict[str, Any]]:
    path = resource_path("v1", "events", namespace) + f"?fieldSelector=involvedObject.name={name}"
    items: list[dict[str, Any]] = kube.request("GET", path)[1]["items"]
    return items


def test_queued_run_stays_suspended_until_its_workload_is_admitted(
    kueue_crds: None,
    control_plane: ControlPlane,
    kube: KubeClient,
    kubectl: Any,
    namespace: str,
    tmp_path: Path,
) -> None:
    """The whole lifecycle, as the operator's ServiceAccount with exactly its RBAC."""
    for example in ("kueue-queues.yaml", "evaluator-job.yaml"):  # the documented manifests
        kubectl(
            "apply",
            "--dry-run=server",
            "-n",
            namespace,
            "-f",
            str(EXAMPLES / "kubernetes" / example),
        )
    labels = {"kueue.x-k8s.io/queue-name": "team-a"}
    with operator_with_exactly_its_rbac(kube, control_plane, namespace, tmp_path):
        body = run_body("q", resources={"nodes": 2, "cpu": "2", "memory": "4Gi"})
        body["metadata"]["labels"] = labels  # type: ignore[index]
        run = create_cr(kube, "trainingruns", namespace, body)
        wl = wait_for(lambda: workload(kube, namespace, "trainingrun-q"), what="Workload")
        owner = wl["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "TrainingRun",
            run["metadata"]["uid"],
            True,
        )
        assert wl["spec"]["queueName"] == "team-a"
        (pod_set,) = wl["spec"]["podSets"]
        assert pod_set["count"] == 2
        assert pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"

        waiting = wait_for(
            lambda: (
                (s := run_status(kube, namespace, "q")).get("message")
                and condition(s, "Suspended").get("status") == "True"
                and s
            ),
            what="run waiting for admission",
        )
        assert waiting["phase"] == "Pending"
        assert condition(waiting, "Suspended")["reason"] == "WaitingForAdmission"
        assert "trainingrun-q" in waiting["message"] and "team-a" in waiting["message"]
        # Several resyncs later (resync_seconds=1) still no pod: the gate holds.
        wait_for(
            lambda: any(
                e.get("reason") == "WaitingForAdmission" for e in events(kube, namespace, "q")
            ),
            what="waiting event",
        )
        assert trainer_pods(kube, namespace, "q") == []

        admit(kube, namespace, "trainingrun-q", 2)
        wait_for(
            lambda: trainer_pods(kube, namespace, "q") == ["q-g0-0", "q-g0-1"],
            what="the gang created on admission",
        )
        admitted = wait_suspended(kube, namespace, "q", "Admitted")
        assert condition(admitted, "Suspended")["status"] == "False"
        assert "posttrain" in condition(admitted, "Suspended")["message"]

        evict(kube, namespace, "trainingrun-q")
        wait_for(lambda: trainer_pods(kube, namespace, "q") == [], what="gang deleted on eviction")
        # The gang's deletes come before the status patch of the same reconcile: wait for it.
        evicted = wait_suspended(kube, namespace, "q", "Evicted")
        assert evicted.get("restarts", 0) == 0  # preemption is not a failure

        admit(kube, namespace, "trainingrun-q", 2)
        wait_for(
            lambda: trainer_pods(kube, namespace, "q") == ["q-g1-0", "q-g1-1"],
            what="a new gang on re-admission",
        )
        set_pod_terminated(kube, namespace, "q-g1-0", 0)
        wait_for(
            lambda: run_status(kube, namespace, "q").get("phase") == "Succeeded",
            what="run Succeeded",
        )
        done = wait_for(
            lambda: (
                (w := workload(kube, namespace, "trainingrun-q"))
                and condition(w.get("status") or {}, "Finished").get("status") == "True"
                and w
            ),
            what="Workload Finished (quota released)",
        )
        assert condition(done["status"], "Finished")["reason"] == "Succeeded"
        assert condition(done["status"], "Admitted")["status"] == "True"  # Kueue's kept


def test_suspending_a_queued_run_deactivates_its_workload(
    kueue_crds: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    flavor = f"gpu-{namespace}"
    kube.request(
        "POST",
        f"/apis/{KUEUE_API_VERSION}/resourceflavors",
        {
            "apiVersion": KUEUE_API_VERSION,
            "kind": "ResourceFlavor",
            "metadata": {"name": flavor},
            "spec": {"nodeLabels": {"cloud.example.com/pool": "a100"}},
        },
    )
    body = run_body("s")
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}  # type: ignore[index]
    create_cr(kube, "trainingruns", namespace, body)
    wait_for(lambda: workload(kube, namespace, "trainingrun-s"), what="Workload")
    admit(kube, namespace, "trainingrun-s", 1, flavor=flavor)
    wait_for(lambda: trainer_pods(kube, namespace, "s") == ["s-g0-0"], what="pod on admission")
    # The pod lands where Kueue took the quota: the flavor's node labels are in its selector.
    pod = kube.get("v1", "Pod", namespace, "s-g0-0")
    assert pod is not None
    assert pod["spec"]["nodeSelector"]["cloud.example.com/pool"] == "a100"
    kube.patch(cr_path("trainingruns", namespace, "s"), {"spec": {"suspend": True}})
    wait_for(
        lambda: (workload(kube, namespace, "trainingrun-s") or {})["spec"].get("active") is False,
        what="Workload deactivated (Kueue then releases the quota)",
    )
    wait_for(lambda: trainer_pods(kube, namespace, "s") == [], what="pod deleted")
    kube.patch(cr_path("trainingruns", namespace, "s"), {"spec": {"suspend": False}})
    wait_for(
        lambda: (workload(kube, namespace, "trainingrun-s") or {})["spec"].get("active") is True,
        what="Workload active again",
    )


def test_run_managed_by_another_controller_is_left_alone(
    kueue_crds: None, operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    body = run_body("mk", managedBy="kueue.x-k8s.io/multikueue")
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}  # type: ignore[index]
    create_cr(kube, "trainingruns", namespace, body)
    create_cr(kube, "trainingruns", namespace, run_body("ours"))
    # The operator is alive and reconciling (it created the other run's pod)...
    wait_for(lambda: kube.get("v1", "Pod", namespace, "ours-g0-0"), what="the other run's pod")
    event = wait_for(
        lambda: next(
            (e for e in events(kube, namespace, "mk") if e.get("reason") == "ManagedElsewhere"),
            None,
        ),
        what="ManagedElsewhere event",
    )
    assert "kueue.x-k8s.io/multikueue" in event["message"]
    # ...and left this one alone: no pods, no Workload, no status written.
    assert trainer_pods(kube, namespace, "mk") == []
    assert workload(kube, namespace, "trainingrun-mk") is None
    stored = get_cr(kube, "trainingruns", namespace, "mk")
    assert stored is not None and not stored.get("status")
    assert len([e for e in events(kube, namespace, "mk")]) == 1  # told once, not per resync
