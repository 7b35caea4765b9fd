"""The worked examples in the trainer's docstrings are executed, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "advantages",
    "audit",
    "checkpoint",
    "curriculum",
    "distributed",
    "dpo",
    "engine",
    "evaluate",
    "interrupt",
    "loop",
    "loss",
    "many_domains",
    "pipeline",
    "report",
    "rewards",
    "rollouts",
    "rundata",
    "scorers",
    "server_process",
    "sft",
    "shard_reads",
    "sharded_load",
    "stage_data",
    "status",
    "task_sources",
    "verification",
    "weight_sync",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"posttrain.trainer.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
