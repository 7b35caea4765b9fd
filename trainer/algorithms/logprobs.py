"""Log-probabilities of completion tokens: the forward every objective shares.

RL's clipped loss, SFT's cross-entropy and DPO's sequence log-probs all need, for each
completion token, its log-probability under the model given the prompt and the tokens before
it. This module computes that forward on a plain Hugging Face model, once per distinct prompt
(:func:`completion_hidden`) and through the LM head in bounded chunks
(:func:`chunked_token_logprobs`); :class:`TokenLogprobs` is the same forward as one module,
which the training engine makes its FSDP root (:mod:`posttrain.trainer.model.policy`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Completion tokens whose (tokens x vocabulary) logits exist at once in the loss forward.
# 1024 x 49k fp32 logits = 200 MB; 1024 x 152k (Qwen) = 620 MB.
DEFAULT_LOGPROB_CHUNK_TOKENS = 1024

Objective = Callable[["PreTrainedModel"], torch.Tensor]
"""A forward of another objective (SFT's packed rows) run on the HF model inside the FSDP
root's forward: ``objective(model) -> tensor``."""


@dataclass
class TrainSample:
    """One completion ready for the loss."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # from the rollout server, one per completion token
    advantage: float
    coefficient: float  # from loss.sequence_coefficients (the batch normalisation)
    # Per completion token, 1 where the policy sampled it (gradient) and 0 where an
    # environment wrote it (a tool's output in a multi-turn episode: context, never a
    # target). None: every token is the policy's (single-turn completions).
    loss_mask: list[int] | None = None


class TokenLogprobs(torch.nn.Module):
    """The loss forward as one module: samples -> log-prob of every completion token (N,).

    It is the FSDP root, so whatever FSDP puts outside the decoder blocks (embeddings, final
    norm, LM head) is gathered for this forward. Log-probabilities come from the LM head in
    chunks of ``chunk_tokens`` completion tokens (:func:`chunked_token_logprobs`), so memory
    is bounded by the chunk, not by completion tokens x vocabulary.
    """

    model: PreTrainedModel

    def __init__(
        self, model: PreTrainedModel, pad_id: int, chunk_tokens: int, share_prompts: bool
    ) -> None:
        super().__init__()
        self.model = model
        self.pad_id = pad_id
        self.chunk_tokens = chunk_tokens
        self.share_prompts = share_prompts

    def forward(
        self,
        samples: Sequence[TrainSample],
        temperature: float,
        objective: Objective | None = None,
    ) -> torch.Tensor:
        if objective is not None:
            # Any other objective's forward goes through this root too, so FSDP gathers the
            # root's weights for it and reduce-scatters their gradients (:meth:`Policy.run`).
            return objective(self.model)
        device = input_device(self.model)
        targets = torch.tensor(
            [t for s in samples for t in s.completion_ids], device=device
        )  # (N,)
        if _post_processes_logits(self.model):
            logits = _full_forward_logits(self.model, samples, self.pad_id)  # (N, V)
            return _token_logprobs_from_logits(logits, targets, temperature)  # (N,)
        if self.share_prompts:
            hidden = completion_hidden(self.model, samples, self.pad_id)  # (N, H)
        else:
            hidden = _full_forward_hidden(self.model, samples, self.pad_id)  # (N, H)
        head = self.model.get_output_embeddings()
        return chunked_token_logprobs(hidden, head, targets, temperature, self.chunk_tokens)  # (N,)


def _token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log softmax(logits / T)[target] without materialising a second (n, V) tensor."""
    scaled = logits.float() / max(temperature, 1e-6)  # (n, V)
    chosen = scaled.gather(-1, targets[:, None]).squeeze(-1)  # (n,)
    return chosen - torch.logsumexp(scaled, dim=-1)  # (n,)


def _head_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    return _token_logprobs_from_logits(head(hidden), targets, temperature)  # (n,)


def chunked_token_logprobs(
    hidden: torch.Tensor,  # (N, H) states that predict each completion token
    head: torch.nn.Module,  # the LM head (H -> V)
    targets: torch.Tensor,  # (N,) the completion tokens
    temperature: float,
    chunk_tokens: int,
) -> torch.Tensor:
    """Log-probs (N,) of ``targets``, computing at most ``chunk_tokens`` rows of logits at once.

    With gradients and more than one chunk, each chunk is checkpointed: backward recomputes
    its logits instead of keeping them, so the (N, V) logits never exist, forward or
    backward, at the cost of one more LM-head matmul per token. A batch that fits one chunk
    is computed directly (its logits are already bounded by the chunk). Equal to the
    unchunked computation (tested).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled() and hidden.requires_grad and hidden.shape[0] > chunk_tokens
    pieces = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = hidden[start : start + chunk_tokens]  # (n, H)
        wanted = targets[start : start + chunk_tokens]  # (n,)
        if recompute:
            pieces.append(
                checkpoint(_head_logprobs, head, rows, wanted, temperature, use_reentrant=False)
            )
        else:
            pieces.append(_head_logprobs(head, rows, wanted, temperature))
    return torch.cat(pieces) if pieces else hidden.new_zeros(0)  # (N,)


def input_device(model: PreTrainedModel) -> torch.device:
    """Where the model takes its input ids: its input embedding's device (a DTensor's is
    this rank's)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight.device


def _post_processes_logits(model: PreTrainedModel) -> bool:
    """Models whose forward soft-caps or scales logits: the loss takes their full forward."""
    config = model.config
    return bool(getattr(config, "final_logit_softcapping", None)) or hasattr(config, "logit_scale")


def completion_hidden(
    model: PreTrainedModel, samples: Sequence[TrainSample], pad_id: int
) -> torch.Tensor:
    """Final hidden states (N, H) predicting every completion token, sample after sample.

    Two savings over one forward of every prompt + completion:

    - **Each distinct prompt runs once.** GRPO samples a group of completions per prompt;
      the prompts (left-padded) go through the decoder once, their KV cache is repeated for
      each completion of the group, and the completions (right-padded) run on top of it.
      Gradients from every completion flow back into the shared prompt pass, so the loss and
      its gradient are those of separate forwards (float summation order aside; tested).
      With 4 completions of 32 tokens after a 43-token prompt this is 43% fewer tokens through
      the decoder, ~30% less time per step for SmolLM2-135M on CPU.
    - **Only positions that predict a completion token are returned**, so the LM head never
      runs on a prompt position (a (T, V) matmul and softmax, V ~ 49k, nobody reads).
    """
    from posttrain.rollout.engine import distinct_prompts, left_padded

    device = input_device(model)
    decoder = getattr(model, model.base_model_prefix)
    prompts, group = distinct_prompts(s.prompt_ids for s in samples)
    prompt_ids, prompt_mask, prompt_positions = (
        t.to(device) for t in left_padded(prompts, pad_id)
    )  # (G, P) each
    out = decoder(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=prompt_positions,
        use_cache=True,
    )
    first = out.last_hidden_state[:, -1]  # (G, H): predicts each completion's first token
    group_index = torch.tensor(group, device=device)  # (B,)
    # Inputs after the prompt. At least one (padding, its output unused), so every call
    # makes the same two decoder passes: under FSDP each pass gathers every block, and a
    # rank whose micro-batch had only one-token completions (or a filler) would otherwise
    # make fewer collectives than the others and hang or corrupt the step.
    rest = max(1, max(len(s.completion_ids) for s in samples) - 1)
    later: torch.Tensor | None = None
    if rest > 0:
        cache = out.past_key_values
        cache.batch_select_indices(group_index)  # (G, ...) -> (B, ...), differentiable
        ids = torch.full((len(samples), rest), pad_id, dtype=torch.long)  # (B, C)
        mask = torch.zeros((len(samples), rest), dtype=torch.long)  # (B, C)
        for i, s in enumerate(samples):
            n = len(s.completion_ids) - 1
            ids[i, :n] = torch.tensor(s.completion_ids[:n])
            mask[i, :n] = 1
        starts = torch.tensor([len(prompts[g]) for g in group], device=device)  # (B,)
        later = decoder(
            input_ids=ids.to(device),
            attention_mask=torch.cat(
                [prompt_mask[group_index], mask.to(device)], dim=1
            ),  # (B, P+C)
            position_ids=starts[:, None] + torch.arange(rest, device=device)[None, :],  # (B, C)
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # (B, C, H)
    hidden = []
    for i, s in enumerate(samples):
        hidden.append(first[group[i]][None])
        if later is not None and len(s.completion_ids) > 1:
            hidden.append(later[i, : len(s.completion_ids) - 1])
    out_hidden = torch.cat(hidden)  # (N, H)
    if later is not None and all(len(s.completion_ids) == 1 for s in samples):
        # The second pass feeds no output here, so backward would skip it and make fewer
        # FSDP collectives than a rank whose micro-batch uses it: keep it in the graph.
        out_hidden = out_hidden + 0.0 * later.sum()
    return out_hidden


def completion_logits(
    model: PreTrainedModel, samples: Sequence[TrainSample], pad_id: int
) -> torch.Tensor:
    """Logits (N, V) predicting every completion token (:func:`completion_hidden` + LM head).

    Materialises (N, V): for tests and small batches; the loss uses
    :func:`chunked_token_logprobs`. Models whose forward post-processes logits
    (soft-capping, logit scales) take one full forward instead.
    """
    if _post_processes_logits(model):
        return _full_forward_logits(model, samples, pad_id)
    hidden = completion_hidden(model, samples, pad_id)  # (N, H)
    return model.get_output_embeddings()(hidden).float()  # (N, V)


def _full_batch(
    samples: Sequence[TrainSample], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion ids, their mask, and where completion tokens are
    predicted: ``(input_ids (B, T), attention (B, T), rows (N,), positions (N,))``."""
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    input_ids = torch.full((len(samples), max(lengths)), pad_id, dtype=torch.long)  # (B, T)
    attention = torch.zeros_like(input_ids)  # (B, T)
    rows: list[int] = []
    positions: list[int] = []
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.completion_ids
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        start, n = len(s.prompt_ids), len(s.completion_ids)
        rows += [i] * n
        positions += range(start - 1, start - 1 + n)  # logits at t predict token t+1
    return (
        input_ids.to(device),
        attention.to(device),
        torch.tensor(rows, device=device),
        torch.tensor(positions, device=device),
    )


def _full_forward_logits(
    model: PreTrainedModel, samples: Sequence[TrainSample], pad_id: int
) -> torch.Tensor:
    """:func:`completion_logits` by one forward of each prompt + completion (the reference
    the shared-prompt path is tested against)."""
    device = input_device(model)
    input_ids, attention, rows, positions = _full_batch(samples, pad_id, device)
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # (B, T, V)
    return logits[rows, positions].float()  # (N, V)


def _full_forward_hidden(
    model: PreTrainedModel, samples: Sequence[TrainSample], pad_id: int
) -> torch.Tensor:
    """:func:`completion_hidden` by one decoder forward of each prompt + completion (no KV
    cache: what activation checkpointing needs)."""
    device = input_device(model)
    input_ids, attention, rows, positions = _full_batch(samples, pad_id, device)
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(
        input_ids=input_ids, attention_mask=attention, use_cache=False
    ).last_hidden_state  # (B, T, H)
    return hidden[rows, positions]  # (N, H)
