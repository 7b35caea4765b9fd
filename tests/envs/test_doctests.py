"""The worked examples in the environments' docstrings hold (they are documentation that runs)."""

from __future__ import annotations

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["task"])
def test_docstring_examples_hold(name: str) -> None:
    module = importlib.import_module(f"posttrain.envs.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
