"""GSPO, RLOO and REINFORCE++: each against its paper's formula on fixed numbers, and
GSPO's loss and RLOO's advantages against TRL's own code on the same batch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.api import AlgorithmSpec
from posttrain.trainer.algorithms.advantages import batch_whiten, compute_advantages
from posttrain.trainer.algorithms.loss import (
    LossConfig,
    clipped_policy_loss,
    loss_config,
    sequence_coefficients,
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


# ------------------------------------------------------------------ RLOO


def test_rloo_is_reward_minus_the_mean_of_the_others() -> None:
    rewards = [1.0, 0.0, 0.5, 0.0]
    out = compute_advantages([rewards], algorithm="rloo", dynamic_sampling=False)
    # by hand: 1 - (0 + 0.5 + 0)/3, 0 - (1 + 0.5 + 0)/3, 0.5 - (1 + 0 + 0)/3, 0 - 1.5/3
    assert out[0].advantages == pytest.approx([1 - 0.5 / 3, -0.5, 0.5 - 1 / 3, -0.5])
    n, mean = len(rewards), sum(rewards) / len(rewards)  # the identity n/(n-1) (r_i - mean)
    assert out[0].advantages == pytest.approx([n / (n - 1) * (r - mean) for r in rewards])


def test_rloo_drops_uniform_groups_and_gives_a_lone_sample_nothing() -> None:
    out = compute_advantages(
        [[1.0, 1.0], [0.0], [1.0, 0.0]], algorithm="rloo", dynamic_sampling=True
    )
    assert [(g.kept, g.advantages) for g in out] == [
        (False, [0.0, 0.0]),
        (False, [0.0]),
        (True, [1.0, -1.0]),
    ]


# ------------------------------------------------------------------ REINFORCE++


def test_reinforce_pp_normalises_over_the_batch_not_the_group() -> None:
    groups = [[1.0, 0.0, 0.0, 0.0], [0.6, 0.4, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]]
    lengths = [[3, 5, 2, 4], [1, 1, 6, 2], [4, 4, 4, 4]]
    out = compute_advantages(
        groups, algorithm="reinforce_pp", dynamic_sampling=True, lengths=lengths
    )
    assert [g.kept for g in out] == [True, True, False]
    # by hand: group means 0.25 and 0.5, so centred values; their token-weighted mean and
    # unbiased token-weighted variance over the 24 tokens of the two kept groups
    centred = [0.75, -0.25, -0.25, -0.25, 0.1, -0.1, 0.0, 0.0]
    weights = [3, 5, 2, 4, 1, 1, 6, 2]
    tokens = sum(weights)
    mean = sum(c * w for c, w in zip(centred, weights, strict=True)) / tokens
    var = sum(w * (c - mean) ** 2 for c, w in zip(centred, weights, strict=True)) / (tokens - 1)
    want = [(c - mean) / math.sqrt(var + 1e-8) for c in centred]
    assert out[0].advantages + out[1].advantages == pytest.approx(want, rel=1e-9)
    assert out[2].advantages == [0.0] * 4
    # the small-spread group keeps a small advantage (GRPO's per-group std would inflate it
    # to the same size as the first group's)
    assert max(map(abs, out[1].advantages)) < 0.3 * max(map(abs, out[0].advantages))


def test_batch_whiten_matches_torch_on_token_tiled_values() -> None:
    values, weights = [0.3, -1.2, 0.7], [2, 1, 4]
    tiled = torch.tensor(
        [v for v, w in zip(values, weights, strict=True) for _ in range(w)], dtype=torch.float64
    )
    want = (tiled - tiled.mean()) / torch.sqrt(tiled.var(unbiased=True) + 1e-8)
    got = batch_whiten(values, weights)
    assert [float(want[sum(weights[:i])]) for i in range(3)] == pytest.approx(got, rel=1e-12)


# ------------------------------------------------------------------ GSPO


def test_gspo_ratio_is_the_exponent_of_the_mean_token_log_ratio() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.4, -9.0]], requires_grad=True)  # (B, T)
    behaviour = torch.tensor([[-1.1, -1.7, -0.6], [-0.2, -0.45, -1.0]])  # (B, T)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the 2nd row's 3rd token is padding
    adv = torch.tensor([1.0, -1.0])
    coefficients = torch.tensor(sequence_coefficients([3, 2], "sequence_mean", 8))
    config = LossConfig(clip_low=0.03, clip_high=0.04, importance_sampling="sequence")
    terms = clipped_policy_loss(logp, behaviour, adv, mask, coefficients, config)
    # s_i = exp(mean of masked log-ratios): row 0 (0.1 - 0.3 + 0.1)/3, row 1 (-0.1 + 0.05)/2
    s0, s1 = math.exp(-0.1 / 3), math.exp(-0.05 / 2)
    # A=+1: s0 = 0.967 < 0.97, and min(s0, clip(s0)) = s0 (below the range a positive
    # advantage is not clipped); A=-1: s1 = 0.975 is inside [0.97, 1.04]. Both rows are
    # sequence_mean-weighted 1/2 (their token coefficients 1/(2*len) times len tokens).
    want = (-s0 + s1) / 2
    assert float(terms.loss.detach()) == pytest.approx(want, rel=1e-4, abs=1e-7)
    terms.loss.backward()
    # every token of a sequence gets the sequence's gradient share: d(-s0/2)/dlogp_t = -s0/6
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([-s0 / 6] * 3, rel=1e-5)
    assert logp.grad[1].tolist() == pytest.approx([s1 / 4, s1 / 4, 0.0], rel=1e-5)


def test_gspo_clips_whole_sequences() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.2, -1.0]])  # mean log-ratio 0.1: s = 1.105 > 1 + 0.04
    config = LossConfig(clip_low=0.03, clip_high=0.04, importance_sampling="sequence")
    terms = clipped_policy_loss(
        logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([0.5]), config
    )
    assert float(terms.loss.detach()) == pytest.approx(-1.04)
    assert terms.clipped_tokens == 2  # both tokens, the sequence clipped as one
    terms.loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() == 0
    # the token ratio would have clipped only the first token (exp(0.2)), not the second (1.0)
    token = clipped_policy_loss(
        logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([0.5]),
        LossConfig(clip_low=0.03, clip_high=0.04),
    )  # fmt: skip
    assert token.clipped_tokens == 1


def test_algorithm_names_map_to_the_loss() -> None:
    assert loss_config(AlgorithmSpec(name="gspo")).importance_sampling == "sequence"
    for name in ("grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp"):
        assert loss_config(AlgorithmSpec(name=name)).importance_sampling == "token"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reinforce_pp"):
        AlgorithmSpec(name="ppo")  # type: ignore[arg-type]


# ------------------------------------------------------------------ against TRL


def _token_logps(
    model: Any, input_ids: torch.Tensor, attention: torch.Tensor, completion: int
) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # (B, P+C, V)
    logits = logits[:, -completion - 1 : -1].float()  # (B, C, V) the positions predicting C
    targets = input_ids[:, -completion:]  # (B, C)
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1)  # (B, C)


def _grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "aggregation,loss_type", [("sequence_mean", "grpo"), ("token_mean", "bnpo")]
)
def test_gspo_loss_and_gradient_equal_trl(
    tiny_model: Path, tmp_path: Path, aggregation: str, loss_type: str
) -> None:
    """Our GSPO loss and TRL's GRPOTrainer with importance_sampling_level="sequence" on the
    same batch, model, advantages and behaviour log-probs (off-policy, so the ratio is not 1
    and some sequences clip), with the k3 KL term on."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    clip_low, clip_high, beta = 0.003, 0.004, 0.05
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        importance_sampling_level="sequence",
        loss_type=loss_type,
        epsilon=clip_low,
        epsilon_high=clip_high,
        beta=beta,
        num_generations=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 4),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1
    g = torch.Generator().manual_seed(0)
    B, P, C = 4, 5, 6
    prompt_ids = torch.randint(3, 200, (B, P), generator=g)
    completion_ids = torch.randint(3, 200, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0  # shorter completions, right-padded
    completion_mask[3, 2:] = 0
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), completion_mask], 1)
    with torch.no_grad():
        current = _token_logps(model, input_ids, attention, C)
        ref_logp = _token_logps(reference, input_ids, attention, C)
    # the sampler's log-probs: near the policy's, so some sequence ratios clip and some not
    behaviour = current + 0.01 * torch.randn(B, C, generator=g)
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": behaviour,
        "ref_per_token_logps": ref_logp,
        "num_items_in_batch": completion_mask.sum(),
    }
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)

    mask = completion_mask.float()
    lengths = [int(n) for n in completion_mask.sum(1)]
    config = LossConfig(
        clip_low=clip_low,
        clip_high=clip_high,
        kl_coef=beta,
        aggregation=aggregation,
        max_new_tokens=C,
        importance_sampling="sequence",
    )
    coefficients = torch.tensor(sequence_coefficients(lengths, aggregation, C))
    logp = _token_logps(model, input_ids, attention, C)
    terms = clipped_policy_loss(logp, behaviour, advantages, mask, coefficients, config, ref_logp)
    terms.loss.backward()
    ours = _grads(model)

    seq_ratio = torch.exp(((current - behaviour) * mask).sum(1) / mask.sum(1))
    clipped = (seq_ratio < 1 - clip_low) | (seq_ratio > 1 + clip_high)
    assert clipped.any() and not clipped.all()  # both branches of the clip are exercised
    torch.testing.assert_close(terms.loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-7)
    assert ours.keys() == trl_grads.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], trl_grads[name], rtol=1e-4, atol=1e-7)


def test_rloo_advantages_equal_trl(tiny_model: Path, tmp_path: Path) -> None:
    """TRL's RLOOTrainer scores a real generated batch with fixed rewards; our RLOO
    advantages of the same rewards are TRL's."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    G = 4
    rewards = [1.0, 0.0, 0.0, 0.5, 0.2, 0.2, 0.9, 0.0]  # two prompts x G completions
    seen: list[int] = []

    def fixed_rewards(completions: list[Any], **_: Any) -> list[float]:
        seen.append(len(completions))
        return rewards[: len(completions)]

    args = RLOOConfig(
        output_dir=str(tmp_path / "trl"),
        num_generations=G,
        per_device_train_batch_size=len(rewards),
        max_completion_length=3,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,
    )
    trainer = RLOOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32),
        reward_funcs=fixed_rewards,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}]),
        processing_class=AutoTokenizer.from_pretrained(tiny_model),
    )
    batch = [{"prompt": p} for p in ("What is 2+2?", "Name a colour.") for _ in range(G)]
    out = trainer._generate_and_score_completions(batch)
    assert seen == [len(rewards)]
    groups = [rewards[:G], rewards[G:]]
    ours = compute_advantages(groups, algorithm="rloo", dynamic_sampling=False)
    flat = [a for g in ours for a in g.advantages]
    assert out["advantages"].tolist() == pytest.approx(flat, rel=1e-6, abs=1e-7)


def test_prepare_batch_weighs_reinforce_pp_by_each_completions_tokens() -> None:
    """Through the loop's batch stage: the whitening statistics count a completion once per
    loss token, as verl's masked_whiten over the response mask does."""
    from posttrain.rollout.protocol import Completion
    from posttrain.trainer.data.datasets import Task
    from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
    from posttrain.trainer.rewards.scoring import ScoredSample
    from posttrain.trainer.run.batch import prepare_batch

    lengths, rewards = [1, 3, 2, 2], [1.0, 0.0, 1.0, 0.0]
    group = [Completion(0, "x", [7] * n, [-0.1] * n, "stop", 0) for n in lengths]
    batch = RolloutBatch(RolloutRequest(0, [Task("m", "p", "1")], [[1]], seed=0), [group], 1.0)
    scored = [[ScoredSample(r, r, 0.0, r == 1.0) for r in rewards]]
    prepared = prepare_batch(batch, scored, algorithm="reinforce_pp", dynamic_sampling=True,
                             loss_config=LossConfig(), step=1)  # fmt: skip
    centred = [0.5, -0.5, 0.5, -0.5]  # group mean 0.5
    mean = sum(c * n for c, n in zip(centred, lengths, strict=True)) / 8  # -1/16 over tokens
    var = sum(n * (c - mean) ** 2 for c, n in zip(centred, lengths, strict=True)) / 7
    want = [(c - mean) / math.sqrt(var + 1e-8) for c in centred]
    assert [s.advantage for s in prepared.samples] == pytest.approx(want, rel=1e-9)


@pytest.mark.slow  # a rollout-server process and two RL steps per algorithm: ~10 s each
@pytest.mark.parametrize("name", ["rloo", "reinforce_pp", "gspo"])
def test_each_algorithm_runs_the_loop_and_moves_the_weights(
    tiny_model: Path, tmp_path: Path, name: str
) -> None:
    """spec.algorithm.name through the whole loop (rundata -> batch -> loss -> step):
    finite losses, applied steps, weights that moved."""
    from safetensors.torch import load_file

    from posttrain.api import TrainingRunSpec
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.observe.step_metrics import load_metrics
    from posttrain.trainer.run.loop import train
    from posttrain.trainer.run.server_process import LocalRolloutServer

    clip = {"clipLow": 3e-4, "clipHigh": 4e-4} if name == "gspo" else {}
    spec = TrainingRunSpec.model_validate(
        {
            "model": str(tiny_model),
            "algorithm": {"name": name, "groupSize": 4, "promptsPerStep": 3, "maxSteps": 2,
                          "learningRate": 1e-3, "maxNewTokens": 6, "microBatchSize": 4,
                          "dynamicSampling": False, "seed": 3, **clip},
            "domains": [{"name": "arithmetic", "dataset": "builtin:arithmetic",
                         "verifier": {"kind": "regex", "config": {"pattern": "^[a-m]"}}}],
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 2, "keepLast": 1},
        }
    )  # fmt: skip
    out = tmp_path / "run"
    with LocalRolloutServer(spec.model, tmp_path / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            assert train(spec, out, client).steps_done == 2
        finally:
            client.close()
    metrics = load_metrics(out)
    assert all(math.isfinite(m["loss"]) and m["applied"] for m in metrics)
    assert any(0 < m["reward_mean"] < 1 for m in metrics)  # a reward spread: a gradient
    before = load_file(str(tiny_model / "model.safetensors"))
    after = load_file(str(out / "checkpoints/latest/model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
