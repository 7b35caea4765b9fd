"""The policy-gradient loss: PPO-style clipped ratio, asymmetric clip, KL, normalisation.

The ratio is taken against the *behaviour* log-probabilities the rollout server
reported for the sampled tokens, not against a second trainer forward pass: that is
the importance correction that keeps the update honest when the sampler's weights lag
the trainer's (async rollouts) or its numerics differ. DAPO's asymmetric clip
(``clip_high > clip_low``) lets low-probability tokens grow faster, which keeps entropy
from collapsing. How per-token losses are averaged changes the gradient a lot:

* ``token_mean`` (DAPO): every generated token in the batch weighs the same;
* ``sequence_mean`` (original GRPO): mean per sequence, then over sequences, so tokens
  of long answers count less;
* ``constant`` (Dr. GRPO): token sum divided by ``num_sequences * max_new_tokens``,
  which removes the length bias of both.

``importance_sampling="sequence"`` is GSPO (arXiv:2507.18071): one ratio per completion,
``exp(mean over its tokens of log pi/pi_old)``, clipped as a whole, instead of one per
token. A few tokens far off-policy (routing changes in an MoE, sampler numerics) then move
the ratio by their share of the sequence instead of dominating it; GRPO's token ratios
multiply noise in long answers. Sequence ratios sit much closer to 1 than token ratios, so
GSPO's clip range is far narrower (the paper: 3e-4 below, 4e-4 above). TRL's
``importance_sampling_level="sequence"`` computes the same ratio.

Coefficients are computed once for the whole batch (:func:`sequence_coefficients`) so
that splitting the batch into micro-batches gives exactly the same gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from posttrain.api import AlgorithmSpec


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    aggregation: str = "token_mean"  # token_mean | sequence_mean | constant
    max_new_tokens: int = 128
    importance_sampling: str = "token"  # token (PPO/GRPO) | sequence (GSPO)


def loss_config(algorithm: AlgorithmSpec) -> LossConfig:
    """Map the spec's algorithm to loss settings (Dr. GRPO implies constant normalisation,
    GSPO a sequence-level importance ratio)."""
    aggregation = "constant" if algorithm.name == "dr_grpo" else algorithm.loss_aggregation
    return LossConfig(
        clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high,
        kl_coef=algorithm.kl_coef,
        aggregation=aggregation,
        max_new_tokens=algorithm.max_new_tokens,
        importance_sampling="sequence" if algorithm.name == "gspo" else "token",
    )


def sequence_coefficients(
    lengths: Sequence[int], aggregation: str, max_new_tokens: int
) -> list[float]:
    """Factor multiplying each sequence's token-loss *sum* so the batch loss is the mean.

    Every sequence gets the same factor whatever its domain: a domain's weight is applied
    once, when the curriculum shares out the batch's prompts (docs/trainer.md, "Domain
    weights"), so scaling its gradient too would square it.

    >>> sequence_coefficients([2, 4], "token_mean", 8)
    [0.16666666666666666, 0.16666666666666666]
    >>> sequence_coefficients([2, 4], "sequence_mean", 8)
    [0.25, 0.125]
    >>> sequence_coefficients([2, 4], "constant", 8)
    [0.0625, 0.0625]
    """
    n = len(lengths)
    if aggregation == "token_mean":
        total = max(1, sum(lengths))
        return [1.0 / total] * n
    if aggregation == "sequence_mean":
        return [1.0 / (max(1, length) * n) for length in lengths]
    if aggregation == "constant":
        return [1.0 / (n * max_new_tokens)] * n
    raise ValueError(
        f"unknown loss aggregation {aggregation!r}; use token_mean, sequence_mean or constant"
    )


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || reference): exp(r) - r - 1 with r = ref - logp.

    Unbiased for samples drawn from the policy and always >= 0 (Schulman's "k3").

    >>> round(float(k3_kl(torch.tensor([0.0]), torch.tensor([-1.0]))), 4)
    0.3679
    """
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass
class LossTerms:
    """The scalar to backpropagate plus diagnostics summed over the micro-batch's tokens."""

    loss: torch.Tensor  # already multiplied by the batch coefficients
    clipped_tokens: float
    tokens: float
    ratio_sum: float
    kl_sum: float


def clipped_policy_loss(
    logp: torch.Tensor,  # (B, T) log-probs of the sampled tokens under the current policy
    behaviour_logp: torch.Tensor,  # (B, T) log-probs reported by the rollout server
    advantages: torch.Tensor,  # (B,)
    mask: torch.Tensor,  # (B, T) 1.0 on completion tokens
    coefficients: torch.Tensor,  # (B,) from sequence_coefficients
    config: LossConfig,
    ref_logp: torch.Tensor | None = None,  # (B, T) frozen reference, when kl_coef > 0
) -> LossTerms:
    """Sum over tokens of coefficient * (-min(ratio*A, clip(ratio)*A) + kl_coef * KL).

    With ratio 1 (on-policy) the gradient is the plain REINFORCE-with-baseline one. The
    ratio is per token, or per sequence (broadcast to its tokens) for
    ``importance_sampling="sequence"``:

    >>> lp, old = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -0.7]])
    >>> cfg = LossConfig(clip_low=0.2, clip_high=0.2, importance_sampling="sequence")
    >>> terms = clipped_policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2),
    ...                             torch.tensor([0.5]), cfg)
    >>> round(float(terms.loss), 4)  # -exp((0.5 - 0.3) / 2) = -1.1052, over 2 tokens x 0.5
    -1.1052
    """
    log_ratio = (logp - behaviour_logp).clamp(-20.0, 20.0)  # (B, T) avoid exp overflow
    if config.importance_sampling == "sequence":
        tokens = mask.sum(-1).clamp(min=1.0)  # (B,)
        log_ratio = ((log_ratio * mask).sum(-1) / tokens)[:, None]  # (B, 1)
    elif config.importance_sampling != "token":
        raise ValueError(
            f"unknown importance sampling level {config.importance_sampling!r}; "
            "use token or sequence"
        )
    ratio = torch.exp(log_ratio).expand_as(logp)  # (B, T)
    adv = advantages[:, None]  # (B, 1)
    unclipped = ratio * adv  # (B, T)
    clipped = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high) * adv  # (B, T)
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    kl_sum = 0.0
    if ref_logp is not None and config.kl_coef > 0:
        kl = k3_kl(logp, ref_logp)  # (B, T)
        per_token = per_token + config.kl_coef * kl
        kl_sum = float((kl * mask).sum().detach())
    loss = (per_token * mask * coefficients[:, None]).sum()  # scalar
    was_clipped = (unclipped != clipped).float() * mask  # (B, T)
    return LossTerms(
        loss=loss,
        clipped_tokens=float(was_clipped.sum()),
        tokens=float(mask.sum()),
        ratio_sum=float((ratio.detach() * mask).sum()),
        kl_sum=kl_sum,
    )
