"""The training engine: device/backend agreement, chunked log-probs, LR schedule, memory
refusal, and real two-rank FSDP2 (Gloo, CPU) against one process: the step, the per-rank
memory, and sharded checkpoints resumed on another world size."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from posttrain.errors import UsageError
from posttrain.processes import free_port
from posttrain.trainer.algorithms.logprobs import TrainSample, chunked_token_logprobs
from posttrain.trainer.algorithms.loss import LossConfig, sequence_coefficients
from posttrain.trainer.model.policy import Policy, RankInfo
from posttrain.trainer.model.training_engine import (
    DevicePlan,
    backend_for,
    check_placement,
    count_parameters,
    estimate_training_memory,
    lr_factor,
    plan_device,
)

from .conftest import assert_same_adam_update

LR = 1e-3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


# ---------------------------------------------------------------- device and backend


def test_cpu_ranks_use_gloo() -> None:
    plan = plan_device(0, local_rank=3)
    assert plan == DevicePlan(torch.device("cpu"), "gloo")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error; a GPU is visible")
def test_gpus_requested_without_a_visible_gpu_fail_before_loading() -> None:
    with pytest.raises(UsageError, match=r"gpusPerNode is 2 but no CUDA GPU is visible"):
        plan_device(2)


def test_every_gpu_rank_gets_its_own_cuda_device_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert plan_device(2, local_rank=1) == DevicePlan(torch.device("cuda", 1), "nccl")
    with pytest.raises(UsageError, match="local rank 2 needs its own GPU but only 2"):
        plan_device(2, local_rank=2)


def test_a_nccl_group_never_gets_cpu_tensors() -> None:
    """The check Policy runs on every placed module: CPU parameters under a CUDA/NCCL plan
    are refused, and so is a backend that does not serve the device."""
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"weight is on cpu but this rank computes on cuda:0"):
        check_placement(layer, DevicePlan(torch.device("cuda", 0), "nccl"))
    with pytest.raises(RuntimeError, match=r"backend 'nccl' cannot serve cpu tensors"):
        check_placement(layer, DevicePlan(torch.device("cpu"), "nccl"))
    check_placement(layer, DevicePlan(torch.device("cpu"), "gloo"))
    assert backend_for(torch.device("cuda", 0)) == "nccl"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_policy_on_a_gpu_computes_in_bf16_with_fp32_master_weights(tiny_model: Path) -> None:
    from posttrain.trainer.model.policy import EngineOptions

    policy = Policy(tiny_model, learning_rate=LR, engine=EngineOptions(gpus_per_node=1))
    assert policy.plan.backend == "nccl" and policy.dtype == torch.bfloat16
    assert all(
        p.to_local().device.type == "cuda" and p.dtype == torch.float32
        for p in policy.module.parameters()
    )
    stats = policy.train_step(
        _samples(policy), LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=1
    )
    assert stats.applied


# ---------------------------------------------------------------- chunked log-probs


class _RowCountingHead(torch.nn.Linear):
    """An LM head that records the most rows it ever computed logits for at once."""

    most_rows = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        type(self).most_rows = max(type(self).most_rows, hidden.shape[0])
        return super().forward(hidden)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_equal_the_full_computation(chunk: int) -> None:
    torch.manual_seed(0)
    head = _RowCountingHead(8, 50, bias=False)
    hidden = torch.randn(10, 8, requires_grad=True)  # (N, H)
    targets = torch.randint(0, 50, (10,))  # (N,)
    weights = torch.randn(10)  # a loss that weighs tokens differently

    full = torch.log_softmax(head(hidden) / 0.7, dim=-1).gather(-1, targets[:, None])[:, 0]
    (full * weights).sum().backward()
    full_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    _RowCountingHead.most_rows = 0
    chunked = chunked_token_logprobs(hidden, head, targets, 0.7, chunk)  # (N,)
    (chunked * weights).sum().backward()
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, full_grads[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, full_grads[1], rtol=1e-5, atol=1e-6)
    assert _RowCountingHead.most_rows == min(chunk, 10)  # forward and recomputation alike


def test_policy_logprobs_do_not_depend_on_the_chunk_size(tiny_model: Path) -> None:
    from posttrain.trainer.model.policy import EngineOptions

    whole = Policy(tiny_model, learning_rate=LR)
    small = Policy(tiny_model, learning_rate=LR, engine=EngineOptions(logprob_chunk_tokens=2))
    samples = _samples(whole)
    with torch.no_grad():
        a, _, mask = whole.completion_logprobs(whole.model, samples, 1.0)
        b, _, _ = small.completion_logprobs(small.model, samples, 1.0)
    torch.testing.assert_close(a * mask, b * mask, rtol=1e-5, atol=1e-6)


def _moments_by_name(policy: Policy) -> dict[str, torch.Tensor]:
    names = {
        id(p): n.replace("._checkpoint_wrapped_module", "")
        for n, p in policy.module.named_parameters()
    }
    return {names[id(p)]: state["exp_avg"] for p, state in policy.optimizer.state.items()}


def test_activation_checkpointing_gives_the_same_update(tiny_model: Path) -> None:
    """Recomputing blocks in backward (and the full forward it implies) changes memory,
    not the gradient: AdamW's first moment (0.1 x gradient) agrees to float noise."""
    from posttrain.trainer.model.policy import EngineOptions

    plain = Policy(tiny_model, learning_rate=LR)
    recomputing = Policy(
        tiny_model, learning_rate=LR, engine=EngineOptions(activation_checkpointing=True)
    )
    assert not recomputing.module.share_prompts
    samples = _samples(plain)
    for policy in (plain, recomputing):
        assert policy.train_step(
            samples, LossConfig(), micro_batch_size=3, grad_clip=1e9, temperature=1.0, step=1
        ).applied
    expected, actual = _moments_by_name(plain), _moments_by_name(recomputing)
    assert expected.keys() == actual.keys()
    for name, moment in expected.items():
        torch.testing.assert_close(actual[name], moment, rtol=1e-4, atol=1e-8)


def test_bf16_on_one_cpu_process_keeps_fp32_master_weights(tiny_model: Path) -> None:
    """precision: bf16 without a launcher: a one-rank FSDP2 group with bf16 compute."""
    import torch.distributed as dist

    from posttrain.trainer.model.policy import EngineOptions

    try:
        policy = Policy(tiny_model, learning_rate=LR, engine=EngineOptions(precision="bf16"))
        assert policy.sharded and policy.dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 for p in policy.module.parameters())
        stats = policy.train_step(
            _samples(policy),
            LossConfig(),
            micro_batch_size=4,
            grad_clip=1.0,
            temperature=1.0,
            step=1,
        )
        assert stats.applied and stats.grad_norm > 0
        exported = dict(policy.full_weights())
        assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------- schedule and memory


def test_warmup_then_cosine_learning_rate(tiny_model: Path) -> None:
    from posttrain.trainer.model.policy import EngineOptions

    factors = [
        lr_factor(s, warmup_steps=4, total_steps=20, schedule="cosine", min_ratio=0.1)
        for s in range(1, 21)
    ]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(factors[3:]))  # decays after warm-up
    assert factors[-1] == pytest.approx(0.1)
    policy = Policy(
        tiny_model,
        learning_rate=LR,
        engine=EngineOptions(
            lr_schedule="cosine", lr_warmup_steps=4, total_steps=20, min_lr_ratio=0.1
        ),
    )
    policy.train_step(
        _samples(policy), LossConfig(), micro_batch_size=4, grad_clip=1.0, temperature=1.0, step=2
    )
    assert policy.optimizer.param_groups[0]["lr"] == pytest.approx(LR * 0.5)


def _config_only_llama(tiny_model: Path, dest: Path, **shape: Any) -> Path:
    """A model directory with only a config: the tiny model's, reshaped (head_dim 128)."""
    config = json.loads((tiny_model / "config.json").read_text())
    config.update(head_dim=128, **shape)
    dest.mkdir()
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_model_too_large_for_the_ranks_is_refused_before_loading(
    tmp_path: Path, tiny_model: Path
) -> None:
    """A 70B Llama config with no weights at all: the refusal must come from the config."""
    big = _config_only_llama(
        tiny_model,
        tmp_path / "llama-70b-config-only",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    )
    with pytest.raises(UsageError, match=r"does not fit: 70\.\d+B parameters .* GiB per rank"):
        Policy(big, learning_rate=LR)


def test_the_estimate_counts_the_fsdp_transient_measured_on_two_ranks(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The pre-load check's unsharded part against what two Gloo ranks measured.

    docs/benchmarks.md ("Where a rank's memory goes"): at hidden 2048 x 22 layers (the
    1.02B bench model, tied embeddings, fp32) a rank's backward peak exceeded its sharded
    state by a 1.48 GiB transient. Counting only the gathered weights gave 0.69 GiB; with
    their gradients the estimate must come within 10% of the measurement.
    """
    model = _config_only_llama(
        tiny_model,
        tmp_path / "bench-1b-config-only",
        hidden_size=2048,
        intermediate_size=4096,
        num_hidden_layers=22,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    total, largest, outside = count_parameters(model)
    assert total == 1_023_502_336  # the model the bench measured
    two = estimate_training_memory(
        total, total, largest, outside, world_size=2, compute_bytes=4, reference=False
    )
    state = 16 * total / 2
    transient_gib = (two.per_rank_bytes - state) / 2**30
    assert 0.9 * 1.48 <= transient_gib <= 1.1 * 1.48, two.describe()
    # LoRA: frozen weights have no gradients, so only the gathered copies remain
    lora = estimate_training_memory(
        total, total // 1000, largest, outside, world_size=2, compute_bytes=4, reference=False
    )
    lora_state = (4 * total + 12 * (total // 1000)) / 2
    assert (lora.per_rank_bytes - lora_state) / 2**30 < 0.7


def test_non_finite_loss_skips_the_step_with_the_engine(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=LR)
    samples = _samples(policy)
    samples[0].advantage = float("inf")
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    stats = policy.train_step(
        samples, LossConfig(), micro_batch_size=4, grad_clip=1.0, temperature=1.0, step=1
    )
    assert not stats.applied and "non-finite" in stats.skip_reason
    for name, value in policy.model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---------------------------------------------------------------- two ranks vs one


def _samples(policy: Policy) -> list[TrainSample]:
    """Eight completions of two prompts with on-policy behaviour log-probs."""
    prompts = [policy.encode_prompt("What is 2 + 2?"), policy.encode_prompt("Name a colour.")]
    completions = [
        [28, 29, 30],
        [31, 32],
        [33, 34, 35, 36],
        [37],
        [40, 41],
        [42],
        [43, 44, 45],
        [46, 47],
    ]
    advantages = [1.0, -1.0, 0.5, -0.5, 0.8, -0.8, 0.3, -0.3]
    coefficients = sequence_coefficients([len(c) for c in completions], "token_mean", 8)
    samples = [
        TrainSample(prompts[i % 2], c, [0.0] * len(c), a, k)
        for i, (c, a, k) in enumerate(zip(completions, advantages, coefficients, strict=True))
    ]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, samples, temperature=1.0)
    for i, sample in enumerate(samples):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    return samples


def _state_bytes(policy: Policy) -> int:
    """Bytes this rank holds of parameters + AdamW state (local shards only)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = sum(local(p).numel() * local(p).element_size() for p in policy.module.parameters())
    for state in policy.optimizer.state.values():
        total += sum(
            local(v).numel() * local(v).element_size()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    return total


def _full_state(policy: Policy) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Gathered weights and AdamW first moments keyed by name (collective; with several
    ranks only rank 0 receives them, the others get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = get_state_dict(policy.module, policy.optimizer, options=options)
    moments = {name: state["exp_avg"].clone() for name, state in optim.get("state", {}).items()}
    return {k: v.clone() for k, v in model.items()}, moments


def _full_weights(policy: Policy) -> dict[str, torch.Tensor]:
    """Gathered weights keyed by name, without touching the optimizer (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.clone() for k, v in get_model_state_dict(policy.module, options=options).items()}


SHARD_BLOCK = 16 * 1024  # small blocks, so a tiny model's shard files span many


def _two_rank_worker(
    rank: int,
    port: int,
    model: str,
    samples: list[TrainSample],
    single_ckpt: str,
    rank_ckpt: str,
    results: Any,
) -> None:
    import torch.distributed as dist

    from posttrain.storage.store import LocalStore
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer, TrainerState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    info = RankInfo(rank, 2, rank)
    policy = Policy(Path(model), learning_rate=LR, rank=info)
    assert policy.sharded
    # one decoder pass per forward under FSDP (two would gather every block twice)
    assert not policy.module.share_prompts
    # What the ranks read, each its own slices. Model only: DCP's get_state_dict would
    # initialise the still-empty AdamW state with a zero-gradient step, and the real step
    # below would then be Adam's second (bias correction 0.74x the first step's update).
    loaded = _full_weights(policy)
    # Rank r trains samples r, r+2, ...; FSDP averages the two ranks' gradients, so each
    # rank's coefficients are the global ones x world size.
    mine = [
        TrainSample(
            s.prompt_ids, s.completion_ids, s.behaviour_logprobs, s.advantage, s.coefficient * 2
        )
        for s in samples[rank::2]
    ]
    stats = policy.train_step(
        mine, LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=1
    )
    weights, moments = _full_state(policy)
    exported = dict(policy.full_weights())  # the streamed export, as publishing uses it
    results[f"bytes{rank}"] = _state_bytes(policy)
    Checkpointer(LocalStore(rank_ckpt), keep_last=2, keep_best=False, block_bytes=SHARD_BLOCK).save(
        policy, TrainerState(1, 1, {}, {}, [], [], 0)
    )
    dist.barrier()  # rank 0 commits after the others have uploaded their parts
    # ... resume it on the same two ranks as the loop does: each fetches only the slices it
    # reads, and no HF weights (the policy only allocates its shards; DCP fills them)
    assert Policy.reads_own_slices(policy.engine, info)
    again = Checkpointer(LocalStore(rank_ckpt), keep_last=2, keep_best=False)
    back = again.restore(
        lambda d: Policy(d, learning_rate=LR, rank=info, weights_from_checkpoint=True),
        Path(rank_ckpt) / f"again{rank}",
        skip_weights=True,
    )
    assert back is not None
    results[f"fetch{rank}"] = again.last_shard_fetch
    results[f"fetched_files{rank}"] = sorted(
        p.name for p in (Path(rank_ckpt) / f"again{rank}/resume").rglob("*") if p.is_file()
    )
    back_weights, back_moments = _full_state(back[0])
    del back
    # ... and resume what one process saved, on these two ranks
    restored = Checkpointer(LocalStore(single_ckpt), keep_last=2, keep_best=False).restore(
        lambda d: Policy(d, learning_rate=LR, rank=info), Path(single_ckpt) / f"scratch{rank}"
    )
    assert restored is not None
    resumed_weights, resumed_moments = _full_state(restored[0])
    # A non-finite loss on rank 1 only: every rank must skip the step (one rank applying an
    # update the other refused would leave the shards of one model out of step).
    poisoned = [
        TrainSample(
            s.prompt_ids,
            s.completion_ids,
            s.behaviour_logprobs,
            float("inf") if rank == 1 else s.advantage,
            s.coefficient,
        )
        for s in mine
    ]
    before_skip, moments_before_skip = _full_state(policy)
    skip = policy.train_step(
        poisoned, LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=2
    )
    after_skip, moments_after_skip = _full_state(policy)
    results[f"skip{rank}"] = (skip.applied, skip.skip_reason)
    if rank == 0:
        results.update(
            skip_weights=(before_skip, after_skip),
            skip_moments=(moments_before_skip, moments_after_skip),
        )
    if rank == 0:
        results.update(
            rank_loaded=loaded,
            rank_stats=stats,
            rank_weights=weights,
            rank_moments=moments,
            rank_exported=exported,
            resumed_weights=resumed_weights,
            resumed_moments=resumed_moments,
            back_weights=back_weights,
            back_moments=back_moments,
        )
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process's step and checkpoint, then two Gloo ranks doing the same."""
    from posttrain.storage.store import LocalStore
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer, TrainerState

    root = tmp_path_factory.mktemp("two-ranks")
    single = Policy(tiny_model, learning_rate=LR)
    samples = _samples(single)
    base = {k: v.clone() for k, v in single.module.state_dict().items()}
    stats = single.train_step(
        samples, LossConfig(), micro_batch_size=4, grad_clip=1.0, temperature=1.0, step=1
    )
    weights, moments = _full_state(single)
    Checkpointer(LocalStore(root / "single"), keep_last=2, keep_best=False).save(
        single, TrainerState(1, 1, {}, {}, [], [], 0)
    )
    results = mp.Manager().dict()
    mp.spawn(
        _two_rank_worker,
        args=(
            free_port(),
            str(tiny_model),
            samples,
            str(root / "single"),
            str(root / "ranks"),
            results,
        ),
        nprocs=2,
        join=True,
    )
    return {
        "stats": stats,
        "weights": weights,
        "moments": moments,
        "base": base,
        "root": root,
        "bytes": _state_bytes(single),
        **results,
    }


@pytest.mark.slow  # two spawned ranks loading torch + a tiny model: ~1 min on 2 loaded cores
def test_two_rank_fsdp_step_equals_one_process_step(two_ranks: dict[str, Any]) -> None:
    """Same global batch, split over two ranks: the same loss, gradient norm and weights.

    Tolerances: :func:`assert_same_adam_update` (the ranks add their partial sums in
    another order than one process)."""
    one, two = two_ranks["stats"], two_ranks["rank_stats"]
    assert one.applied and two.applied and one.tokens == two.tokens == 18
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    base = two_ranks["base"]
    assert_same_adam_update(
        two_ranks["weights"],
        two_ranks["rank_weights"],
        two_ranks["moments"],
        two_ranks["rank_moments"],
        base,
        base,
        LR,
    )


@pytest.mark.slow
def test_ranks_reading_their_own_slices_load_what_one_process_loads(
    two_ranks: dict[str, Any],
) -> None:
    """The ranks build the model on the meta device and read only their shards' rows from
    the safetensors file (no full copy on any rank): the gathered result must be the very
    parameters ``from_pretrained`` gives one process, bit for bit, tied embeddings included."""
    loaded, base = two_ranks["rank_loaded"], two_ranks["base"]
    assert set(base) - {"model.lm_head.weight"} <= set(loaded)  # tied: may be listed once
    for name, value in loaded.items():
        assert torch.equal(value, base[name]), name


@pytest.mark.slow
def test_each_rank_holds_half_the_parameters_and_optimizer_state(
    two_ranks: dict[str, Any],
) -> None:
    one = two_ranks["bytes"]
    for rank in (0, 1):
        ratio = two_ranks[f"bytes{rank}"] / one
        assert 0.45 <= ratio <= 0.55, (rank, ratio)  # 1/world, up to dim-0 padding


@pytest.mark.slow
def test_streamed_export_of_the_shards_is_the_full_model(two_ranks: dict[str, Any]) -> None:
    exported, weights = two_ranks["rank_exported"], two_ranks["rank_weights"]
    assert "lm_head.weight" not in exported  # tied: loaders re-tie it
    assert set(exported) == {k.removeprefix("model.") for k in weights} - {"lm_head.weight"}
    for name, tensor in exported.items():
        assert torch.equal(tensor, weights[f"model.{name}"]), name


@pytest.mark.slow
def test_checkpoint_of_two_ranks_resumes_exactly_on_one(two_ranks: dict[str, Any]) -> None:
    from posttrain.storage.store import LocalStore
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer

    root = two_ranks["root"]
    restored = Checkpointer(LocalStore(root / "ranks"), keep_last=2, keep_best=False).restore(
        lambda d: Policy(d, learning_rate=LR), root / "scratch-one"
    )
    assert restored is not None
    policy, state = restored
    assert state.step == 1 and not policy.sharded
    weights, moments = _full_state(policy)
    for name, value in two_ranks["rank_weights"].items():
        assert torch.equal(weights[name], value), name
    for name, value in two_ranks["rank_moments"].items():
        assert torch.equal(moments[name], value), name
    manifest = json.loads(
        next((root / "ranks/checkpoints").glob("step-*/manifest.json")).read_text()
    )
    files = {f["path"] for f in manifest["files"]}
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= files  # both ranks'
    assert manifest["metadata"]["world_size"] == 2


@pytest.mark.slow
def test_ranks_resuming_fetch_only_the_slices_they_read(two_ranks: dict[str, Any]) -> None:
    """Two ranks resume what two ranks wrote: each fetches (block-verified) about its own
    shard file, not the whole sharded state, and no HF weights; the state is back exactly."""
    for rank in (0, 1):
        fetched, total = two_ranks[f"fetch{rank}"]
        assert 0 < fetched <= 0.75 * total, (rank, fetched, total)
        files = two_ranks[f"fetched_files{rank}"]
        assert "config.json" in files and ".metadata" in files
        assert not [f for f in files if f.endswith(".safetensors")], files
    for name, value in two_ranks["rank_weights"].items():
        assert torch.equal(two_ranks["back_weights"][name], value), name
    for name, value in two_ranks["rank_moments"].items():
        assert torch.equal(two_ranks["back_moments"][name], value), name


@pytest.mark.slow
def test_checkpoint_of_one_process_resumes_exactly_on_two_ranks(
    two_ranks: dict[str, Any],
) -> None:
    for name, value in two_ranks["weights"].items():
        assert torch.equal(two_ranks["resumed_weights"][name], value), name
    for name, value in two_ranks["moments"].items():
        assert torch.equal(two_ranks["resumed_moments"][name], value), name


def test_a_shard_damaged_in_the_store_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Damage found while a rank reads its slices (after the download chose the checkpoint)
    refuses that checkpoint as download damage would, and the previous one is loaded."""
    from posttrain.storage.store import LocalStore
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer, TrainerState

    policy = Policy(tiny_model, learning_rate=LR)
    saver = Checkpointer(LocalStore(tmp_path / "store"), keep_last=3, keep_best=False)
    for step in (1, 2):
        saver.save(policy, TrainerState(step, step, {}, {}, [], [], 0))
    shard = tmp_path / "store/checkpoints/step-00000002/dcp/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a bit flip: same size, so only the block digest sees it
    shard.write_bytes(bytes(data))
    loader = Checkpointer(LocalStore(tmp_path / "store"), keep_last=3, keep_best=False)
    with caplog.at_level("ERROR", logger="posttrain.trainer.checkpointing.checkpoint"):
        restored = loader.restore(lambda d: Policy(d, learning_rate=LR), tmp_path / "scratch")
    assert restored is not None
    assert restored[1].step == 1
    assert "refusing checkpoint step 2" in caplog.text and "fails its" in caplog.text


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_every_rank(
    two_ranks: dict[str, Any],
) -> None:
    for rank in (0, 1):
        applied, reason = two_ranks[f"skip{rank}"]
        assert not applied, f"rank {rank} applied a step that rank 1 found non-finite"
        assert "non-finite" in reason, reason
    before, after = two_ranks["skip_weights"]
    assert before and before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    moments_before, moments_after = two_ranks["skip_moments"]
    assert moments_before and moments_before.keys() == moments_after.keys()
    for name in moments_before:
        assert torch.equal(moments_before[name], moments_after[name]), name
