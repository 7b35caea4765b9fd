"""KubeRay's operator and Kueue on the real node, as processes beside the other components.

Both are built unmodified from their pinned Go modules by tools/ensure-binaries.sh (KubeRay
``github.com/ray-project/kuberay/ray-operator``, its main package; Kueue ``sigs.k8s.io/kueue``
``cmd/kueue``) and talk to the apiserver with the admin kubeconfig, out of cluster, as a
controller run from a laptop does. Their CRDs come from the same modules (the Go module
cache keeps them), so the schema the controllers serve is the one they were built with.

Kueue needs its webhooks: the CRDs of its v1beta1/v1beta2 kinds convert through Kueue's
``/convert``, and its defaulting and validation run as admission webhooks. They are installed
as Kueue's own manifests (``config/components/webhook``) with the names kustomize gives them
(``kueue-`` prefix, namespace ``kueue-system``), keeping only the webhooks of Kueue's own
kinds: the pod, Deployment and StatefulSet webhooks would put every pod of the node behind a
process the tests start and stop. The Service ``kueue-webhook-service`` has no selector; an
EndpointSlice points it at the node's address, where the Kueue process serves its webhooks.
Kueue's internal certificate management (on by default) issues the serving certificate for
``kueue-webhook-service.kueue-system.svc`` into its Secret and writes its CA into the webhook
configurations and the CRDs' conversion settings, as it does in a cluster; the one step a
kubelet would do, projecting that Secret into Kueue's cert dir, is done here
(:func:`_project_cert_secret`).
"""

from __future__ import annotations

import base64
import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import yaml

from posttrain.processes import ManagedProcess, free_port, http_ok

from ..binaries import client_binary, go_binary, pinned_versions

log = logging.getLogger(__name__)

KUEUE_NAMESPACE = "kueue-system"
KUEUE_WEBHOOK_SERVICE = "kueue-webhook-service"
KUEUE_CERT_SECRET = "kueue-webhook-server-cert"
KUEUE_GROUP = "kueue.x-k8s.io"


def module_dir(module: str, version: str) -> Path:
    """Where the Go module cache holds ``module@version`` (downloaded if missing)."""
    out = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout  # fmt: skip
    return Path(json.loads(out)["Dir"])


def kuberay_crds() -> list[Path]:
    root = module_dir(
        "github.com/ray-project/kuberay/ray-operator", pinned_versions()["KUBERAY_VERSION"]
    )
    return sorted((root / "config" / "crd" / "bases").glob("ray.io_*.yaml"))


def _kueue_root() -> Path:
    return module_dir("sigs.k8s.io/kueue", pinned_versions()["KUEUE_VERSION"])


def kueue_manifests(node_ip: str, webhook_port: int) -> list[dict[str, Any]]:
    """Kueue's CRDs (conversion through its webhook), namespace, webhook Service with an
    EndpointSlice at ``node_ip:webhook_port``, and its webhook configurations (Kueue's own
    kinds only): what ``config/default`` renders, for a Kueue that runs outside the cluster."""
    root = _kueue_root() / "config" / "components"
    service_ref = {"name": KUEUE_WEBHOOK_SERVICE, "namespace": KUEUE_NAMESPACE}
    converted = {"localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters"}
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KUEUE_NAMESPACE}}
    ]
    for path in sorted((root / "crd" / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in converted:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {"clientConfig": {"service": {**service_ref, "path": "/convert"}},
                            "conversionReviewVersions": ["v1"]},
            }  # fmt: skip
        out.append(crd)
    out.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": KUEUE_WEBHOOK_SERVICE, "namespace": KUEUE_NAMESPACE},
        "spec": {"ports": [{"name": "https", "port": 443, "protocol": "TCP",
                            "targetPort": webhook_port}]},
    })  # fmt: skip
    out.append({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{KUEUE_WEBHOOK_SERVICE}-node", "namespace": KUEUE_NAMESPACE,
                     "labels": {"kubernetes.io/service-name": KUEUE_WEBHOOK_SERVICE}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [node_ip], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": webhook_port, "protocol": "TCP"}],
    })  # fmt: skip
    # config/components/internalcert: the Secret Kueue's certificate rotator fills in.
    out.append({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": KUEUE_CERT_SECRET, "namespace": KUEUE_NAMESPACE}})  # fmt: skip
    for doc in yaml.safe_load_all((root / "webhook" / "manifests.yaml").read_text()):
        if not doc:
            continue
        doc["metadata"]["name"] = f"kueue-{doc['metadata']['name']}"
        doc["webhooks"] = [
            {**hook, "clientConfig": {"service": {**service_ref,
                                                  "path": hook["clientConfig"]["service"]["path"]}}}
            for hook in doc["webhooks"]
            if all(rule["apiGroups"] == [KUEUE_GROUP] for rule in hook["rules"])
        ]  # fmt: skip
        out.append(doc)
    return out


def kueue_config(workdir: Path, health_port: int, webhook_port: int, node_ip: str) -> Path:
    """Kueue's Configuration: Kueue's defaults, out of cluster (no leader election, metrics
    off, certificates in ``workdir``), no job integrations (the operator creates Workloads
    itself: Kueue's external-framework pattern)."""
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": webhook_port, "host": node_ip, "certDir": str(workdir / "certs")},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": True, "webhookServiceName": KUEUE_WEBHOOK_SERVICE,
                                   "webhookSecretName": KUEUE_CERT_SECRET},
        "integrations": {"frameworks": ["batch/job"]},
    }  # fmt: skip
    path = workdir / "kueue-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def apply(kubeconfig: Path, manifests: list[dict[str, Any]] | list[Path]) -> None:
    """Server-side apply (the CRDs are too large for the last-applied annotation)."""
    kubectl = str(client_binary("kubectl"))
    for item in manifests:
        args = ["-f", str(item)] if isinstance(item, Path) else ["-f", "-"]
        text = None if isinstance(item, Path) else yaml.safe_dump(item)
        result = subprocess.run(
            [kubectl, "--kubeconfig", str(kubeconfig), "apply", "--server-side",
             "--force-conflicts", *args],
            input=text, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"kubectl apply failed: {result.stderr[-2000:]}")
    # A controller started before its CRDs are served fails its first watches.
    crds = [f"crd/{name}" for name in _applied_crds(manifests)]
    if crds:
        subprocess.run(
            [kubectl, "--kubeconfig", str(kubeconfig), "wait", "--for=condition=Established",
             "--timeout=120s", *crds],
            capture_output=True, text=True, timeout=150, check=True,
        )  # fmt: skip


def _applied_crds(manifests: list[dict[str, Any]] | list[Path]) -> list[str]:
    names = []
    for item in manifests:
        docs = yaml.safe_load_all(item.read_text()) if isinstance(item, Path) else [item]
        names += [
            d["metadata"]["name"] for d in docs if d and d["kind"] == "CustomResourceDefinition"
        ]
    return names


def kuberay_process(workdir: Path, kubeconfig: Path) -> ManagedProcess:
    """KubeRay's operator: RayCluster, RayJob and RayService controllers, no webhooks."""
    health = free_port()
    return ManagedProcess(
        name="kuberay-operator",
        command=[
            str(go_binary("kuberay-operator")),
            "--enable-leader-election=false",
            f"--health-probe-bind-address=127.0.0.1:{health}",
            "--metrics-addr=0",
            "--log-stdout-encoder=console",
        ],
        log_path=workdir / "kuberay-operator.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{health}/readyz"),
        env={"KUBECONFIG": str(kubeconfig)},
    )


def kueue_process(workdir: Path, kubeconfig: Path, node_ip: str) -> ManagedProcess:
    """Kueue's controller manager; its webhooks on ``node_ip`` (see the module docstring)."""
    health, webhook = free_port(), free_port()
    (workdir / "certs").mkdir(parents=True, exist_ok=True)
    apply(kubeconfig, kueue_manifests(node_ip, webhook))
    config = kueue_config(workdir, health, webhook, node_ip)
    certs = workdir / "certs"
    return ManagedProcess(
        name="kueue",
        # VisibilityOnDemand serves Kueue's visibility API as an aggregated apiserver, whose
        # delegated authentication needs an in-cluster config: out of cluster Kueue exits
        # ("Unable to create and start visibility server") seconds after it is ready.
        command=[
            str(go_binary("kueue")),
            f"--config={config}",
            "--zap-log-level=2",
            "--feature-gates=VisibilityOnDemand=false",
        ],
        log_path=workdir / "kueue.log",
        ready=lambda: (
            _project_cert_secret(kubeconfig, certs) and http_ok(f"http://127.0.0.1:{health}/readyz")
        ),
        env={"KUBECONFIG": str(kubeconfig)},
    )


def _project_cert_secret(kubeconfig: Path, certs: Path) -> bool:
    """Do what the kubelet does for Kueue's pod: write the certificate Secret's keys as files
    into the cert dir. Kueue's rotator fills the Secret and then waits until the mounted
    files match it; out of cluster nothing mounts them. True once the files are there."""
    if (certs / "tls.key").exists():
        return True
    result = subprocess.run(
        [str(client_binary("kubectl")), "--kubeconfig", str(kubeconfig), "get", "secret",
         KUEUE_CERT_SECRET, "-n", KUEUE_NAMESPACE, "-o", "json"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    data = json.loads(result.stdout).get("data") or {} if result.returncode == 0 else {}
    if not {"tls.crt", "tls.key", "ca.crt"} <= data.keys():
        return False
    for name in ("ca.crt", "tls.crt", "tls.key"):  # the key last: it marks completion
        (certs / name).write_bytes(base64.b64decode(data[name]))
    (certs / "tls.key").chmod(0o600)
    return True
