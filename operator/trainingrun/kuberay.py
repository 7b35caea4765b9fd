"""Whether KubeRay is installed, and the RayCluster cache of multi-node runs kept right.

Multi-node TrainingRuns run their gang as a KubeRay RayCluster when the apiserver serves
``rayclusters.ray.io``, else as plain head + worker pods; the choice is made here through API
discovery (asked again periodically, so KubeRay installed later is picked up).
"""

from __future__ import annotations

import logging
import threading
import time

from posttrain.api.labels import (
    COMPONENT_TRAINER,
    LABEL_COMPONENT,
)

from ..kube import KubeError
from ..shared.state import Body, OperatorState
from . import raycluster

log = logging.getLogger(__name__)


def run_nodes(run: Body | None) -> int:
    """spec.resources.nodes of a raw TrainingRun body (1 when unset or unknown).

    >>> run_nodes({"spec": {"resources": {"nodes": 4}}}), run_nodes(None)
    (4, 1)
    """
    resources = ((run or {}).get("spec") or {}).get("resources") or {}
    value = resources.get("nodes", 1)
    return value if isinstance(value, int) else 1


class KubeRayDiscovery:
    """API discovery of KubeRay's CRD, at most once per ``kuberay_discovery_seconds``."""

    def __init__(self, state: OperatorState) -> None:
        self.state = state
        self._lock = threading.Lock()
        self._installed = False
        self._checked_at = float("-inf")

    def installed(self, fresh: bool = False) -> bool:
        """Whether the apiserver serves rayclusters.ray.io, asked through API discovery at most
        once per ``kuberay_discovery_seconds`` (KubeRay installed later is picked up then).

        ``fresh`` asks discovery now: the choice of path for a gang that starts from nothing
        is made once and kept for the gang's life, so it must not rest on an answer that may
        predate the CRD (a cached "no" would put a whole gang on plain pods).
        """
        config = self.state.config
        if not config.kuberay:
            return False
        with self._lock:
            age = time.monotonic() - self._checked_at
            if not fresh and age < config.kuberay_discovery_seconds:
                return self._installed
        try:
            installed = self.state.kube.serves(
                raycluster.RAY_API_VERSION, raycluster.RAY_CLUSTER_PLURAL
            )
        except KubeError as exc:
            log.warning(
                "API discovery of %s failed (%s); keeping the last answer",
                raycluster.RAY_API_VERSION,
                exc,
            )
            installed = self._installed
        with self._lock:
            if installed != self._installed:
                log.info(
                    "KubeRay RayCluster CRD %s: multi-node runs use %s",
                    "found" if installed else "not found",
                    "RayClusters" if installed else "plain head + worker pods",
                )
            self._installed = installed
            self._checked_at = time.monotonic()
        return installed

    def forget(self) -> None:
        """Ask discovery again at the next use (e.g. the CRD was removed under us)."""
        with self._lock:
            self._checked_at = float("-inf")

    def refresh_ray_clusters(self) -> None:
        """Re-list the RayClusters of namespaces with multi-node runs (resync safety net).

        The kopf watch only serves RayClusters when the CRD existed at operator start; with
        KubeRay installed later this list keeps the cache right, one LIST per namespace.
        """
        state = self.state
        runs = state.runs
        namespaces = sorted(
            {ns for ns, name in runs.snapshot_keys() if run_nodes(runs.get(ns, name)) > 1}
        )
        if not namespaces or not self.installed():
            return
        selector = f"{LABEL_COMPONENT}={COMPONENT_TRAINER}"
        for namespace in namespaces:
            try:
                items = state.kube.list(
                    raycluster.RAY_API_VERSION, "RayCluster", namespace, selector
                )
            except KubeError as exc:
                log.warning("listing RayClusters in %s failed: %s", namespace, exc)
                continue
            state.ray_clusters.replace_namespace(namespace, items)
