"""The RL math on small hand-computed examples (no model, no server)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.trainer.algorithms.advantages import compute_advantages, group_advantages
from posttrain.trainer.algorithms.loss import (
    LossConfig,
    clipped_policy_loss,
    k3_kl,
    sequence_coefficients,
)
from posttrain.trainer.rewards.scoring import overlong_penalty


def test_grpo_advantages_match_hand_computation() -> None:
    # rewards 1,0,0,0: mean 0.25, population std sqrt(3)/4 = 0.4330
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], scale_by_std=True)
    assert adv[0] == pytest.approx(0.75 / 0.4330127, rel=1e-5)
    assert adv[1] == pytest.approx(-0.25 / 0.4330127, rel=1e-5)
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_dr_grpo_does_not_scale_by_std() -> None:
    out = compute_advantages([[1.0, 0.0, 0.0, 0.0]], algorithm="dr_grpo", dynamic_sampling=False)
    assert out[0].advantages == [0.75, -0.25, -0.25, -0.25]


def test_dynamic_sampling_drops_only_uniform_groups() -> None:
    groups = [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    kept = [g.kept for g in compute_advantages(groups, algorithm="dapo", dynamic_sampling=True)]
    assert kept == [False, False, True]
    kept = [g.kept for g in compute_advantages(groups, algorithm="dapo", dynamic_sampling=False)]
    assert kept == [True, True, True]


def test_unknown_algorithm_is_rejected() -> None:
    with pytest.raises(ValueError, match="ppo"):
        compute_advantages([[1.0, 0.0]], algorithm="ppo", dynamic_sampling=True)


def test_overlong_penalty_ramp() -> None:
    # max 100 tokens, buffer 20: free up to 80, then linear to -0.5 at 100 and beyond
    assert overlong_penalty(80, 100, 20, 0.5) == 0.0
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(130, 100, 20, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 0, 0.5) == 0.0  # disabled


def test_k3_kl_is_zero_on_equal_policies_and_positive_otherwise() -> None:
    logp = torch.tensor([-1.0, -2.0])
    assert torch.allclose(k3_kl(logp, logp), torch.zeros(2))
    # r = ref - logp = 0.5: exp(0.5) - 0.5 - 1 = 0.148721
    assert float(k3_kl(torch.tensor([-1.0]), torch.tensor([-0.5]))) == pytest.approx(0.1487212)


def test_normalisations() -> None:
    # lengths 1 and 3: token_mean weighs each token 1/4, sequence_mean 1/(2*len), constant 1/(2*4)
    assert sequence_coefficients([1, 3], "token_mean", 4) == [0.25, 0.25]
    assert sequence_coefficients([1, 3], "sequence_mean", 4) == [0.5, 1 / 6]
    assert sequence_coefficients([1, 3], "constant", 4) == [0.125, 0.125]
    with pytest.raises(ValueError, match="aggregation"):
        sequence_coefficients([1], "median", 4)


def _loss(logp: list[float], behaviour: list[float], advantage: float, **cfg: float) -> float:
    terms = clipped_policy_loss(
        torch.tensor([logp]),
        torch.tensor([behaviour]),
        torch.tensor([advantage]),
        torch.ones(1, len(logp)),
        torch.tensor([1.0 / len(logp)]),  # token mean over one sequence
        LossConfig(**cfg),
    )
    return float(terms.loss)


def test_on_policy_loss_is_minus_advantage() -> None:
    assert _loss([-1.0, -2.0], [-1.0, -2.0], 0.5) == pytest.approx(-0.5)


def test_asymmetric_clip() -> None:
    # ratio e^0.5 = 1.6487 with positive advantage: clipped at 1 + clip_high = 1.28
    assert _loss([-0.5], [-1.0], 1.0, clip_low=0.2, clip_high=0.28) == pytest.approx(-1.28)
    # same ratio with negative advantage: min(-1.6487, -1.28) = -1.6487, i.e. unclipped
    assert _loss([-0.5], [-1.0], -1.0) == pytest.approx(math.exp(0.5), rel=1e-5)
    # ratio e^-0.5 = 0.6065 with positive advantage: min(0.6065, 0.8) -> 0.6065 (unclipped)
    assert _loss([-1.5], [-1.0], 1.0) == pytest.approx(-math.exp(-0.5), rel=1e-5)
    # ratio 0.6065 with negative advantage: clipped at 1 - clip_low = 0.8
    assert _loss([-1.5], [-1.0], -1.0, clip_low=0.2) == pytest.approx(0.8)


def test_clipped_tokens_have_no_gradient() -> None:
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    terms = clipped_policy_loss(
        logp,
        torch.tensor([[-1.0, -1.0]]),
        torch.tensor([1.0]),
        torch.ones(1, 2),
        torch.tensor([0.5]),
        LossConfig(),
    )
    terms.loss.backward()
    assert logp.grad is not None
    assert float(logp.grad[0, 0]) == 0.0  # clipped: ratio 1.65 > 1.28
    assert float(logp.grad[0, 1]) == pytest.approx(-0.5)  # d(-ratio*A*0.5)/dlogp at ratio 1
    assert terms.clipped_tokens == 1.0


def test_kl_term_is_added_with_its_coefficient() -> None:
    base = clipped_policy_loss(
        torch.tensor([[-1.0]]),
        torch.tensor([[-1.0]]),
        torch.tensor([0.0]),
        torch.ones(1, 1),
        torch.tensor([1.0]),
        LossConfig(kl_coef=0.1),
        ref_logp=torch.tensor([[-0.5]]),
    )
    assert float(base.loss) == pytest.approx(0.1 * 0.1487212, rel=1e-5)
    assert base.kl_sum == pytest.approx(0.1487212, rel=1e-5)


def test_masked_tokens_do_not_count() -> None:
    terms = clipped_policy_loss(
        torch.tensor([[-1.0, -9.0]]),
        torch.tensor([[-1.0, -1.0]]),
        torch.tensor([1.0]),
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([1.0]),
        LossConfig(),
    )
    assert float(terms.loss) == pytest.approx(-1.0)
    assert terms.tokens == 1.0
