"""An envtest-style Kubernetes control plane: real etcd + kube-apiserver, no kubelet.

Flags follow controller-runtime's envtest (etcd on loopback, RBAC authorization,
the ServiceAccount admission plugin off because no controller-manager mints
tokens, a service-account signing key, an admin client cert in system:masters).
Used by the pytest fixtures and by ``posttrain dev up``.

``for_node`` makes it the control plane of a real node (:mod:`posttrain.devenv.realnode`): the
apiserver serves on the node's address (pods reach it through the ``kubernetes`` Service),
authorizes kubelets (Node, RBAC; NodeRestriction), admits ServiceAccounts as any cluster does,
and reaches kubelets for logs and exec with a client certificate.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import shutil
import ssl
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from posttrain.processes import ManagedProcess, StartError, free_port, http_ok, port_in_use
from posttrain.telemetry import get_tracer

from .binaries import go_binary
from .certs import Pki, load_pki, make_pki

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver in ``workdir`` on free (or given) loopback ports."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="posttrain-cp-")))
    apiserver_port: int = 0
    etcd_port: int = 0
    processes: list[ManagedProcess] = field(default_factory=list)
    pki: Pki | None = None
    address: str = "127.0.0.1"
    """Where the apiserver listens and what it advertises (the node's address for a real node)."""
    service_cidr: str = "10.0.0.0/24"
    for_node: bool = False

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.apiserver_port}"

    def _admin_ssl(self) -> ssl.SSLContext:
        assert self.pki is not None
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def start(self, timeout_s: float = 120.0) -> ControlPlane:
        with tracer.start_as_current_span("controlplane.start") as span:
            for port in (self.apiserver_port, self.etcd_port):
                if port and port_in_use(port):
                    raise StartError(
                        f"port {port} on 127.0.0.1 is already in use; stop what listens there "
                        "(`ss -ltnp`) or choose another port"
                    )
            self.apiserver_port = self.apiserver_port or free_port()
            self.etcd_port = self.etcd_port or free_port()
            span.set_attribute("apiserver.port", self.apiserver_port)
            service_ip = str(ipaddress.ip_network(self.service_cidr)[1])  # `kubernetes`
            # Restarted on its old data (`dev up` after a crash or `dev down`): the same CA.
            extra_ips = (self.address, service_ip)
            pki_dir = self.workdir / "pki"
            self.pki = load_pki(pki_dir, extra_ips) or make_pki(pki_dir, extra_ips=extra_ips)
            etcd, apiserver = go_binary("etcd"), go_binary("kube-apiserver")
            peer_port = free_port()
            etcd_url = f"http://127.0.0.1:{self.etcd_port}"
            etcd_proc = ManagedProcess(
                name="etcd",
                command=[
                    str(etcd),
                    f"--data-dir={self.workdir / 'etcd'}",
                    f"--listen-client-urls={etcd_url}",
                    f"--advertise-client-urls={etcd_url}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                    f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                    "--unsafe-no-fsync=true",  # throw-away data: speed over durability
                    "--log-level=warn",
                ],
                log_path=self.workdir / "logs" / "etcd.log",
                ready=lambda: http_ok(f"{etcd_url}/health"),
            )
            pki = self.pki
            api_proc = ManagedProcess(
                name="kube-apiserver",
                command=[
                    str(apiserver),
                    f"--etcd-servers={etcd_url}",
                    f"--cert-dir={self.workdir / 'certs'}",
                    f"--tls-cert-file={pki.serving_cert}",
                    f"--tls-private-key-file={pki.serving_key}",
                    f"--client-ca-file={pki.ca_cert}",
                    f"--secure-port={self.apiserver_port}",
                    f"--bind-address={self.address}",
                    f"--advertise-address={self.address}",
                    f"--service-cluster-ip-range={self.service_cidr}",
                    "--service-account-issuer=https://kubernetes.default.svc",
                    f"--service-account-key-file={pki.sa_public}",
                    f"--service-account-signing-key-file={pki.sa_private}",
                    *self._node_flags(pki),
                    "--allow-privileged=true",
                    "--v=1",
                ],
                log_path=self.workdir / "logs" / "kube-apiserver.log",
                ready=lambda: http_ok(f"{self.server}/readyz", self._admin_ssl()),
            )
            try:
                for proc in (etcd_proc, api_proc):
                    self.processes.append(proc)
                    proc.start(timeout_s)
            except BaseException:
                self.stop(keep_logs=True)
                raise
            self._write_kubeconfig()
            log.info("control plane ready at %s (kubeconfig %s)", self.server, self.kubeconfig)
            return self

    def _node_flags(self, pki: Pki) -> list[str]:
        if not self.for_node:
            return ["--authorization-mode=RBAC", "--disable-admission-plugins=ServiceAccount"]
        return [
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--kubelet-client-certificate={pki.admin_cert}",
            f"--kubelet-client-key={pki.admin_key}",
            # The node's InternalIP, never its name: nothing resolves the node's name.
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def _write_kubeconfig(self) -> None:
        assert self.pki is not None

        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "posttrain-dev",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": b64(self.pki.ca_cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "posttrain-admin",
                    "user": {
                        "client-certificate-data": b64(self.pki.admin_cert),
                        "client-key-data": b64(self.pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "posttrain-dev",
                    "context": {"cluster": "posttrain-dev", "user": "posttrain-admin"},
                }
            ],
            "current-context": "posttrain-dev",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config))
        self.kubeconfig.chmod(0o600)

    def healthy(self) -> bool:
        return self.pki is not None and http_ok(f"{self.server}/readyz", self._admin_ssl())

    def stop(self, keep_logs: bool = False) -> None:
        """Stop apiserver then etcd; remove the workdir unless its logs are wanted."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if keep_logs:
            log.warning("control plane logs kept in %s", self.workdir / "logs")
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def wait_for_crd(self, api_client: Any, name: str, timeout_s: float = 30.0) -> None:
        """Block until a CRD is Established (its REST endpoints are served)."""
        from kubernetes import client

        ext = client.ApiextensionsV1Api(api_client)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            crd = ext.read_custom_resource_definition(name)
            conditions = (crd.status.conditions or []) if crd.status else []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                return
            time.sleep(0.2)
        raise TimeoutError(f"CRD {name} not Established after {timeout_s} s")
