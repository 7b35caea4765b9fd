"""The chart's RBAC is enough for the operator and no broader, proven against the real
apiserver: impersonated `kubectl auth can-i` for every rule in posttrain.operator.rbac and for
what the operator must never do, then the real operator running on a token of the chart's
ServiceAccount, reconciling the examples without a single Forbidden."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.operator.config import load_config
from posttrain.operator.rbac import LEADER_ELECTION_RULES, OPERATOR_RULES
from posttrain.operator.runtime import OperatorThread

from .conftest import CHART_DIR, REPO_ROOT, Helm

pytestmark = pytest.mark.cluster

CLUSTER_SCOPED = {"resourceflavors"}
# What a compromised or buggy operator must not be able to do.
FORBIDDEN_EVERYWHERE = [
    ("list", "secrets", ""),
    ("get", "secrets", ""),
    ("watch", "secrets", ""),
    ("create", "pods", "exec"),
    ("create", "pods", "attach"),
    ("create", "pods", "portforward"),
    ("create", "serviceaccounts", "token"),
    ("create", "trainingruns.posttrain.io", ""),
    ("update", "deployments.apps", "scale"),
    ("bind", "roles.rbac.authorization.k8s.io", ""),
    ("escalate", "roles.rbac.authorization.k8s.io", ""),
    ("impersonate", "serviceaccounts", ""),
    ("*", "*", ""),
]
FORBIDDEN_CLUSTER = [
    ("create", "clusterroles.rbac.authorization.k8s.io", ""),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", ""),
    ("delete", "namespaces", ""),
    ("patch", "nodes", ""),
]


def grants(rules: list[dict[str, Any]]) -> Iterator[tuple[str, str, str, bool]]:
    """(verb, resource.group, subresource, cluster_scoped) for every verb a rule list grants."""
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                base, _, sub = resource.partition("/")
                qualified = f"{base}.{group}" if group else base
                for verb in rule["verbs"]:
                    yield verb, qualified, sub, base in CLUSTER_SCOPED


def can_i(
    kubectl: Any, sa: str, verb: str, resource: str, sub: str = "", ns: str | None = None
) -> bool:
    base, _, group = resource.partition(".")
    if group in OPTIONAL_API_GROUPS:
        return review(kubectl, sa, verb, base, group, sub, ns)
    args = ["auth", "can-i", verb, resource, f"--as={sa}"]
    if sub:
        args.append(f"--subresource={sub}")
    args += ["-n", ns] if ns else []
    result = kubectl(*args, check=False)
    assert result.stdout.strip() in ("yes", "no"), result.stderr
    return result.stdout.strip() == "yes"


# Groups of CRDs that may not be installed when this test runs (KubeRay's; Kueue's, which only
# the Kueue tests install into the shared control plane): `kubectl auth can-i` cannot map their
# resources through discovery, so these grants are asked as a SubjectAccessReview that names the
# group explicitly (still sent by the real kubectl, answered by the apiserver). Asking this way
# keeps the answer independent of which test ran first.
OPTIONAL_API_GROUPS = {"ray.io", "kueue.x-k8s.io"}


def review(
    kubectl: Any, sa: str, verb: str, resource: str, group: str, sub: str, ns: str | None
) -> bool:
    attributes: dict[str, str] = {"verb": verb, "group": group, "resource": resource}
    if sub:
        attributes["subresource"] = sub
    if ns:
        attributes["namespace"] = ns
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": sa,
            "groups": ["system:serviceaccounts"],
            "resourceAttributes": attributes,
        },
    }
    out = kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps(body)).stdout
    return bool(json.loads(out)["status"].get("allowed"))


def test_cluster_wide_rbac_is_sufficient_and_narrow(
    helm: Helm, kubectl: Any, namespace: str, release: str
) -> None:
    helm("install", release, str(CHART_DIR), "--namespace", namespace)
    sa = f"system:serviceaccount:{namespace}:{release}-posttrain"
    anywhere = "some-user-namespace"
    needed = list(grants(OPERATOR_RULES))
    missing = [
        g for g in needed if not can_i(kubectl, sa, g[0], g[1], g[2], None if g[3] else anywhere)
    ]
    assert not missing, f"the operator's ServiceAccount lacks {missing}"
    # Leader election: its Lease in the release's namespace, and nowhere else.
    for verb, resource, sub, _ in grants(LEADER_ELECTION_RULES):
        assert can_i(kubectl, sa, verb, resource, sub, namespace), (verb, resource)
        assert not can_i(kubectl, sa, verb, resource, sub, anywhere), (verb, resource, anywhere)
    allowed = [
        (verb, res, sub)
        for verb, res, sub in FORBIDDEN_EVERYWHERE
        if can_i(kubectl, sa, verb, res, sub, anywhere) or can_i(kubectl, sa, verb, res, sub)
    ]
    allowed += [(v, r, s) for v, r, s in FORBIDDEN_CLUSTER if can_i(kubectl, sa, v, r, s)]
    assert not allowed, f"the operator's ServiceAccount may do more than it needs: {allowed}"


def write_token_kubeconfig(
    kubectl: Any, admin_kubeconfig: Path, namespace: str, sa: str, path: Path
) -> Path:
    """A kubeconfig that authenticates as ``sa`` with a TokenRequest token (as a pod would)."""
    token = kubectl("create", "token", sa, "-n", namespace, "--duration=30m").stdout.strip()
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": sa, "user": {"token": token}}],
                "contexts": [{"name": sa, "context": {"cluster": cluster["name"], "user": sa}}],
                "current-context": sa,
            }
        )
    )
    return path


def rbac_denials(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Log lines where the apiserver refused the operator for lack of permission."""
    return [r.getMessage() for r in caplog.records if "forbidden: User" in r.getMessage()]


def wait_exists(
    kubectl: Any, caplog: pytest.LogCaptureFixture, *args: str, timeout_s: float = 60.0
) -> dict[str, Any]:
    """The object, once it exists; fails at once (with the reason) when RBAC denied something."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = kubectl("get", *args, "-o", "json", check=False)
        if result.returncode == 0:
            return json.loads(result.stdout)  # type: ignore[no-any-return]
        denied = rbac_denials(caplog)
        assert not denied, f"RBAC denied the operator: {denied[:3]}"
        assert time.monotonic() < deadline, f"{args} not created within {timeout_s} s"
        time.sleep(0.2)


def test_operator_runs_on_its_service_account_token(
    helm: Helm,
    kubectl: Any,
    kubeconfig: Path,
    namespace: str,
    release: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Namespaced mode (Roles only), leader election on: the operator takes its Lease and
    reconciles all three examples."""
    helm(
        "install",
        release,
        str(CHART_DIR),
        "--namespace",
        namespace,
        "--set",
        f"operator.watchNamespaces={{{namespace}}}",
    )
    full = f"{release}-posttrain"
    sa = f"system:serviceaccount:{namespace}:{full}"
    assert can_i(kubectl, sa, "create", "pods", ns=namespace)
    assert not can_i(kubectl, sa, "create", "pods", ns="kube-system"), "Roles only where watched"
    assert not can_i(kubectl, sa, "list", "pods"), "no cluster-wide pod access in namespaced mode"

    # The operator's configuration is exactly what the chart's ConfigMap says, plus the token.
    chart_env = json.loads(
        kubectl("get", "configmap", f"{full}-operator", "-n", namespace, "-o", "json").stdout
    )["data"]
    token_kubeconfig = write_token_kubeconfig(
        kubectl, kubeconfig, namespace, full, tmp_path / "sa-kubeconfig"
    )
    config = load_config(
        chart_env,
        kubeconfig=str(token_kubeconfig),
        identity="op-under-test",
        liveness_port=0,
        metrics_port=0,
        resync_seconds=1.0,
        # No MinIO runs here to mint users in; the scoped path's RBAC is the Secret create the
        # pool's weight token also needs (tests/operator/test_storage_credentials_cluster.py).
        s3_scoped_credentials=False,
    )
    assert config.namespaces == (namespace,) and not config.standalone

    caplog.set_level(logging.INFO)
    with OperatorThread(config):
        for example in sorted((REPO_ROOT / "examples").glob("*.yaml")):
            kubectl("apply", "-n", namespace, "-f", str(example))
        wait_exists(kubectl, caplog, "pod", "add-two-numbers-1", "-n", namespace)  # SandboxTask
        wait_exists(kubectl, caplog, "deployment", "smollm2-pool", "-n", namespace)  # RolloutPool
        wait_exists(kubectl, caplog, "service", "smollm2-pool", "-n", namespace)
        wait_exists(kubectl, caplog, "pod", "arith-code-g0-0", "-n", namespace)  # TrainingRun
        # The per-run trainer Role is an RBAC object the operator itself creates: only allowed
        # because the operator holds every permission it grants.
        role = wait_exists(kubectl, caplog, "role", "arith-code-trainer", "-n", namespace)
        assert role["rules"][0]["resourceNames"] == ["arith-code"]
        lease = wait_exists(kubectl, caplog, "lease", full, "-n", namespace)
        assert lease["spec"]["holderIdentity"] == "op-under-test", lease

    trainer = f"system:serviceaccount:{namespace}:arith-code-trainer"
    assert can_i(
        kubectl, trainer, "patch", "trainingruns.posttrain.io/arith-code", "status", namespace
    )
    assert not can_i(
        kubectl, trainer, "patch", "trainingruns.posttrain.io/other-run", "status", namespace
    )
    assert not rbac_denials(caplog), f"RBAC denied the operator: {rbac_denials(caplog)[:3]}"
