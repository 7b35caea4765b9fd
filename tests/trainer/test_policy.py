"""The optimizer step on a tiny real model: micro-batching, NaN guard, temperature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.algorithms.loss import LossConfig, sequence_coefficients
from posttrain.trainer.model.policy import Policy


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def _samples(policy: Policy) -> list[TrainSample]:
    """Four completions with their exact behaviour log-probs (on-policy)."""
    prompt = policy.encode_prompt("What is 2 + 2?")
    completions = [[28, 29, 30], [31, 32], [33, 34, 35, 36], [37]]
    advantages = [1.0, -1.0, 0.5, -0.5]
    coefficients = sequence_coefficients([len(c) for c in completions], "token_mean", 8)
    draft = [
        TrainSample(prompt, c, [0.0] * len(c), a, k)
        for c, a, k in zip(completions, advantages, coefficients, strict=True)
    ]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, draft, temperature=1.0)
    for i, sample in enumerate(draft):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    return draft


def _grads_after_step(model_dir: Path, micro_batch_size: int) -> dict[str, torch.Tensor]:
    policy = Policy(model_dir, learning_rate=1e-3)
    samples = _samples(policy)
    stats = policy.train_step(
        samples, LossConfig(), micro_batch_size=micro_batch_size, grad_clip=1e9, temperature=1.0
    )
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
    stats = policy.train_step(
        samples, LossConfig(), micro_batch_size=4, grad_clip=1.0, temperature=1.0
    )
    assert not stats.applied and "non-finite" in stats.skip_reason
    for name, value in policy.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_no_samples_means_no_step(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=1e-3)
    stats = policy.train_step([], LossConfig(), micro_batch_size=4, grad_clip=1.0, temperature=1.0)
    assert not stats.applied and stats.skip_reason == "no samples with signal"


def test_temperature_scales_logits(tiny_model: Path) -> None:
    policy = Policy(tiny_model, learning_rate=1e-3)
    samples = _samples(policy)[:1]
    with torch.no_grad():
        hot, _, _ = policy.completion_logprobs(policy.model, samples, temperature=2.0)
        cold, _, _ = policy.completion_logprobs(policy.model, samples, temperature=1.0)
    assert not torch.allclose(hot, cold)


def test_shared_prompt_forward_equals_separate_forwards(tiny_model: Path) -> None:
    """Each distinct prompt runs once and its KV cache serves its whole group: the logits
    and the gradients must be those of one full forward per sample."""
    from posttrain.trainer.algorithms.logprobs import _full_forward_logits, completion_logits

    policy = Policy(tiny_model, learning_rate=1e-3)
    short, long = policy.encode_prompt("2 + 2?"), policy.encode_prompt("What is 12 * 12? " * 3)
    single = policy.encode_prompt("Alone.")
    assert len(long) > len(short)  # the prompt pass is left-padded
    completions = [
        (long, [28, 29, 30]),
        (short, [31, 32]),
        (long, [33]),
        (single, [5, 6]),
        (short, [34, 35, 36, 37]),
        (long, [38, 39]),
    ]
    samples = [TrainSample(p, c, [0.0] * len(c), 1.0, 1.0) for p, c in completions]

    def logits_and_grads(fn: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        policy.model.zero_grad(set_to_none=True)
        logits = fn(policy.model, samples, policy.pad_id)  # type: ignore[operator]
        (logits.log_softmax(-1)[:, 40] * torch.arange(len(logits))).sum().backward()
        grads = {
            k: p.grad.clone() for k, p in policy.model.named_parameters() if p.grad is not None
        }
        return logits.detach(), grads

    shared, shared_grads = logits_and_grads(completion_logits)
    full, full_grads = logits_and_grads(_full_forward_logits)
    assert shared.shape == (sum(len(c) for _, c in completions), policy.model.config.vocab_size)
    torch.testing.assert_close(shared, full, rtol=1e-4, atol=1e-5)
    assert shared_grads.keys() == full_grads.keys()
    assert any(float(g.abs().max()) > 0 for g in full_grads.values())
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6)
