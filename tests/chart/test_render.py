"""The chart without a cluster: lint, render, Kubernetes 1.36 schema validation, and the
behaviours values switch on and off (PDB, leader election, namespaced RBAC, ServiceMonitor, schema)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from posttrain.operator.config import ENV_PREFIX, OperatorConfig

from .conftest import CHART_DIR, VALUES_FILES, Render, by_kind, one, run_helm

K8S_VERSION = "1.36.0"
CASES = [None, *VALUES_FILES]
CASE_IDS = ["defaults", *(p.stem for p in VALUES_FILES)]
# Kinds kubernetes-validate has no schema for; they are checked against the real apiserver
# (server-side dry-run) in test_install.py, or structurally below.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor"}
# OperatorConfig fields the chart sets ahead of the operator: GPU placement, pull secrets and the
# default sandbox RuntimeClass are chart values the operator must put on the pods it creates.
# Listed here so that a renamed field fails this test instead of being silently ignored.
PENDING_OPERATOR_FIELDS = {
    "log_level",
    "image_pull_secrets",
    "trainer_node_selector",
    "trainer_tolerations",
    "trainer_affinity",
    "rollout_node_selector",
    "rollout_tolerations",
    "rollout_affinity",
    "sandbox_runtime_class_name",
}


def values_args(case: Path | None) -> list[Path]:
    return [case] if case else []


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_lint_strict(helm_bin: Path, case: Path | None) -> None:
    args = ["lint", "--strict", str(CHART_DIR)]
    if case:
        args += ["-f", str(case)]
    result = run_helm(helm_bin, *args)
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rendered_objects_validate_against_k8s_schemas(render: Render, case: Path | None) -> None:
    objects = render(values_args(case), api_versions=["monitoring.coreos.com/v1"])
    checked = []
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        # strict: unknown fields are errors, as with `kubectl apply --validate=strict`.
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        checked.append(obj["kind"])
    assert {"Deployment", "ServiceAccount", "ConfigMap", "CustomResourceDefinition"} <= set(checked)


def test_default_install_has_every_piece(render: Render) -> None:
    objects = render()
    crds = {o["metadata"]["name"] for o in by_kind(objects, "CustomResourceDefinition")}
    assert crds == {
        "trainingruns.posttrain.io",
        "rolloutpools.posttrain.io",
        "sandboxtasks.posttrain.io",
        "sandboxwarmpools.posttrain.io",
    }
    # The CRDs are the files in crds/, unchanged (Helm never templates that directory).
    for path in sorted((CHART_DIR / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if crd:
                assert crd in objects, f"{path.name}: {crd['metadata']['name']} changed"
    assert not [o for o in objects if o["apiVersion"].startswith("kopf.dev")]
    # Leader election: a Role for the Lease in the release's namespace only.
    (role,) = by_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "posttrain-system"
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "verbs": ["create", "get", "update"],
        }
    ]
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == one(objects, "ServiceAccount")["metadata"]["name"]
    data = one(objects, "ConfigMap", "-operator")["data"]
    assert data["POSTTRAIN_OPERATOR_STANDALONE"] == "false"
    assert data["POSTTRAIN_OPERATOR_LEASE_NAME"] == "rel-posttrain"
    assert operator_config_from(data).lease_namespace == "posttrain-system"
    assert not by_kind(objects, "PodDisruptionBudget"), "a single replica gets no PDB"
    assert not by_kind(objects, "ServiceMonitor"), "no ServiceMonitor unless enabled"
    # Evaluation MinIO: pinned image, PVC kept on uninstall, generated Secret.
    minio = one(objects, "Deployment", "-minio")
    image = minio["spec"]["template"]["spec"]["containers"][0]["image"]
    assert re.fullmatch(r"quay\.io/minio/minio:RELEASE\.[0-9TZ-]+", image), image
    assert one(objects, "PersistentVolumeClaim")["metadata"]["annotations"] == {
        "helm.sh/resource-policy": "keep"
    }
    secret = one(objects, "Secret", "-minio-credentials")
    assert set(secret["data"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_operator_pod_is_restricted_and_probed(render: Render) -> None:
    deployment = one(render(), "Deployment", "-operator")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/posttrain/operator:0.1.0"  # tag = appVersion
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    health_port = {p["name"]: p["containerPort"] for p in container["ports"]}["health"]
    assert health_port == 8080
    assert container["resources"]["limits"]["memory"]
    env_names = {e["name"] for e in container["env"]}
    assert "POD_NAME" in env_names, "the Lease identity must be the pod name"
    assert container["command"] == ["posttrain", "operator"]


def operator_config_from(data: dict[str, str]) -> OperatorConfig:
    """The OperatorConfig the operator builds from the ConfigMap's variables it reads."""
    known = {
        k.removeprefix(ENV_PREFIX).lower(): v
        for k, v in data.items()
        if k.startswith(ENV_PREFIX)
        and k.removeprefix(ENV_PREFIX).lower() in OperatorConfig.model_fields
    }
    return OperatorConfig(**known)


def test_configmap_sets_only_operator_config_fields(render: Render) -> None:
    data = one(render(), "ConfigMap", "-operator")["data"]
    set_fields = {k.removeprefix(ENV_PREFIX).lower() for k in data if k.startswith(ENV_PREFIX)}
    unknown = set_fields - set(OperatorConfig.model_fields) - PENDING_OPERATOR_FIELDS
    assert not unknown, f"the chart sets variables OperatorConfig does not read: {unknown}"
    # The values the operator does read load into a valid config.
    config = operator_config_from(data)
    assert config.all_namespaces and config.liveness_port == 8080
    assert config.s3_endpoint == "rel-posttrain-minio.posttrain-system.svc:9000"
    assert config.trainer_image == "ghcr.io/posttrain/trainer:0.1.0"
    assert config.vllm_image == "ghcr.io/posttrain/rollout:0.1.0"
    # An operator started without the chart creates pods from the same four images.
    images = ("trainer_image", "rollout_cpu_image", "vllm_image", "sandbox_image",
              "sandbox_runner_image", "sandbox_init_image")  # fmt: skip
    assert {f: getattr(config, f) for f in images} == {
        f: getattr(OperatorConfig(), f) for f in images
    }
    assert config.kuberay and config.sandbox_artifacts_uri == ""
    assert config.sandbox_artifacts_egress == []


def test_sandbox_artifacts_and_kuberay_values_reach_the_operator(
    render: Render, tmp_path: Path
) -> None:
    values = tmp_path / "artifacts.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "trainer": {"kuberay": False},
                "sandbox": {
                    "artifactsUri": "s3://posttrain/sandbox",
                    "artifactsEgress": [
                        {
                            "to": [{"podSelector": {"matchLabels": {"app": "minio"}}}],
                            "ports": [{"port": 9000}],
                        }
                    ],
                },
            }
        )
    )
    data = one(render([values]), "ConfigMap", "-operator")["data"]
    config = operator_config_from(data)
    assert config.sandbox_artifacts_uri == "s3://posttrain/sandbox" and not config.kuberay
    assert config.sandbox_artifacts_egress[0]["ports"] == [{"port": 9000}]


def test_artifact_egress_is_derived_with_dns_and_minio_admits_every_artifact_mover(
    render: Render, tmp_path: Path
) -> None:
    """With artifactsUri and no artifactsEgress, sandbox pods may reach DNS and the bundled
    MinIO's pods in the release namespace (the chart's and the operator's policy alike); the
    MinIO policy admits evaluator and sandbox pods as well as trainers and rollout replicas."""
    values = tmp_path / "derived.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "runNamespaces": ["team-a"],
                "sandbox": {"artifactsUri": "s3://posttrain/sandbox"},
                "trainer": {"nccl": {"NCCL_SOCKET_IFNAME": "eth0"}},
            }
        )
    )
    objects = render([values])
    data = one(objects, "ConfigMap", "-operator")["data"]
    config = operator_config_from(data)
    assert config.trainer_nccl == {"NCCL_SOCKET_IFNAME": "eth0"}
    dns, store = config.sandbox_artifacts_egress
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    (peer,) = store["to"]
    release_namespace = peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert release_namespace == "posttrain-system"
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "minio"
    policies = by_kind(objects, "NetworkPolicy")
    (chart_deny,) = [p for p in policies if p["metadata"]["name"].endswith("sandbox-default-deny")]
    assert chart_deny["metadata"]["namespace"] == "team-a"
    assert chart_deny["spec"]["egress"] == config.sandbox_artifacts_egress
    minio = next(p for p in policies if p["metadata"]["name"].endswith("-minio"))
    selector = minio["spec"]["ingress"][0]["from"][1]["podSelector"]["matchExpressions"][0]
    assert set(selector["values"]) == {"trainer", "rollout", "evaluator", "sandbox"}


def test_production_values(render: Render) -> None:
    production = next(p for p in VALUES_FILES if p.stem == "production")
    objects = render([production], api_versions=["monitoring.coreos.com/v1"])
    deployment = one(objects, "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 3
    assert one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 2
    assert one(objects, "ServiceMonitor")["spec"]["endpoints"][0]["interval"] == "15s"
    assert not [o for o in objects if "minio" in o["metadata"]["name"]]
    data = one(objects, "ConfigMap", "-operator")["data"]
    assert data["POSTTRAIN_OPERATOR_NAMESPACES"] == "ml-team-a,ml-team-b"
    assert data["POSTTRAIN_OPERATOR_S3_CREDENTIALS_SECRET"] == "posttrain-s3"
    assert (
        yaml.safe_load(data["POSTTRAIN_OPERATOR_TRAINER_TOLERATIONS"])[0]["key"] == "nvidia.com/gpu"
    )
    assert data["POSTTRAIN_OPERATOR_SANDBOX_RUNTIME_CLASS_NAME"] == "gvisor"
    # Namespaced mode: Roles only in the watched namespaces, nothing namespaced cluster-wide.
    # (And the leader election's Role in the release's own namespace.)
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == [
        "ml-team-a",
        "ml-team-b",
        "posttrain-system",
    ]
    # The one cluster-scoped read: Kueue's ResourceFlavors (their node labels go on the pods).
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert cluster_role["rules"] == [
        {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors"], "verbs": ["get"]}
    ]
    assert data["POSTTRAIN_OPERATOR_LEASE_NAME"] == "posttrain-prod"
    deny = [o for o in by_kind(objects, "NetworkPolicy") if o["metadata"]["name"].endswith("deny")]
    assert {o["metadata"]["namespace"] for o in deny} == {"ml-team-a", "ml-team-b"}


def test_service_monitor_needs_prometheus_operator(render: Render) -> None:
    sets = {"metrics.serviceMonitor.enabled": "true"}
    assert not by_kind(render(sets=sets), "ServiceMonitor")
    assert by_kind(render(sets=sets, api_versions=["monitoring.coreos.com/v1"]), "ServiceMonitor")


def test_leader_election_off_removes_its_role(render: Render) -> None:
    objects = render(sets={"operator.leaderElection.enabled": "false"})
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
    rules = one(objects, "ClusterRole")["rules"]
    assert not [r for r in rules if "coordination.k8s.io" in r["apiGroups"]]
    data = one(objects, "ConfigMap", "-operator")["data"]
    assert data["POSTTRAIN_OPERATOR_STANDALONE"] == "true"


def test_no_wildcards_in_any_rule(render: Render) -> None:
    for case in CASES:
        for role in [o for o in render(values_args(case)) if o["kind"] in ("Role", "ClusterRole")]:
            for rule in role["rules"]:
                flat = rule["apiGroups"] + rule["resources"] + rule["verbs"]
                assert "*" not in flat, f"wildcard in {role['metadata']['name']}: {rule}"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"operator.replicas": "0"}, "at '/operator/replicas': minimum: got 0, want 1"),
        ({"operator.logLevel": "LOUD"}, "at '/operator/logLevel': value must be one of"),
        ({"operator.replicaCount": "2"}, "additional properties 'replicaCount' not allowed"),
        ({"storage.bucket": "Bad_Bucket"}, "at '/storage/bucket'"),
        ({"operator.watchNamespaces[0]": "Not-A-Namespace"}, "at '/operator/watchNamespaces/0'"),
        # Cross-field checks the schema cannot express fail in the templates, with the fix.
        (
            {"operator.replicas": "2", "operator.leaderElection.enabled": "false"},
            "operator.replicas > 1 needs operator.leaderElection.enabled=true",
        ),
        ({"minio.enabled": "false"}, "no object storage: set storage.endpoint"),
        (
            {"minio.enabled": "false", "storage.endpoint": "minio.example:9000"},
            "storage.existingSecret is required with storage.endpoint",
        ),
        (
            {
                "minio.enabled": "false",
                "storage.endpoint": "s3.example:443",
                "storage.existingSecret": "s3",
                "sandbox.artifactsUri": "s3://bucket/sandbox",
            },
            "needs networkPolicy.s3CIDRs",
        ),
        ({"trainer.nccl.LD_PRELOAD": "x.so"}, "'LD_PRELOAD' does not match pattern '^NCCL_"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_error(
    helm_bin: Path, sets: dict[str, str], message: str
) -> None:
    args = ["template", "rel", str(CHART_DIR)]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    result = run_helm(helm_bin, *args, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def _names(objects: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(o["kind"], o["metadata"]["name"]) for o in objects}


def test_run_namespaces_get_credentials_and_sandbox_deny(render: Render, tmp_path: Path) -> None:
    evaluation = next(p for p in VALUES_FILES if p.stem == "evaluation")
    objects = render([evaluation])
    secrets = by_kind(objects, "Secret")
    # Scoped credentials (the default): MinIO's admin keys stay in the release namespace.
    assert {s["metadata"]["namespace"] for s in secrets} == {"posttrain-system"}
    shared = tmp_path / "shared.yaml"
    shared.write_text("storage:\n  scopedCredentials: false\n")
    secrets = by_kind(render([evaluation, shared]), "Secret")
    assert {s["metadata"]["namespace"] for s in secrets} == {"posttrain-system", "posttrain-demo"}
    # One generated password, the same in every copy.
    assert len({s["data"]["AWS_SECRET_ACCESS_KEY"] for s in secrets}) == 1
    assert not by_kind(objects, "NetworkPolicy")  # networkPolicy.enabled=false
    assert ("Service", "rel-posttrain-operator-metrics") not in _names(objects)
