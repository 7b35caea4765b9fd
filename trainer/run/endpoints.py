"""Where the trainer's rollout servers are: the spec's list, else the operator's environment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from posttrain.api.env import ROLLOUT_ENDPOINTS
from posttrain.errors import UsageError

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec
    from posttrain.api.env import TrainerEnv


def rollout_endpoints(spec: TrainingRunSpec, contract: TrainerEnv) -> list[str]:
    """spec.rollout.endpoints, else the operator's (``$POSTTRAIN_ROLLOUT_ENDPOINTS``, resolved
    from spec.rollout.pool); a UsageError naming both when neither is set."""
    endpoints = list(spec.rollout.endpoints) or list(contract.rollout_endpoints)
    if not endpoints:
        raise UsageError(
            f"no rollout endpoints: set spec.rollout.endpoints, or ${ROLLOUT_ENDPOINTS}, "
            "or pass --local to start a CPU rollout server"
        )
    return endpoints
