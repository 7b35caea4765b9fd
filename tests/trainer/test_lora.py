"""LoRA through PEFT: a step trains only the adapters; the published weights are merged."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.algorithms.loss import LossConfig, sequence_coefficients
from posttrain.trainer.model.policy import EngineOptions, LoraOptions, Policy

pytest.importorskip("peft", reason="LoRA needs peft (in the train extra)")


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Policy, dict[str, torch.Tensor]]:
    """A LoRA policy after one applied step, and its state before the step."""
    from posttrain.models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)
    policy = Policy(
        model, learning_rate=1e-2, engine=EngineOptions(lora=LoraOptions(rank=4, alpha=8.0))
    )
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    samples = _samples(policy)
    # Step 1 moves only B (A's gradient is B^T ... = 0 while B is still zero); step 2 moves A.
    for step in (1, 2):
        stats = policy.train_step(
            samples, LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=step
        )
        assert stats.applied
    return policy, before


def test_a_lora_step_changes_only_adapter_weights(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
) -> None:
    policy, before = lora_policy
    after = policy.model.state_dict()
    changed = {name for name, value in after.items() if not torch.equal(value, before[name])}
    adapters = {name for name in after if ".lora_" in name}
    assert adapters and changed == adapters, sorted(changed ^ adapters)[:5]
    trained = [p for g in policy.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in trained) == sum(after[n].numel() for n in adapters)


def test_merged_export_equals_base_plus_adapter(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
) -> None:
    """What servers load equals PEFT's own merge (W + alpha/r * B @ A) under base names."""
    policy, _ = lora_policy
    assert policy.peft is not None
    reference = copy.deepcopy(policy.peft).merge_and_unload().state_dict()
    exported = dict(policy.full_weights())
    assert set(exported) == set(reference) - {"lm_head.weight"}  # tied, as save_pretrained
    merged = [n for n in exported if n.endswith("q_proj.weight")]
    assert merged
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)
    # and the merge did something: the adapted weights differ from the frozen base
    base = policy.model.state_dict()
    assert not torch.equal(
        exported[merged[0]], base[merged[0].replace(".weight", ".base_layer.weight")]
    )


def test_lora_export_loads_as_a_plain_model(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    policy, _ = lora_policy
    policy.save_weights(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    exported = dict(policy.full_weights())
    for name, tensor in exported.items():
        assert torch.equal(loaded[name], tensor), name


# ---------------------------------------------------------------- two ranks (FSDP2, Gloo)

ALPHA, RANK = 8.0, 4


def _two_rank_lora_worker(rank: int, port: int, model: str, store: str, results: Any) -> None:
    """Two Gloo ranks: LoRA policy loaded per rank (meta + own slices), two steps over this
    rank's half of the batch, then the gathered state and the streamed merged export; then
    a checkpoint, resumed as the loop resumes sharded ranks (no HF weights: the checkpoint's
    export is *merged*, so only DCP can give back the base and the adapters)."""
    import os

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from posttrain.trainer.model.policy import RankInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    policy = Policy(
        Path(model),
        learning_rate=1e-2,
        engine=EngineOptions(lora=LoraOptions(rank=RANK, alpha=ALPHA)),
        rank=RankInfo(rank, 2, rank),
    )
    assert policy.sharded
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def gathered() -> dict[str, torch.Tensor]:
        state = get_model_state_dict(policy.module, options=options)
        return {k.removeprefix("model."): v.clone() for k, v in state.items()}

    before = gathered()
    samples = _samples(policy)
    # FSDP averages the two ranks' gradients: each rank's coefficients are the global x 2.
    for sample in samples:
        sample.coefficient *= 2
    applied = []
    for step in (1, 2):
        stats = policy.train_step(
            samples[rank::2],
            LossConfig(),
            micro_batch_size=2,
            grad_clip=1.0,
            temperature=1.0,
            step=step,
        )
        applied.append(stats.applied)
    after = gathered()
    exported = dict(policy.full_weights())  # collective: both ranks consume it
    trained = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for g in policy.optimizer.param_groups
        for p in g["params"]
    )
    results[f"trained{rank}"] = trained
    from posttrain.storage.store import LocalStore
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer, TrainerState

    engine, info = policy.engine, policy.rank
    Checkpointer(LocalStore(store), keep_last=1, keep_best=False).save(
        policy, TrainerState(2, 2, {}, {}, [], [], 0)
    )
    dist.barrier()  # rank 0 commits after the others uploaded
    assert Policy.reads_own_slices(engine, info)
    restored = Checkpointer(LocalStore(store), keep_last=1, keep_best=False).restore(
        lambda d: Policy(
            d, learning_rate=1e-2, engine=engine, rank=info, weights_from_checkpoint=True
        ),
        Path(store) / f"scratch{rank}",
        skip_weights=True,
    )
    assert restored is not None
    policy = restored[0]
    resumed = gathered()
    if rank == 0:
        results.update(
            before=before, after=after, exported=exported, applied=applied, resumed=resumed
        )
    dist.destroy_process_group()


def _samples(policy: Policy) -> list[TrainSample]:
    prompt = policy.encode_prompt("What is 3 + 4?")
    completions = [[28, 29, 30], [31, 32], [33, 34, 35, 36], [37]]
    coefficients = sequence_coefficients([len(c) for c in completions], "token_mean", 8)
    samples = [
        TrainSample(prompt, c, [0.0] * len(c), a, k)
        for c, a, k in zip(completions, [1.0, -1.0, 0.5, -0.5], coefficients, strict=True)
    ]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, samples, 1.0)
    for i, sample in enumerate(samples):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    return samples


@pytest.fixture(scope="module")
def two_rank_lora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from posttrain.models import make_tiny_model
    from posttrain.processes import free_port

    root = tmp_path_factory.mktemp("tiny2")
    model = make_tiny_model(root / "model", seed=2)
    results = mp.Manager().dict()
    mp.spawn(
        _two_rank_lora_worker,
        args=(free_port(), str(model), str(root / "store"), results),
        nprocs=2,
        join=True,
    )
    return dict(results)


@pytest.mark.slow  # two spawned ranks: ~1 min on 2 loaded cores
def test_a_two_rank_lora_step_changes_only_adapter_weights(
    two_rank_lora: dict[str, Any],
) -> None:
    before, after = two_rank_lora["before"], two_rank_lora["after"]
    assert two_rank_lora["applied"] == [True, True]
    changed = {name for name, value in after.items() if not torch.equal(value, before[name])}
    adapters = {name for name in after if ".lora_" in name}
    # step 1 moves every B (from zero), step 2 every A: all adapters changed, nothing else
    assert adapters and changed == adapters, sorted(changed ^ adapters)[:5]
    # each rank's optimizer holds its half of the adapters only (sharded, dim-0 padding aside)
    total = sum(after[n].numel() for n in adapters)
    assert two_rank_lora["trained0"] + two_rank_lora["trained1"] == total
    assert 0.4 * total <= two_rank_lora["trained0"] <= 0.6 * total


@pytest.mark.slow
def test_two_lora_ranks_resume_base_and_adapters_without_hf_weights(
    two_rank_lora: dict[str, Any],
) -> None:
    """Resumed from DCP alone, the unmerged base weights and the adapters are back exactly
    (building from the checkpoint's merged export would have double-counted the adapters)."""
    after, resumed = two_rank_lora["after"], two_rank_lora["resumed"]
    assert set(resumed) == set(after)
    for name, value in after.items():
        assert torch.equal(resumed[name], value), name


@pytest.mark.slow
def test_two_rank_merged_export_equals_base_plus_adapter(two_rank_lora: dict[str, Any]) -> None:
    """The streamed export of the shards is W + alpha/r * B @ A under the base names (and the
    frozen weights unchanged), computed here from the gathered state."""
    after, exported = two_rank_lora["after"], two_rank_lora["exported"]
    merged = 0
    for name, tensor in exported.items():
        base = name
        adapted = base.replace(".weight", ".base_layer.weight")
        if adapted in after:
            owner = adapted.removesuffix(".base_layer.weight")
            a = after[f"{owner}.lora_A.default.weight"]  # (r, in)
            b = after[f"{owner}.lora_B.default.weight"]  # (out, r)
            expected = after[adapted] + (ALPHA / RANK) * (b @ a)  # (out, in)
            assert not torch.equal(tensor, after[adapted]), name  # the adapter is in it
            merged += 1
        else:
            expected = after[base]
        torch.testing.assert_close(tensor, expected, rtol=1e-6, atol=1e-7)
    assert merged == 7 * 2  # q,k,v,o,gate,up,down in each of the tiny model's 2 blocks
    assert "lm_head.weight" not in exported  # tied, as save_pretrained writes it
