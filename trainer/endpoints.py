"""Where the trainer's rollout servers are: the spec's list, else the operator's environment."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from posttrain.api.env import ROLLOUT_ENDPOINTS
from posttrain.errors import UsageError

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec


def rollout_endpoints(spec: TrainingRunSpec) -> list[str]:
    """spec.rollout.endpoints, else $POSTTRAIN_ROLLOUT_ENDPOINTS (comma-separated URLs, set by
    the operator from spec.rollout.pool); a UsageError naming both when neither is set."""
    from_env = [u for u in os.environ.get(ROLLOUT_ENDPOINTS, "").split(",") if u.strip()]
    endpoints = list(spec.rollout.endpoints) or from_env
    if not endpoints:
        raise UsageError(
            "no rollout endpoints: set spec.rollout.endpoints, or $POSTTRAIN_ROLLOUT_ENDPOINTS, "
            "or pass --local to start a CPU rollout server"
        )
    return endpoints
