"""A TrainingRun's long-lived children, put together from the builders of each part.

Above :mod:`.builders` (RBAC, ConfigMap, head Service), :mod:`.sandbox_runner` (the per-run
runner) and :mod:`.evaluator` (the evaluator Job), which borrow :mod:`.common`'s and the
builders' helpers: assembling here keeps those imports one-way.
"""

from __future__ import annotations

from typing import Any

from posttrain.api import TrainingRun

from . import builders as b
from . import evaluator, sandbox_runner
from .config import OperatorConfig

Manifest = dict[str, Any]


def build_trainer_children(
    run: TrainingRun, config: OperatorConfig, incarnation: int, ray_cluster: bool = False
) -> list[Manifest]:
    """The run's long-lived children, created before the first gang (order matters for RBAC):
    RBAC, the run's ConfigMap, the head Service (selecting gang ``incarnation``), the sandbox
    runner (mode runner without runnerUrl) and the evaluator Job (``evaluation.inline: false``).

    With a RayCluster (``ray_cluster``) KubeRay makes the head Service, so ours is not needed.
    """
    children = [*b.build_trainer_rbac(run), b.build_run_config_map(run, config)]
    if run.spec.resources.nodes > 1 and not ray_cluster:
        children.append(b.build_head_service(run, config, incarnation))
    return [
        *children,
        *sandbox_runner.build_runner_children(run, config),
        *evaluator.build_evaluator_children(run, config),
    ]
