"""The node's upstream components as processes: kubelet, kube-scheduler,
kube-controller-manager, kube-proxy and CoreDNS (all built from pinned Go modules by
tools/ensure-binaries.sh).

kube-proxy and CoreDNS run on the host, as a kind node runs them in host-network pods: CoreDNS
answers on the node's address (the kubelet's ``clusterDNS``) for ``cluster.local`` and
nothing else, so a pod resolves Services and pods by name and no name outside the cluster.
The kubelet's settings are the ones this machine needs (see :func:`kubelet_config`).
"""

from __future__ import annotations

import base64
import ssl
from pathlib import Path
from typing import Any

import yaml

from posttrain.processes import ManagedProcess, free_port, http_ok

from ..binaries import go_binary

NODE_NAME = "posttrain-node"
CLUSTER_DOMAIN = "cluster.local"


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path, user: str) -> Path:
    """A kubeconfig for one component's client certificate."""

    def b64(file: Path) -> str:
        return base64.b64encode(file.read_bytes()).decode()

    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "posttrain-dev", "cluster": {
            "server": server, "certificate-authority-data": b64(ca)}}],
        "users": [{"name": user, "user": {
            "client-certificate-data": b64(cert), "client-key-data": b64(key)}}],
        "contexts": [{"name": "default", "context": {"cluster": "posttrain-dev", "user": user}}],
        "current-context": "default",
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _insecure_tls() -> ssl.SSLContext:
    """The components' self-signed serving certs: their /healthz is probed, not trusted."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def kubelet_config(
    *,
    root: Path,
    ca: Path,
    serving_cert: Path,
    serving_key: Path,
    runtime_endpoint: str,
    cluster_dns: str,
    port: int,
    healthz_port: int,
) -> dict[str, Any]:
    """KubeletConfiguration for this machine.

    cgroup v1 (hybrid) with cgroupfs; no node-allocatable enforcement, no eviction and no image
    GC (a laptop's disk is not the node's to manage); oomScoreAdj 0 and no kernel-defaults
    check (root here lacks CAP_SYS_RESOURCE); ``makeIPTablesUtilChains: false`` (else kubelet
    adds a KUBE-FIREWALL DROP for 127/8 every minute); webhook authn/authz against the cluster
    CA, so ``kubectl logs``/``exec`` go through the apiserver's RBAC.

    >>> c = kubelet_config(root=Path("/k"), ca=Path("/ca"), serving_cert=Path("/c"),
    ...                    serving_key=Path("/k.key"), runtime_endpoint="unix:///c.sock",
    ...                    cluster_dns="10.244.0.1", port=1, healthz_port=2)
    >>> c["clusterDNS"], c["failCgroupV1"], c["authorization"]["mode"]
    (['10.244.0.1'], False, 'Webhook')
    """
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": True,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
        "oomScoreAdj": 0,
        "readOnlyPort": 0,
        "port": port,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "address": "0.0.0.0",
        "tlsCertFile": str(serving_cert),
        "tlsPrivateKeyFile": str(serving_key),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        "evictionHard": {},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "podLogsDir": str(root / "pod-logs"),
        "volumePluginDir": str(root / "volume-plugins"),
        "containerRuntimeEndpoint": runtime_endpoint,
        "clusterDNS": [cluster_dns],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "",
        "serializeImagePulls": False,
        "maxPods": 110,
        "staticPodPath": "",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "nodeStatusUpdateFrequency": "5s",
        "runtimeRequestTimeout": "10m",
        "shutdownGracePeriod": "0s",
    }


def kubelet_process(
    workdir: Path, kubeconfig: Path, config: dict[str, Any], node_ip: str
) -> ManagedProcess:
    config_path = workdir / "kubelet-config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    healthz = f"http://127.0.0.1:{config['healthzPort']}/healthz"
    return ManagedProcess(
        name="kubelet",
        command=[
            str(go_binary("kubelet")),
            f"--config={config_path}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={workdir / 'root'}",
            f"--cert-dir={workdir / 'pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={node_ip}",
            "--v=1",
        ],
        log_path=workdir / "kubelet.log",
        ready=lambda: http_ok(healthz),
    )


def _control_plane_component(
    name: str, workdir: Path, kubeconfig: Path, flags: list[str]
) -> ManagedProcess:
    """kube-scheduler or kube-controller-manager: the admin kubeconfig, one replica (no leader
    election), its secure port on loopback with a self-signed certificate, probed at /healthz."""
    port = free_port()
    return ManagedProcess(
        name=name,
        command=[
            str(go_binary(name)),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            f"--cert-dir={workdir / f'{name}-certs'}",
            "--leader-elect=false",
            "--v=1",
            *flags,
        ],
        log_path=workdir / f"{name}.log",
        ready=lambda: http_ok(f"https://127.0.0.1:{port}/healthz", _insecure_tls()),
    )


def scheduler_process(workdir: Path, kubeconfig: Path) -> ManagedProcess:
    return _control_plane_component("kube-scheduler", workdir, kubeconfig, [])


def controller_manager_process(
    workdir: Path, kubeconfig: Path, ca: Path, ca_key: Path, sa_key: Path
) -> ManagedProcess:
    """Every default controller but node IPAM (CNI's host-local hands out pod addresses):
    Deployments, ReplicaSets, Jobs, the garbage collector, ServiceAccount tokens, the
    ``kube-root-ca.crt`` ConfigMap projected tokens need, and the CSR signer."""
    return _control_plane_component(
        "kube-controller-manager",
        workdir,
        kubeconfig,
        [
            "--controllers=*,-nodeipam",
            f"--root-ca-file={ca}",
            f"--service-account-private-key-file={sa_key}",
            f"--cluster-signing-cert-file={ca}",
            f"--cluster-signing-key-file={ca_key}",
            "--use-service-account-credentials=true",
        ],
    )


def kube_proxy_process(workdir: Path, kubeconfig: Path, pod_cidr: str) -> ManagedProcess:
    """iptables mode; conntrack sysctls left alone (root here may not raise them)."""
    healthz = free_port()
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NODE_NAME,
        "clusterCIDR": pod_cidr,
        "healthzBindAddress": f"127.0.0.1:{healthz}",
        "metricsBindAddress": f"127.0.0.1:{free_port()}",
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                      "tcpCloseWaitTimeout": "0s"},
        # No NodePorts on 127.0.0.1: otherwise kube-proxy sets route_localnet and adds a
        # KUBE-FIREWALL DROP for 127/8 to the host's INPUT and OUTPUT chains.
        "iptables": {"masqueradeAll": False, "syncPeriod": "10s", "minSyncPeriod": "0s",
                     "localhostNodePorts": False},
    }  # fmt: skip
    path = workdir / "kube-proxy-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return ManagedProcess(
        name="kube-proxy",
        command=[str(go_binary("kube-proxy")), f"--config={path}", "--v=1"],
        log_path=workdir / "kube-proxy.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{healthz}/healthz"),
    )


def corefile(kubeconfig: Path, address: str, health_port: int) -> str:
    """CoreDNS: the cluster's names from the apiserver; every other name NXDOMAIN.

    >>> "kubernetes cluster.local" in corefile(Path("/k"), "10.244.0.1", 8181)
    True
    """
    return f"""cluster.local in-addr.arpa ip6.arpa {{
    bind {address}
    errors
    health 127.0.0.1:{health_port}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
. {{
    bind {address}
    template ANY ANY {{
        rcode NXDOMAIN
    }}
}}
"""


def coredns_process(workdir: Path, kubeconfig: Path, address: str) -> ManagedProcess:
    health = free_port()
    path = workdir / "Corefile"
    path.write_text(corefile(kubeconfig, address, health))
    return ManagedProcess(
        name="coredns",
        command=[str(go_binary("coredns")), "-conf", str(path)],
        log_path=workdir / "coredns.log",
        ready=lambda: http_ok(f"http://127.0.0.1:{health}/health"),
    )
