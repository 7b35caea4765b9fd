"""The loss mask of multi-turn samples: environment tokens are context, never targets."""

from __future__ import annotations

import pytest
import torch

from posttrain.trainer.algorithms.logprobs import TrainSample
from posttrain.trainer.algorithms.loss import LossConfig
from posttrain.trainer.model.policy import Policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    from posttrain.models import make_tiny_model

    return Policy(
        make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2), learning_rate=1e-3
    )


def _episode_sample(policy: Policy, behaviour: list[float]) -> TrainSample:
    # model turn (3 tokens), tool output (4 tokens), model turn (2 tokens)
    completion = [40, 41, 42, 50, 51, 52, 53, 43, 44]
    mask = [1, 1, 1, 0, 0, 0, 0, 1, 1]
    return TrainSample(
        policy.encode_prompt("list the files"),
        completion,
        behaviour,
        1.0,
        1.0 / sum(mask),
        loss_mask=mask,
    )


def _loss_and_grad(policy: Policy, sample: TrainSample) -> tuple[float, torch.Tensor]:
    policy.optimizer.zero_grad(set_to_none=True)
    logp, behaviour, mask = policy.completion_logprobs(policy.model, [sample], 1.0)
    from posttrain.trainer.algorithms.loss import clipped_policy_loss

    terms = clipped_policy_loss(
        logp,
        behaviour,
        torch.tensor([sample.advantage]),
        mask,
        torch.tensor([sample.coefficient]),
        LossConfig(),
    )
    terms.loss.backward()
    grad = policy.model.get_output_embeddings().weight.grad.clone()
    return float(terms.loss.detach()), grad


def test_mask_is_exactly_the_model_tokens(policy: Policy) -> None:
    sample = _episode_sample(policy, [-1.0] * 9)
    _, _, mask = policy.completion_logprobs(policy.model, [sample], 1.0)
    assert mask[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_environment_tokens_carry_no_gradient(policy: Policy) -> None:
    base = [-1.0] * 9
    loss, grad = _loss_and_grad(policy, _episode_sample(policy, base))
    # Changing the behaviour log-prob of a masked (tool output) token changes nothing ...
    for position in (3, 4, 5, 6):
        changed = list(base)
        changed[position] = -7.0
        other_loss, other_grad = _loss_and_grad(policy, _episode_sample(policy, changed))
        assert other_loss == loss
        assert torch.equal(other_grad, grad)
    # ... while every model token is a target: changing its behaviour log-prob moves the loss.
    for position in (0, 1, 2, 7, 8):
        changed = list(base)
        changed[position] = -7.0
        other_loss, _ = _loss_and_grad(policy, _episode_sample(policy, changed))
        assert other_loss != pytest.approx(loss, abs=1e-6)


def test_train_step_counts_only_model_tokens(policy: Policy) -> None:
    stats = policy.train_step(
        [_episode_sample(policy, [-1.0] * 9)],
        LossConfig(),
        micro_batch_size=1,
        grad_clip=1e9,
        temperature=1.0,
    )
    assert stats.applied and stats.tokens == 5


def test_mask_of_the_wrong_length_is_refused(policy: Policy) -> None:
    sample = _episode_sample(policy, [-1.0] * 9)
    sample.loss_mask = [1, 0]
    with pytest.raises(ValueError, match="2 entries for 9 completion tokens"):
        policy.completion_logprobs(policy.model, [sample], 1.0)
