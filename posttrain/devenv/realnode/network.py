"""The real node's network: its own bridge, the CNI configuration, and a fence around both.

The node's address is the gateway of a bridge that ``dev up`` creates and ``dev down``
removes (``ptbr0``, 10.244.0.1/24): kubelet refuses loopback, and an address the cluster owns
keeps every packet on this machine. Pods get addresses on that bridge from CNI's bridge and
host-local plugins (the Debian package ``containernetworking-plugins``); the apiserver, MinIO
and CoreDNS listen on the gateway address, so pods reach them directly. Service ClusterIPs
(10.96.0.0/24) are routed onto the bridge too, so kube-proxy's DNAT decides where they go and
nothing falls through to the default route. A forward rule drops any pod packet that would
leave through another interface: pods reach each other and the node, never the outside.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

BRIDGE = "ptbr0"
POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"
SERVICE_CIDR = "10.96.0.0/24"
FORWARD_CHAIN = "POSTTRAIN-FORWARD"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_NETWORK = "posttrain"


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, check=check)


def _sysctl(key: str, value: str) -> None:
    path = Path("/proc/sys") / key.replace(".", "/")
    if path.read_text().strip() != value:
        path.write_text(value)


@dataclass(frozen=True)
class NodeNetwork:
    """Addresses of the node and where its CNI configuration lives."""

    cni_conf_dir: Path
    cni_state_dir: Path
    bridge: str = BRIDGE
    node_ip: str = NODE_IP
    pod_cidr: str = POD_CIDR
    service_cidr: str = SERVICE_CIDR

    @property
    def prefix_len(self) -> int:
        return ipaddress.ip_network(self.pod_cidr).prefixlen

    def conflist(self) -> dict[str, object]:
        """The CNI network: bridge + host-local IPAM (gateway = the node) + portmap.

        >>> net = NodeNetwork(Path("/n"), Path("/s"))
        >>> [p["type"] for p in net.conflist()["plugins"]]
        ['bridge', 'portmap']
        >>> net.conflist()["plugins"][0]["ipam"]["ranges"]
        [[{'subnet': '10.244.0.0/24', 'gateway': '10.244.0.1'}]]
        """
        return {
            "cniVersion": "1.0.0",
            "name": CNI_NETWORK,
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    # No masquerade: pod traffic never leaves the machine (see the fence).
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr, "gateway": self.node_ip}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.cni_state_dir / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def set_up(self) -> None:
        """Bridge, routes, forwarding and the fence; idempotent."""
        missing = [p for p in ("bridge", "host-local", "portmap") if not (CNI_BIN_DIR / p).exists()]
        if missing:
            raise RuntimeError(
                f"CNI plugins {missing} are not in {CNI_BIN_DIR}: "
                "apt-get install containernetworking-plugins (make system-deps does)"
            )
        if _run("ip", "link", "show", self.bridge, check=False).returncode != 0:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
        address = f"{self.node_ip}/{self.prefix_len}"
        if address not in _run("ip", "-o", "addr", "show", "dev", self.bridge).stdout:
            _run("ip", "addr", "add", address, "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        _run("ip", "route", "replace", self.service_cidr, "dev", self.bridge)
        if not Path("/proc/sys/net/bridge").is_dir() and shutil.which("modprobe"):
            _run("modprobe", "br_netfilter", check=False)
        _sysctl("net.ipv4.ip_forward", "1")
        # Pod -> Service -> pod on the same bridge passes iptables (kube-proxy's DNAT).
        _sysctl("net.bridge.bridge-nf-call-iptables", "1")
        self._fence()
        self.cni_conf_dir.mkdir(parents=True, exist_ok=True)
        self.cni_state_dir.mkdir(parents=True, exist_ok=True)
        (self.cni_conf_dir / f"10-{CNI_NETWORK}.conflist").write_text(
            json.dumps(self.conflist(), indent=2)
        )

    def _fence(self) -> None:
        if _run("iptables", "-n", "-L", FORWARD_CHAIN, check=False).returncode != 0:
            _run("iptables", "-N", FORWARD_CHAIN)
        _run("iptables", "-F", FORWARD_CHAIN)
        _run("iptables", "-A", FORWARD_CHAIN, "-s", self.pod_cidr, "!", "-o", self.bridge,
             "-j", "DROP")  # fmt: skip
        _run("iptables", "-A", FORWARD_CHAIN, "-d", self.pod_cidr, "!", "-i", self.bridge,
             "-j", "DROP")  # fmt: skip
        self.fence_first()

    def fence_first(self) -> None:
        """Put the fence's jump at the head of FORWARD again (kube-proxy prepends its chains,
        whose RELATED,ESTABLISHED accept must not come before the fence)."""
        while _run("iptables", "-D", "FORWARD", "-j", FORWARD_CHAIN, check=False).returncode == 0:
            pass
        _run("iptables", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN)

    def tear_down(self) -> None:
        """Everything :meth:`set_up` made, and what the CNI plugins left (best effort)."""
        _run("iptables", "-D", "FORWARD", "-j", FORWARD_CHAIN, check=False)
        _run("iptables", "-F", FORWARD_CHAIN, check=False)
        _run("iptables", "-X", FORWARD_CHAIN, check=False)
        _run("ip", "route", "del", self.service_cidr, "dev", self.bridge, check=False)
        # Pods' veth ends go with their network namespaces; the bridge goes last.
        _run("ip", "link", "del", self.bridge, check=False)
