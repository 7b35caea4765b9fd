"""The worked examples in the operator's docstrings hold (they are documentation that runs)."""

from __future__ import annotations

import doctest
import importlib

import pytest

# Every operator module with examples (the others have none to run).
MODULES = [
    "builders",
    "common",
    "config",
    "reconcile",
    "warmpool",
    "kube",
    "reconcilers.kuberay",
    "warm_entrypoint",
    "informer",
    "events",
    "kueue",
    "sandbox_runner",
    "evaluator",
    "reconcilers.storage_credentials",
    "autoscale",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(f"posttrain.operator.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
