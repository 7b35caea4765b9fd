"""Direct Preference Optimization (Rafailov et al., arXiv:2305.18290), sigmoid loss.

Per pair: ``-log sigmoid(beta * ((log π(c) - log π(r)) - (log π_ref(c) - log π_ref(r))))``
with ``log π(y)`` the summed log-probability of the answer's tokens after the prompt. The
reference is the *frozen stage-start model*: its log-probs are computed once per pair
before the stage's first update (:func:`policy_sequence_logps` under ``no_grad``) and checkpointed
with the stage, so no second model is held in memory and a resumed stage uses the same
reference (not the partly trained weights). TRL calls this ``precompute_ref_log_probs``.

Metrics follow TRL: implicit rewards ``β · (log π - log π_ref)`` of the chosen and the
rejected answer, their margin, and accuracy (the share of pairs whose chosen reward is
higher).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from posttrain.trainer.algorithms.logprobs import TrainSample, completion_logits
from posttrain.trainer.data.stage_data import PreferencePair

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class TokenLogprobsFn(Protocol):
    """What DPO needs of the policy: the log-prob of every completion token under its
    training engine (:meth:`posttrain.trainer.model.policy.Policy.token_logprobs`). A protocol, so
    the algorithm does not import the engine that runs it."""

    def token_logprobs(
        self, samples: Sequence[TrainSample], temperature: float = ...
    ) -> torch.Tensor: ...


def answer_samples(pairs: Sequence[PreferencePair]) -> list[TrainSample]:
    """Both answers of every pair as loss-forward samples: chosen, rejected, chosen, ...

    Both answers of a pair share their prompt, so the policy's forward runs it through the
    decoder once (:func:`posttrain.trainer.algorithms.logprobs.completion_hidden`).
    """
    return [
        TrainSample(p.prompt_ids, ids, [], 0.0, 0.0)
        for p in pairs
        for ids in (p.chosen_ids, p.rejected_ids)
    ]


def sum_per_answer(
    token_logp: torch.Tensor, answers: Sequence[TrainSample]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (N,) of :func:`answer_samples` -> summed per answer: chosen (B,),
    rejected (B,).

    >>> answers = answer_samples([PreferencePair([1], [2, 3], [4], "x")])
    >>> sum_per_answer(torch.tensor([-1.0, -2.0, -0.5]), answers)
    (tensor([-3.]), tensor([-0.5000]))
    """
    owner = torch.tensor(
        [i for i, a in enumerate(answers) for _ in a.completion_ids], device=token_logp.device
    )  # (N,)
    sums = torch.zeros(len(answers), dtype=token_logp.dtype, device=token_logp.device)
    sums = sums.index_add(0, owner, token_logp)  # (2B,)
    return sums[0::2], sums[1::2]  # (B,), (B,)


def policy_sequence_logps(
    policy: TokenLogprobsFn, pairs: Sequence[PreferencePair]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs (B,) of the chosen and rejected answers under the policy, through
    its training engine (the RL loss forward: FSDP root, precision, chunked LM head)."""
    answers = answer_samples(pairs)
    return sum_per_answer(policy.token_logprobs(answers), answers)  # (B,), (B,)


def sequence_logps(
    model: PreTrainedModel, pairs: Sequence[PreferencePair], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`policy_sequence_logps` for a plain HF model (tests, TRL comparison)."""
    answers = answer_samples(pairs)
    logits = completion_logits(model, answers, pad_id)  # (N, V)
    targets = torch.tensor([t for a in answers for t in a.completion_ids])  # (N,)
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    return sum_per_answer(token_logp, answers)


@dataclass
class DpoTerms:
    """Per-pair losses (B,) to average, and the detached implicit rewards (B,)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def dpo_loss(
    policy_chosen: torch.Tensor,  # (B,) summed log-probs under the policy
    policy_rejected: torch.Tensor,  # (B,)
    reference_chosen: torch.Tensor,  # (B,) under the frozen stage-start model
    reference_rejected: torch.Tensor,  # (B,)
    beta: float,
) -> DpoTerms:
    """The sigmoid DPO loss per pair.

    >>> t = dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]),
    ...              torch.tensor([-2.0]), beta=0.5)
    >>> round(float(t.losses[0]), 4), float(t.chosen_rewards[0]), float(t.rejected_rewards[0])
    (0.3133, 0.5, -0.5)
    """
    logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)  # (B,)
    losses = -torch.nn.functional.logsigmoid(beta * logits)  # (B,)
    chosen_rewards = beta * (policy_chosen - reference_chosen).detach()  # (B,)
    rejected_rewards = beta * (policy_rejected - reference_rejected).detach()  # (B,)
    return DpoTerms(losses, chosen_rewards, rejected_rewards)
