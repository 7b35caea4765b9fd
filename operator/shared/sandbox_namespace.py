"""Objects a namespace needs once before sandbox pods run in it, made once per operator process.

Both sandbox reconcilers (SandboxTask, SandboxWarmPool) need the namespace's default-deny
NetworkPolicy before a ``network: none`` pod starts; tasks with artifact storage need the
entrypoint ConfigMap their pods mount.
"""

from __future__ import annotations

import threading

from . import sandbox
from .state import OperatorState


class SandboxNamespaces:
    """What the operator has already ensured in each namespace (this process's lifetime)."""

    def __init__(self, state: OperatorState) -> None:
        self.state = state
        self._policy_namespaces: set[str] = set()
        self._entrypoint_namespaces: set[str] = set()
        self._lock = threading.Lock()

    def has_network_policy(self, namespace: str) -> bool:
        """Whether this process already made (or adopted) the namespace's policy."""
        return namespace in self._policy_namespaces

    def ensure_network_policy(self, namespace: str) -> None:
        """The namespace's default-deny policy, created once per operator process (its one
        egress exception, the artifact store, follows the operator's configuration)."""
        if namespace in self._policy_namespaces:
            return
        config, kube = self.state.config, self.state.kube
        egress = config.sandbox_artifacts_egress if config.sandbox_artifacts_uri else []
        manifest = sandbox.build_sandbox_network_policy(namespace, egress)
        _, existing = kube.create_or_adopt(manifest)
        if (existing.get("spec") or {}).get("egress") != manifest["spec"].get("egress"):
            kube.patch(manifest, {"spec": {"egress": manifest["spec"].get("egress")}})
        with self._lock:
            self._policy_namespaces.add(namespace)

    def ensure_entrypoint(self, namespace: str) -> None:
        """The namespace's entrypoint ConfigMap, created once per operator process."""
        if namespace in self._entrypoint_namespaces:
            return
        self.state.kube.create_or_adopt(sandbox.build_sandbox_entrypoint_config_map(namespace))
        with self._lock:
            self._entrypoint_namespaces.add(namespace)
