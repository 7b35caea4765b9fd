"""SFT and DPO steps on the training engine: two Gloo ranks (FSDP2) equal one process, each
stage follows its own learning-rate curve, and the KL reference can be re-anchored.

One process runs an SFT step, anchors its KL reference to the result, computes the DPO
stage's reference log-probs and takes a DPO step; two ranks (real FSDP2 sharding on the
CPU, Gloo) do the same on the same global batches, split unevenly so one rank runs an empty
micro-batch to keep the collectives paired.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.api import AlgorithmSpec, StageSpec
from posttrain.processes import free_port
from posttrain.trainer.data.stage_data import PreferencePair, SftExample, StageData
from posttrain.trainer.model.policy import Policy, RankInfo
from posttrain.trainer.model.training_engine import LrSchedule
from posttrain.trainer.run.pipeline import (
    StagePlan,
    offline_step,
    reference_logps,
    stage_batch,
    stage_schedule,
)

from .conftest import assert_same_adam_update

LR = 1e-3
SEED = 5


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=g).tolist()


def sft_data() -> StageData:
    g = torch.Generator().manual_seed(0)
    examples = [SftExample(_ids(g, 3 + i % 4), _ids(g, 2 + i % 3), f"sft:{i}") for i in range(7)]
    return StageData(examples, skipped={"promptTooLong": 2}, truncated=1)


def dpo_data() -> StageData:
    g = torch.Generator().manual_seed(1)
    pairs = [
        PreferencePair(_ids(g, 4 + i % 3), _ids(g, 2 + i % 2), _ids(g, 3 - i % 2), f"dpo:{i}")
        for i in range(7)
    ]
    return StageData(pairs, skipped={"identicalPair": 1})


def plans() -> tuple[StagePlan, StagePlan]:
    # batch 5 over two ranks: 3 + 2 examples, micro-batches of 2 -> 2 and 1 forwards, so
    # rank 1 runs one empty (weight 0) micro-batch
    algorithm = AlgorithmSpec()
    sft = StageSpec(
        name="sft",
        type="sft",
        datasets=["x"],
        max_steps=1,
        batch_size=5,
        micro_batch_size=2,
        max_length=16,
        learning_rate=LR,
    ).resolved(algorithm)
    dpo = StageSpec(
        name="dpo",
        type="dpo",
        datasets=["x"],
        max_steps=1,
        batch_size=5,
        micro_batch_size=2,
        max_length=16,
        learning_rate=LR,
        beta=0.5,
    ).resolved(algorithm)
    return StagePlan(0, sft, 1, 1), StagePlan(1, dpo, 2, 2)


def full_state(policy: Policy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gathered weights and AdamW first moments by name (collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = get_state_dict(policy.module, policy.optimizer, options=options)
    moments = {k: v["exp_avg"].clone() for k, v in optim.get("state", {}).items()}
    return {k: v.clone() for k, v in model.items()}, moments


def reference_state(policy: Policy) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    assert policy.reference_module is not None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        k: v.clone()
        for k, v in get_model_state_dict(policy.reference_module, options=options).items()
    }


def run_stages(policy: Policy, rank: int, world: int) -> dict[str, Any]:
    """SFT step, anchor the reference, DPO reference log-probs, DPO step; what to compare."""
    sft_plan, dpo_plan = plans()
    out: dict[str, Any] = {"base": full_state(policy)[0]}
    data = sft_data()
    policy.optimization.reset(LR, 0.0, stage_schedule(sft_plan))
    indices = stage_batch(sft_plan, data, 1, SEED, rank, world)
    out["sft"] = offline_step(policy, sft_plan, data, indices, {}, grad_clip=1.0, step=1)
    out["sft_weights"], out["sft_moments"] = full_state(policy)
    policy.anchor_reference()
    out["anchored"] = reference_state(policy)
    pairs = dpo_data()
    policy.optimization.reset(LR, 0.0, stage_schedule(dpo_plan))
    state = reference_logps(policy, dpo_plan, pairs, SEED)
    out["reference_logps"] = state["reference_logps"]
    indices = stage_batch(dpo_plan, pairs, 2, SEED, rank, world)
    out["dpo"] = offline_step(policy, dpo_plan, pairs, indices, state, grad_clip=1.0, step=2)
    out["dpo_weights"], out["dpo_moments"] = full_state(policy)
    return out


def _rank_worker(rank: int, port: int, model: str, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    policy = Policy(
        Path(model), learning_rate=LR, reference_dir=Path(model), rank=RankInfo(rank, 2, rank)
    )
    assert policy.sharded
    out = run_stages(policy, rank, 2)
    results[f"rank{rank}"] = out if rank == 0 else {"sft": out["sft"], "dpo": out["dpo"]}
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_and_two(tiny_model: Path) -> dict[str, Any]:
    single = Policy(tiny_model, learning_rate=LR, reference_dir=tiny_model)
    assert not single.sharded
    one = run_stages(single, 0, 1)
    results = mp.Manager().dict()
    mp.spawn(_rank_worker, args=(free_port(), str(tiny_model), results), nprocs=2, join=True)
    return {"one": one, "two": results["rank0"], "rank1": results["rank1"]}


def assert_same_update(
    one: dict[str, Any], two: dict[str, Any], before: str | None, after: str
) -> None:
    """The same step on one process and on two ranks (see :func:`assert_same_adam_update`)."""
    one_start = one["base"] if before is None else one[f"{before}_weights"]
    two_start = one["base"] if before is None else two[f"{before}_weights"]
    assert_same_adam_update(
        one[f"{after}_weights"],
        two[f"{after}_weights"],
        one[f"{after}_moments"],
        two[f"{after}_moments"],
        one_start,
        two_start,
        LR,
    )


@pytest.mark.slow  # two spawned ranks loading torch + a tiny model: ~1 min on 2 loaded cores
def test_two_rank_sft_step_equals_one_process_step(one_and_two: dict[str, Any]) -> None:
    one, two, rank1 = one_and_two["one"], one_and_two["two"], one_and_two["rank1"]
    a, b = one["sft"], two["sft"]
    assert a.applied and b.applied
    assert a.examples == b.examples == 5 and a.tokens == b.tokens > 0  # reduced over ranks
    assert b.loss == pytest.approx(a.loss, rel=1e-5)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
    assert rank1["sft"].loss == b.loss and rank1["sft"].grad_norm == b.grad_norm  # one global step
    assert a.skipped_examples == {"promptTooLong": 2} and a.truncated_examples == 1
    assert_same_update(one, two, None, "sft")


@pytest.mark.slow
def test_two_rank_dpo_step_equals_one_process_step(one_and_two: dict[str, Any]) -> None:
    one, two = one_and_two["one"], one_and_two["two"]
    # the reference: every used pair's log-probs under the stage-start (post-SFT) model,
    # computed by the ranks in halves and exchanged
    assert one["reference_logps"].keys() == two["reference_logps"].keys()
    for key, (c, r) in one["reference_logps"].items():
        assert two["reference_logps"][key] == pytest.approx([c, r], rel=1e-5, abs=1e-5)
    a, b = one["dpo"], two["dpo"]
    assert a.applied and b.applied and a.examples == b.examples == 5
    # the first step's policy is its reference: every pair's logit is 0, the loss log 2
    assert a.loss == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=1e-5)
    for key in ("loss", "grad_norm", "reward_chosen", "reward_rejected", "reward_margin"):
        assert getattr(b, key) == pytest.approx(getattr(a, key), rel=1e-4, abs=1e-6), key
    assert a.skipped_examples == {"identicalPair": 1}
    assert_same_update(one, two, "sft", "dpo")


@pytest.mark.slow
def test_anchor_reference_copies_the_stage_start_weights(one_and_two: dict[str, Any]) -> None:
    """The KL reference becomes the post-SFT weights (not the base model), on one process
    and from two ranks' shards alike."""
    for run in (one_and_two["one"], one_and_two["two"]):
        anchored, trained, base = run["anchored"], run["sft_weights"], run["base"]
        assert set(anchored) == set(trained)
        for name, value in anchored.items():
            assert torch.equal(value, trained[name]), name
        assert any(not torch.equal(v, base[k]) for k, v in anchored.items())


# --------------------------------------------------------------------------- schedule


def test_each_stage_runs_its_own_learning_rate_curve(tiny_model: Path) -> None:
    """Warm-up from the stage's first step, cosine to minLrRatio at its last: an SFT stage of
    4 steps and an RL stage of 3 after it, whatever algorithm.maxSteps says."""
    from posttrain.api import TrainingRunSpec
    from posttrain.trainer.run.pipeline import plan_stages

    spec = TrainingRunSpec.model_validate(
        {
            "model": "m",
            "algorithm": {"maxSteps": 50, "lrSchedule": "cosine", "minLrRatio": 0.1},
            "domains": [
                {"name": "a", "dataset": "builtin:arithmetic", "verifier": {"kind": "numeric"}}
            ],
            "stages": [
                {
                    "name": "sft",
                    "type": "sft",
                    "datasets": ["builtin:arithmetic"],
                    "maxSteps": 4,
                    "learningRate": 1e-3,
                    "lrWarmupSteps": 2,
                    "minLrRatio": 0.0,
                },
                {"name": "rl", "type": "rl", "maxSteps": 3, "learningRate": 1e-4},
            ],
        }
    )
    sft, rl = plan_stages(spec)
    assert (rl.first_step, rl.last_step) == (5, 7)
    assert stage_schedule(sft) == LrSchedule("cosine", 2, 4, 0.0, 1)
    assert stage_schedule(rl) == LrSchedule("cosine", 0, 3, 0.1, 5)  # the algorithm's curve

    policy = Policy(tiny_model, learning_rate=1.0)
    rates = []
    for plan in (sft, rl):
        policy.optimization.reset(plan.spec.learning_rate, 0.0, stage_schedule(plan))
        rates += [
            policy.optimization.set_learning_rate(s)
            for s in range(plan.first_step, plan.last_step + 1)
        ]
    # rl: no warm-up, cosine over its 3 steps from 1e-4 to 0.1 x 1e-4
    expected = [5e-4, 1e-3, 5e-4, 0.0, 7.75e-5, 3.25e-5, 1e-5]
    assert rates == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # an SFT step applies it: the step's learning rate is the curve's
    data, (plan, _) = sft_data(), plans()
    policy.optimization.reset(LR, 0.0, LrSchedule("cosine", 2, 4, 0.0, 1))
    metrics = offline_step(policy, plan, data, [0, 1], {}, grad_clip=1.0, step=1)
    assert metrics.applied and metrics.learning_rate == LR / 2
