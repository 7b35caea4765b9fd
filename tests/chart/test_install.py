"""helm install / upgrade / uninstall against the real kube-apiserver (no kubelet: pods stay
Pending, so the tests assert on the objects, never on running pods)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from posttrain.devenv.controlplane import ControlPlane

from .conftest import CHART_DIR, REPO_ROOT, VALUES_FILES, Helm

pytestmark = pytest.mark.cluster

POSTTRAIN_CRDS = (
    "trainingruns.posttrain.io",
    "rolloutpools.posttrain.io",
    "sandboxtasks.posttrain.io",
)
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def get_json(kubectl: Any, *args: str) -> dict[str, Any]:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def exists(kubectl: Any, *args: str) -> bool:
    return kubectl("get", *args, check=False).returncode == 0


def test_install_upgrade_uninstall(
    helm: Helm,
    kubectl: Any,
    kube_api: Any,
    control_plane: ControlPlane,
    namespace: str,
    release: str,
) -> None:
    full = f"{release}-posttrain"
    helm("install", release, str(CHART_DIR), "--namespace", namespace)

    # CRDs from crds/, all served.
    for crd in POSTTRAIN_CRDS:
        control_plane.wait_for_crd(kube_api, crd)
    deployment = get_json(kubectl, "deployment", f"{full}-operator", "-n", namespace)
    assert deployment["spec"]["replicas"] == 1
    assert exists(kubectl, "serviceaccount", full, "-n", namespace)
    assert exists(kubectl, "clusterrole", f"{full}-operator")
    assert exists(kubectl, "clusterrolebinding", f"{full}-operator")
    assert exists(kubectl, "service", f"{full}-minio", "-n", namespace)
    assert not exists(kubectl, "poddisruptionbudget", f"{full}-operator", "-n", namespace)
    # Leader election: the Role for the Lease, in the release's namespace. The Lease itself is
    # the operator's to create (no pod runs here).
    assert exists(kubectl, "role", f"{full}-operator-leader-election", "-n", namespace)
    assert exists(kubectl, "rolebinding", f"{full}-operator-leader-election", "-n", namespace)
    secret_before = get_json(kubectl, "secret", f"{full}-minio-credentials", "-n", namespace)

    # Our custom resources, validated by the apiserver against the installed CRD schemas.
    for example in EXAMPLES:
        result = kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))
        assert "(server dry run)" in result.stdout
    bad = kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        check=False,
        stdin=json.dumps(
            {
                "apiVersion": "posttrain.io/v1alpha1",
                "kind": "SandboxTask",
                "metadata": {"name": "bad"},
                "spec": {"command": ["true"], "timeoutSeconds": 0},
            }
        ),
    )
    assert bad.returncode != 0 and "spec.timeoutSeconds" in bad.stderr

    # Upgrade: a changed value reaches the Deployment; state that must survive does.
    helm(
        "upgrade",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--set",
        "operator.replicas=2",
        "--set",
        "operator.logLevel=DEBUG",
    )
    upgraded = get_json(kubectl, "deployment", f"{full}-operator", "-n", namespace)
    assert upgraded["spec"]["replicas"] == 2
    assert upgraded["metadata"]["generation"] > deployment["metadata"]["generation"]
    checksum = "checksum/config"
    assert (
        upgraded["spec"]["template"]["metadata"]["annotations"][checksum]
        != deployment["spec"]["template"]["metadata"]["annotations"][checksum]
    ), "a config change must roll the operator pods"
    config = get_json(kubectl, "configmap", f"{full}-operator", "-n", namespace)
    assert config["data"]["POSTTRAIN_OPERATOR_LOG_LEVEL"] == "DEBUG"
    pdb = get_json(kubectl, "poddisruptionbudget", f"{full}-operator", "-n", namespace)
    assert pdb["spec"]["minAvailable"] == 1
    secret_after = get_json(kubectl, "secret", f"{full}-minio-credentials", "-n", namespace)
    assert secret_after["data"] == secret_before["data"], "MinIO's password must never change"

    helm("uninstall", release, "--namespace", namespace, "--wait")
    assert not exists(kubectl, "deployment", f"{full}-operator", "-n", namespace)
    assert not exists(kubectl, "clusterrole", f"{full}-operator")
    assert not exists(kubectl, "role", f"{full}-operator-leader-election", "-n", namespace)
    # Helm never deletes crds/ (user TrainingRuns would go with them), nor the kept MinIO PVC.
    for crd in POSTTRAIN_CRDS:
        assert exists(kubectl, "crd", crd)
    assert exists(kubectl, "pvc", f"{full}-minio", "-n", namespace)


def test_non_default_values_install(
    helm: Helm, kubectl: Any, kube_api: Any, namespace: str, release: str
) -> None:
    """The production values file, installed for real: every object passes the apiserver."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api)
    watched = [f"{namespace}-a", f"{namespace}-b"]
    for name in watched:
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    try:
        production = next(p for p in VALUES_FILES if p.stem == "production")
        helm(
            "install",
            release,
            str(CHART_DIR),
            "--namespace",
            namespace,
            "-f",
            str(production),
            "--set",
            "operator.watchNamespaces={" + ",".join(watched) + "}",
        )
        full = f"{release}-posttrain"
        deployment = get_json(kubectl, "deployment", f"{full}-operator", "-n", namespace)
        assert deployment["spec"]["replicas"] == 3
        pod = deployment["spec"]["template"]["spec"]
        assert pod["imagePullSecrets"] == [{"name": "regcred"}]
        assert exists(kubectl, "poddisruptionbudget", f"{full}-operator", "-n", namespace)
        assert exists(kubectl, "role", f"{full}-operator-leader-election", "-n", namespace)
        for name in watched:
            assert exists(kubectl, "role", f"{full}-operator", "-n", name)
            assert exists(kubectl, "networkpolicy", f"{full}-sandbox-default-deny", "-n", name)
        helm("uninstall", release, "--namespace", namespace, "--wait")
    finally:
        for name in watched:
            core.delete_namespace(name)
