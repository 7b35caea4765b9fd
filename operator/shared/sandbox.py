"""The sandbox pod's parts that SandboxTask pods and warm-pool pods share: the working
directory, file-name checks, the per-namespace default-deny NetworkPolicy and the entrypoint
ConfigMap (:mod:`.sandbox_namespace` creates those two once per namespace).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.api.labels import (
    COMPONENT_SANDBOX,
    LABEL_COMPONENT,
    LABEL_SANDBOX_NETWORK,
    MANAGED_BY,
)

from .builders import BuildError, Manifest, spec_hash

SANDBOX_WORKDIR = "/workspace"
SANDBOX_NETWORK_POLICY = "posttrain-sandbox-default-deny"
SANDBOX_ENTRYPOINT_KEY = "entrypoint.py"


def check_file_name(name: str) -> str:
    normalised = posixpath.normpath(name)
    if (
        not name
        or name.startswith("/")
        or normalised.startswith("..")
        or normalised != name
        or name.startswith(".")
    ):
        raise BuildError(
            f"files key {name!r} is not a plain relative path; use names like 'main.py' or "
            "'tests/test_main.py' (no leading '/' or '.', no '..')"
        )
    return name


def sandbox_entrypoint_source() -> str:
    """The stdlib-only entrypoint shipped into storing sandbox pods."""
    from posttrain.sandboxes import task_entrypoint

    return Path(task_entrypoint.__file__).read_text()


def sandbox_entrypoint_config_map_name() -> str:
    """``posttrain-sandbox-entrypoint-<hash>``: a new operator version with a changed
    entrypoint gets a new ConfigMap, never mutating the one running pods mount."""
    return f"posttrain-sandbox-entrypoint-{spec_hash(sandbox_entrypoint_source())[:10]}"


def build_sandbox_entrypoint_config_map(namespace: str) -> Manifest:
    """One ConfigMap per namespace with the entrypoint (no owner: shared by all tasks)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": sandbox_entrypoint_config_map_name(),
            "namespace": namespace,
            "labels": {**MANAGED_BY, LABEL_COMPONENT: COMPONENT_SANDBOX},
        },
        "data": {SANDBOX_ENTRYPOINT_KEY: sandbox_entrypoint_source()},
    }


def build_sandbox_network_policy(namespace: str, egress: Sequence[dict[str, Any]] = ()) -> Manifest:
    """One default-deny NetworkPolicy per namespace for every sandbox pod with network=none.

    It selects by label, so it is created once per namespace (not per task) and has no
    owner: it outlives any single task. ``egress`` (OperatorConfig.sandbox_artifacts_egress)
    is the one exception: the object store the entrypoint uploads artifacts to.
    """
    policy: Manifest = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": SANDBOX_NETWORK_POLICY,
            "namespace": namespace,
            "labels": dict(MANAGED_BY),
        },
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_COMPONENT: COMPONENT_SANDBOX, LABEL_SANDBOX_NETWORK: "none"}
            },
            # Both types with no rules: nothing in, nothing out (not even DNS).
            "policyTypes": ["Ingress", "Egress"],
        },
    }
    if egress:
        policy["spec"]["egress"] = [dict(rule) for rule in egress]
    return policy
