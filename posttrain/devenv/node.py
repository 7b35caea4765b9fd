"""The Node object the dev node agent registers and heartbeats (Ready, this host's CPUs and
memory, ``nvidia.com/gpu: 0``). Part of the dev node agent (:mod:`.nodeagent`).
"""

from __future__ import annotations

import os
from pathlib import Path

from .podprocess import Manifest, now_rfc3339


def node_manifest(node_name: str, kubelet_port: int | None = None) -> Manifest:
    """The Node this agent registers: one Ready node with this host's CPUs and memory.

    Its only address is the InternalIP 127.0.0.1: the apiserver prefers a Hostname address
    when there is one and would try to resolve ``posttrain-local`` in DNS to reach the
    kubelet (``pods/log`` then fails with "no such host"). ``kubelet_port`` is where the
    agent serves ``/containerLogs`` for ``kubectl logs``.
    """
    memory_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    except OSError:
        pass
    capacity = {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{memory_kib}Ki",
        "pods": "110",
        "nvidia.com/gpu": "0",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name,
            "labels": {
                "kubernetes.io/hostname": node_name,
                "kubernetes.io/os": "linux",
                "posttrain.io/dev-node": "true",
            },
        },
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            **(
                {"daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}}}
                if kubelet_port
                else {}
            ),
            "conditions": [node_ready_condition()],
            "nodeInfo": {
                "kubeletVersion": "posttrain-nodeagent",
                "operatingSystem": "linux",
                "architecture": os.uname().machine,
                "containerRuntimeVersion": "local-process://bwrap",
                "kernelVersion": os.uname().release,
                "osImage": "host",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def node_ready_condition(ready: bool = True) -> Manifest:
    now = now_rfc3339()
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletStopped",
        "message": "posttrain local node agent is " + ("running" if ready else "stopped"),
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
