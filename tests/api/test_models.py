"""Unit tests of the API models: camelCase wire format, defaults, conditions."""

from __future__ import annotations

from datetime import timedelta

from posttrain.api import SandboxTaskSpec, TrainingRunSpec
from posttrain.api.base import get_condition, set_condition


def test_snake_case_in_python_camel_case_on_the_wire() -> None:
    spec = TrainingRunSpec.model_validate(
        {
            "model": "m",
            "domains": [
                {"name": "a", "dataset": "builtin:arithmetic", "verifier": {"kind": "numeric"}}
            ],
            "algorithm": {"groupSize": 4},
        }
    )
    assert spec.algorithm.group_size == 4
    wire = spec.to_wire()
    assert wire["algorithm"]["groupSize"] == 4
    assert "group_size" not in wire["algorithm"]
    assert TrainingRunSpec.model_validate(wire) == spec


def test_condition_transition_time_moves_only_on_status_change() -> None:
    first = set_condition([], "Ready", "False", "Pending", observed_generation=1)
    stamp = first[0].last_transition_time - timedelta(hours=1)
    first[0].last_transition_time = stamp
    same = set_condition(first, "Ready", "False", "StillPending", observed_generation=2)
    cond = get_condition(same, "Ready")
    assert cond is not None and cond.last_transition_time == stamp
    assert cond.reason == "StillPending" and cond.observed_generation == 2
    flipped = get_condition(set_condition(same, "Ready", "True", "Running"), "Ready")
    assert flipped is not None and flipped.last_transition_time > stamp
    assert len(set_condition(same, "Suspended", "True", "UserRequested")) == 2


def test_sandbox_task_defaults_are_safe() -> None:
    spec = SandboxTaskSpec.model_validate({"command": ["true"]})
    assert spec.network == "none"
    assert spec.retries == 0
    assert spec.ttl_seconds_after_finished == 3600
