"""Whether KubeRay is installed.

Multi-node TrainingRuns run their gang as a KubeRay RayCluster when the apiserver serves
``rayclusters.ray.io``, else as plain head + worker pods; the choice is made here through API
discovery (asked again periodically, so KubeRay installed later is picked up, and its
RayCluster informers started then: runtime.OptionalInformers).
"""

from __future__ import annotations

from ..shared.discovery import Discovery
from ..shared.state import OperatorState
from . import raycluster


class KubeRayDiscovery(Discovery):
    """API discovery of KubeRay's CRD, at most once per ``kuberay_discovery_seconds``; off
    with ``kuberay: false``. A gang that starts from nothing asks ``installed(fresh=True)``:
    its path is chosen once and kept for the gang's life, so it must not rest on an answer
    that may predate the CRD (a cached "no" would put a whole gang on plain pods)."""

    def __init__(self, state: OperatorState) -> None:
        config = state.config
        super().__init__(
            state.kube,
            raycluster.RAY_API_VERSION,
            raycluster.RAY_CLUSTER_PLURAL,
            config.kuberay,
            config.kuberay_discovery_seconds,
            _describe,
        )


def _describe(installed: bool) -> str:
    if installed:
        return "KubeRay RayCluster CRD found: multi-node runs use RayClusters"
    return "KubeRay RayCluster CRD not found: multi-node runs use plain head + worker pods"
