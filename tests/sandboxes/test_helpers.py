"""The worked examples in the sandbox modules' docstrings are executable specifications of
the pure helpers (answer extraction, number parsing, schema checks, exit classification)."""

from __future__ import annotations

import doctest

import pytest

from posttrain.sandboxes import (
    client,
    collect,
    protocol,
    runner,
    snapshot,
    tasks,
    verifiers,
    warm_pool,
)


@pytest.mark.parametrize(
    "module",
    [protocol, collect, verifiers, snapshot, runner, client, warm_pool, tasks],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module: object) -> None:
    outcome = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert outcome.attempted > 0
    assert outcome.failed == 0
