"""The worked examples in the operator's docstrings hold (they are documentation that runs)."""

from __future__ import annotations

import doctest
import importlib

import pytest

# Every operator module with examples (the others have none to run).
MODULES = [
    "config",
    "kube",
    "leader",
    "events",
    "shared.builders",
    "shared.views",
    "shared.requeue",
    "storage_credentials",
    "trainingrun.builders",
    "trainingrun.names",
    "trainingrun.raycluster",
    "trainingrun.plan",
    "trainingrun.decision",
    "trainingrun.gang",
    "trainingrun.finalizer",
    "trainingrun.kueue",
    "trainingrun.sandbox_runner",
    "trainingrun.evaluator",
    "rolloutpool.builders",
    "rolloutpool.plan",
    "sandboxtask.builders",
    "sandboxtask.plan",
    "warmpool.builders",
    "warmpool.plan",
    "warmpool.entrypoint",
    "rolloutpool.autoscale",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(f"posttrain.operator.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
