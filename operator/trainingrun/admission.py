"""Kueue admission for TrainingRuns, on the controller side: discovery, the Workload cache,
and executing what :func:`.plan.plan_training_run` decided about a run's Workload.

Kept beside the TrainingRun reconciler (:mod:`.reconciler`, which owns one
instance) so it only asks :meth:`KueueAdmission.gate` and hands the plan back to :meth:`KueueAdmission.apply`.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from posttrain.api import TrainingRun
from posttrain.api.labels import COMPONENT_TRAINER, LABEL_COMPONENT, LABEL_RUN

from ..config import OperatorConfig
from ..kube import KubeClient, resource_path
from ..shared.builders import owner_reference
from ..shared.discovery import Discovery
from ..shared.state import Store
from .kueue import (
    FLAVOR_PLURAL,
    KUEUE_API_VERSION,
    QUEUE_NAME_LABEL,
    WORKLOAD_PLURAL,
    build_workload,
    finished_condition,
    queue_name,
    workload_name,
    workload_view,
)
from .plan import KueueGate, RunPlan

log = logging.getLogger(__name__)

Body = dict[str, Any]


class KueueAdmission:
    """Whether Kueue is installed, the Workloads of runs, and their create/patch calls."""

    def __init__(self, config: OperatorConfig, kube: KubeClient, store: Store) -> None:
        self.config, self.kube = config, kube
        self.workloads = store  # keyed by the posttrain.io/run label
        self.discovery = Discovery(
            kube,
            KUEUE_API_VERSION,
            WORKLOAD_PLURAL,
            config.kueue,
            config.kueue_discovery_seconds,
            _describe,
        )

    def installed(self) -> bool:
        """Whether the apiserver serves Kueue's workloads, asked through API discovery at
        most once per ``kueue_discovery_seconds`` (Kueue installed later is picked up then,
        and its Workload informers started: runtime.OptionalInformers)."""
        return self.discovery.installed()

    def gate(self, run: TrainingRun) -> KueueGate | None:
        """The run's admission state when it goes through Kueue, else None.

        A run whose Workload exists keeps going through Kueue even if discovery briefly
        fails; a labelled run without one asks discovery.
        """
        queue = queue_name(run)
        if queue is None:
            return None
        body = self.workloads.get(run.metadata.namespace, workload_name(run))
        if body is None and not self.installed():
            return None
        return KueueGate(queue, workload_view(body) if body is not None else None)

    def apply(self, run: TrainingRun, plan: RunPlan, pod_template: Body | None) -> None:
        """Create, (de)activate or finish the run's Workload as the plan says."""
        namespace, name = run.metadata.namespace, workload_name(run)
        if plan.create_workload and pod_template is not None:
            labels = {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: run.metadata.name}
            manifest = build_workload(run, pod_template, labels, owner_reference(run))
            _, body = self.kube.create_or_adopt(manifest)
            self.workloads.put(body)
            log.info(
                "TrainingRun %s/%s: created Workload %s in LocalQueue %s",
                namespace,
                run.metadata.name,
                name,
                queue_name(run),
            )
        path = resource_path(KUEUE_API_VERSION, WORKLOAD_PLURAL, namespace, name)
        if plan.workload_active is not None:
            self.workloads.put(self.kube.patch(path, {"spec": {"active": plan.workload_active}}))
        if plan.finish_workload:
            current = self.workloads.get(namespace, name) or {}
            kept = [
                c
                for c in (current.get("status") or {}).get("conditions") or []
                if c.get("type") != "Finished"
            ]
            finished = finished_condition(
                run.status.phase or "Failed",
                run.status.message or "",
                datetime.now(UTC),
                current.get("metadata", {}).get("generation"),
            )
            # A merge patch replaces the list: Kueue's own conditions are kept in it.
            self.workloads.put(
                self.kube.patch(path, {"status": {"conditions": [*kept, finished]}}, "status")
            )

    def placed(self, run: TrainingRun, gate: KueueGate | None) -> TrainingRun:
        """``run`` with the node labels of the ResourceFlavors Kueue admitted it to added to
        its node selector, so the pods land where the quota was taken (what Kueue's own
        integrations inject on start). Unchanged when not admitted through Kueue."""
        workload = gate.workload if gate is not None else None
        if workload is None or not workload.flavors:
            return run
        labels: dict[str, str] = {}
        for flavor in workload.flavors:
            status, body = self.kube.request(
                "GET", f"/apis/{KUEUE_API_VERSION}/{FLAVOR_PLURAL}/{flavor}", ok=(200, 403, 404)
            )
            if status != 200:  # 403: a namespaced install without the ClusterRole part
                log.warning(
                    "cannot read ResourceFlavor %s assigned by Kueue (HTTP %d); the "
                    "pods get no node labels from it",
                    flavor,
                    status,
                )
                continue
            labels.update((body.get("spec") or {}).get("nodeLabels") or {})
        if not labels:
            return run
        placed = run.model_copy(deep=True)
        placed.spec.resources.node_selector = {**run.spec.resources.node_selector, **labels}
        return placed


def _describe(installed: bool) -> str:
    return (
        f"Kueue {KUEUE_API_VERSION} found: runs labelled {QUEUE_NAME_LABEL}=<LocalQueue> wait "
        "for admission"
        if installed
        else f"Kueue {KUEUE_API_VERSION} not found: runs labelled {QUEUE_NAME_LABEL}="
        "<LocalQueue> start without admission"
    )
