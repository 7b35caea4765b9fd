"""The glue ``bench/rollout_autoscale.py``'s numbers rest on, on real parts: a trainer that
waits for its rollouts makes the operator's ``autoscale_pool``, called as the bench's
reconciler calls it, start replicas for the pool the trainer samples from."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "rollout_autoscale_bench", ROOT / "bench" / "rollout_autoscale.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_waiting_trainer_makes_the_autoscaler_add_replicas(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    bench = load_bench()
    args = argparse.Namespace(
        steps=6, change_at=3, tokens_before=4, tokens_after=8, prompts=2, group_size=2,
        micro_batch=4, max_policy_lag=0, min=1, max=3, target=0.1, period=0.5,
        scale_down_window=300, cpu_per_replica=0,  # no CPU limit: no root needed
    )  # fmt: skip
    outcome = bench.run_configuration("autoscaled", 1, True, tiny_model_dir, args, tmp_path)
    assert outcome.steps == 6
    # maxPolicyLag 0: every step waits for its whole batch, far above a tenth of the step
    assert outcome.wait[0] > 0.1
    first = outcome.events[0]
    assert first.reason == "ScaledUp", outcome.events
    assert first.message.startswith("1 -> ") and "target 0.1" in first.message
    assert outcome.mean_replicas[0] > 1.0  # the pool grew while the run went on
