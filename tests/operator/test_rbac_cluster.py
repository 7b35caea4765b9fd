"""The operator runs with nothing but OPERATOR_RULES (as a real ServiceAccount token).

If a rule is missing, a child is never created or a status never written, and the waits
below time out: this is the check that rbac.py, the one source of truth, is complete.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from posttrain.devenv.controlplane import ControlPlane
from posttrain.operator.config import OperatorConfig
from posttrain.operator.kube import KubeClient, load_credentials, resource_path
from posttrain.operator.rbac import cluster_role
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, get_cr, list_pods, set_pod_running, set_pod_terminated, wait_for

pytestmark = pytest.mark.cluster


def service_account_kubeconfig(
    kube: KubeClient, control_plane: ControlPlane, namespace: str, name: str, path: Path
) -> Path:
    """Mint a token for ``name`` with the TokenRequest API and write a kubeconfig using it."""
    kube.request(
        "POST",
        resource_path("v1", "serviceaccounts", namespace),
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
    )
    token = kube.request(
        "POST",
        resource_path("v1", "serviceaccounts", namespace, name) + "/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        },
    )[1]["status"]["token"]
    assert control_plane.pki is not None
    ca = base64.b64encode(control_plane.pki.ca_cert.read_bytes()).decode()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {
                            "server": control_plane.server,
                            "certificate-authority-data": ca,
                        },
                    }
                ],
                "users": [{"name": name, "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": name}}],
                "current-context": "c",
            }
        )
    )
    return path


@contextlib.contextmanager
def operator_with_exactly_its_rbac(
    kube: KubeClient, control_plane: ControlPlane, namespace: str, tmp_path: Path
) -> Iterator[OperatorThread]:
    """The operator running as ServiceAccount ``operator`` bound to exactly
    rbac.OPERATOR_RULES (a missing rule shows up as a wait that times out)."""
    role = cluster_role(f"posttrain-operator-{namespace}")
    kube.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
    kubeconfig = service_account_kubeconfig(
        kube, control_plane, namespace, "operator", tmp_path / "kubeconfig"
    )
    kube.request(
        "POST",
        resource_path("rbac.authorization.k8s.io/v1", "rolebindings", namespace),
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "posttrain-operator"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": role["metadata"]["name"],
            },
            "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": namespace}],
        },
    )
    config = OperatorConfig(
        kubeconfig=str(kubeconfig), namespaces=(namespace,), standalone=True, resync_seconds=1.0
    )
    try:
        with OperatorThread(config) as operator:
            yield operator
    finally:
        kube.request(
            "DELETE",
            f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role['metadata']['name']}",
            ok=(200, 404),
        )


def test_operator_works_with_exactly_its_rbac(
    crds_installed: None,
    control_plane: ControlPlane,
    kube: KubeClient,
    namespace: str,
    tmp_path: Path,
) -> None:
    with operator_with_exactly_its_rbac(kube, control_plane, namespace, tmp_path):
        create_cr(
            kube,
            "sandboxtasks",
            namespace,
            {
                "kind": "SandboxTask",
                "metadata": {"name": "t"},
                "spec": {"command": ["true"], "ttlSecondsAfterFinished": 1},
            },
        )
        create_cr(
            kube,
            "trainingruns",
            namespace,
            {
                "kind": "TrainingRun",
                "metadata": {"name": "r"},
                "spec": {
                    "model": "m",
                    "domains": [
                        {"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}
                    ],
                },
            },
        )
        create_cr(
            kube,
            "rolloutpools",
            namespace,
            {
                "kind": "RolloutPool",
                "metadata": {"name": "p"},
                "spec": {"model": "m", "engine": "cpu"},
            },
        )
        wait_for(lambda: kube.get("v1", "Pod", namespace, "t-1"), what="sandbox pod")
        # Trainer RBAC (Role + RoleBinding) needs the operator to hold TRAINER_RULES.
        wait_for(
            lambda: kube.get("rbac.authorization.k8s.io/v1", "RoleBinding", namespace, "r-trainer"),
            what="trainer RoleBinding",
        )
        wait_for(lambda: kube.get("v1", "Pod", namespace, "r-g0-0"), what="trainer pod")
        wait_for(
            lambda: (get_cr(kube, "rolloutpools", namespace, "p").get("status") or {}).get(
                "selector"
            ),
            what="pool status",
        )
        wait_for(lambda: kube.get("v1", "Service", namespace, "p"), what="pool Service")
        # spec.autoscaling: replicas below minReplicas are raised through /scale.
        create_cr(
            kube,
            "rolloutpools",
            namespace,
            {
                "kind": "RolloutPool",
                "metadata": {"name": "auto"},
                "spec": {
                    "model": "m",
                    "engine": "cpu",
                    "replicas": 1,
                    "autoscaling": {"minReplicas": 2, "maxReplicas": 3},
                },
            },
        )
        wait_for(
            lambda: get_cr(kube, "rolloutpools", namespace, "auto")["spec"]["replicas"] == 2,
            what="autoscaled pool raised to minReplicas through /scale",
        )
        # SandboxWarmPool: pool pods, pool status, and the claim (a pod patch).
        wait_for(
            lambda: (
                kube.request("GET", "/apis/posttrain.io/v1alpha1/sandboxwarmpools", ok=(200, 404))[
                    0
                ]
                == 200
            ),
            what="warm-pool CRD served",
        )
        create_cr(
            kube,
            "sandboxwarmpools",
            namespace,
            {"kind": "SandboxWarmPool", "metadata": {"name": "warm"}, "spec": {"replicas": 1}},
        )
        idle = wait_for(
            lambda: list_pods(kube, namespace, "posttrain.io/warm-pool=warm"), what="idle warm pod"
        )
        set_pod_running(kube, namespace, idle[0]["metadata"]["name"])
        wait_for(
            lambda: (
                (get_cr(kube, "sandboxwarmpools", namespace, "warm").get("status") or {}).get(
                    "readyReplicas"
                )
                == 1
            ),
            what="warm pool ready",
        )
        create_cr(
            kube,
            "sandboxtasks",
            namespace,
            {
                "kind": "SandboxTask",
                "metadata": {"name": "w"},
                "spec": {"command": ["true"], "warmPoolRef": "warm"},
            },
        )
        wait_for(
            lambda: (
                (get_cr(kube, "sandboxtasks", namespace, "w").get("status") or {}).get("warmPool")
                == "warm"
            ),
            what="warm claim",
        )
        set_pod_terminated(kube, namespace, "t-1", 0)
        # Status patch, then the TTL delete of the task and its pod.
        wait_for(
            lambda: get_cr(kube, "sandboxtasks", namespace, "t") is None,
            what="task finished and deleted by TTL",
        )
        events = kube.request("GET", resource_path("v1", "events", namespace))[1]["items"]
        assert any(e["source"].get("component") == "posttrain-operator" for e in events)


def test_client_rereads_rotated_token_after_401(
    control_plane: ControlPlane, kube: KubeClient, namespace: str, tmp_path: Path
) -> None:
    kubeconfig = service_account_kubeconfig(
        kube, control_plane, namespace, "rotating", tmp_path / "kubeconfig"
    )
    good = load_credentials(str(kubeconfig))
    stale = dataclasses.replace(good, token="expired-token")
    client = KubeClient(stale, pool_size=2, reload=lambda: load_credentials(str(kubeconfig)))
    try:
        # Authenticated as the ServiceAccount (no RBAC granted): 403, not 401, after reload.
        status, _ = client.request("GET", resource_path("v1", "pods", namespace), ok=(200, 403))
        assert status == 403
    finally:
        client.close()
