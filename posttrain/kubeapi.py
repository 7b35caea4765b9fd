"""The Kubernetes client that workloads (trainer, rollout discovery, sandbox tasks) use.

One place decides where credentials come from: the pod's ServiceAccount when running in a
cluster, else the user's kubeconfig (a trainer or tool started by hand against a cluster).
"""

from __future__ import annotations

from typing import Any


def custom_objects_api() -> Any:
    """A ``kubernetes.client.CustomObjectsApi`` with in-cluster credentials, else kubeconfig's.

    kubernetes is imported here, not at module level: the laptop path never needs it.
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()
