"""The worked examples in the real node's docstrings hold (they are documentation that runs).

The stand-in node agent's modules run theirs in ``tests/e2e/test_nodeagent_helpers.py``.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["components", "containerd", "network"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"posttrain.devenv.realnode.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no examples: drop it from MODULES"
    assert result.failed == 0
