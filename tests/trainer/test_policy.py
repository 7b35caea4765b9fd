"""The optimizer step on a tiny real model: micro-batching, NaN guard, temperature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.trainer.loss import LossConfig, sequence_coefficients
from posttrain.trainer.policy import Policy, TrainSample


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def _samples(policy: Policy) -> list[TrainSample]:
    """Four completions with their exact behaviour log-probs (on-policy)."""
    prompt = policy.encode_prompt("What is 2 + 2?")
    completions = [[28, 29, 30], [31, 32], [33, 34, 35, 36], [37]]
    advantages = [1.0, -1.0, 0.5, -0.5]
    coefficients = sequence_coefficients([len(c) for c in completions], [1.0] * 4,
                                         "token_mean", 8)
    draft = [TrainSample(prompt, c, [0.0] * len(c), a, k)
             for c, a, k in zip(completions, advantages, coefficients, strict=True)]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, draft, temperature=1.0)
    for i, sample in enumerate(draft):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    return draft


def _grads_after_step(model_dir: Path, micro_batch_size: int) -> dict[str, torch.Tensor]:
    policy = Policy(model_dir, learning_rate=1e-3)
    samples = _samples(policy)
    stats = policy.train_step(samples, LossConfig(), micro_batch_size=micro_batch_size,
                              grad_clip=1e9, temperature=1.0)
    assert stats.applied and stats.tokens == 10
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy
    # The accumulated gradient is what micro-batching could change. (Comparing Adam's first
    # update instead amplifies float noise: for |g| near eps it is g / (|g| + eps).)
    return {k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None}


def test_micro_batch_size_does_not_change_the_update(tiny_model: Path) -> None:
    whole = _grads_after_step(tiny_model, micro_batch_size=4)
    split = _grads_after_step(tiny_model, micro_batch_size=1)
    assert any(float(d.abs().max()) > 0 for d in whole.values())
    for name in whole:
        # float summation order differs between the two splits by ~1e-7
        torch.testing.assert_close(whole[name], split[name], rtol=1e-4, atol=1e-6)


def test_non_finite_loss_skips_the_step(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=1e-3)
    samples = _samples(policy)
    samples[0].advantage = float("nan")
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    stats = policy.train_step(samples, LossConfig(), micro_batch_size=4, grad_clip=1.0,
                              temperature=1.0)
    assert not stats.applied and "non-finite" in stats.skip_reason
    for name, value in policy.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_no_samples_means_no_step(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=1e-3)
    stats = policy.train_step([], LossConfig(), micro_batch_size=4, grad_clip=1.0,
                              temperature=1.0)
    assert not stats.applied and stats.skip_reason == "no samples with signal"


def test_temperature_scales_logits(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=1e-3)
    samples = _samples(policy)[:1]
    with torch.no_grad():
        hot, _, _ = policy.completion_logprobs(policy.model, samples, temperature=2.0)
        cold, _, _ = policy.completion_logprobs(policy.model, samples, temperature=1.0)
    assert not torch.allclose(hot, cold)
