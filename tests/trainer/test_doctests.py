"""The worked examples in the trainer's docstrings are executed, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "algorithms.advantages",
    "algorithms.dpo",
    "algorithms.loss",
    "algorithms.sft",
    "checkpointing.checkpoint",
    "checkpointing.shard_reads",
    "data.curriculum",
    "data.rollouts",
    "data.rundata",
    "data.stage_data",
    "data.task_sources",
    "evaluation.heldout",
    "model.sharded_load",
    "model.training_engine",
    "model.weight_sync",
    "observe.audit",
    "observe.domain_tables",
    "observe.heldout_change",
    "observe.run_report",
    "observe.status",
    "observe.step_metrics",
    "rewards.scorers",
    "rewards.scoring",
    "rewards.verification",
    "run.distributed",
    "run.interrupt",
    "run.loop",
    "run.pipeline",
    "run.server_process",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"posttrain.trainer.{name}")
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
