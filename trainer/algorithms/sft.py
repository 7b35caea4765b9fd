"""Supervised fine-tuning loss: next-token cross-entropy on completion tokens only.

Prompt tokens are context, never targets (what TRL's ``completion_only_loss`` does), so the
model learns to answer, not to reproduce prompts. With packing, several examples share one
row of up to ``maxLength`` tokens; their position ids restart at 0 per example, and
transformers turns restarting positions into a block-diagonal causal mask (its packed-sequence
path), so no token attends to another example: the loss equals the unpacked one
(``tests/trainer/test_stages.py`` checks both that and the loss itself against an
independent per-example cross-entropy). The padding that fills a row's tail is one more
"sequence" of its own whose positions predict nothing.

The loss is a *sum* over completion tokens, scaled by the caller with one batch-level
coefficient (1 / completion tokens in the whole step), so micro-batching never changes the
update (the same rule as the RL loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from posttrain.trainer.data.stage_data import SftExample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def pack_rows(lengths: Sequence[int], max_length: int, packing: bool) -> list[list[int]]:
    """Example indices per row: in order, a new row when the next one would not fit.

    >>> pack_rows([3, 4, 2, 5], 8, packing=True)
    [[0, 1], [2, 3]]
    >>> pack_rows([3, 4], 8, packing=False)
    [[0], [1]]
    """
    rows: list[list[int]] = []
    used = 0
    for i, length in enumerate(lengths):
        if not packing or not rows or used + length > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += length
    return rows


@dataclass
class PackedBatch:
    """Rows of packed examples and where each completion token's prediction is read."""

    input_ids: torch.Tensor  # (R, T)
    position_ids: torch.Tensor  # (R, T) restarting at 0 for every example (and the padding)
    rows: torch.Tensor  # (N,) row of the position predicting each completion token
    columns: torch.Tensor  # (N,) that position
    targets: torch.Tensor  # (N,) the completion token

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(
            *(
                t.to(device)
                for t in (self.input_ids, self.position_ids, self.rows, self.columns, self.targets)
            )
        )


def packed_batch(
    examples: Sequence[SftExample], max_length: int, pad_id: int, packing: bool
) -> PackedBatch:
    """Lay ``examples`` out in rows (see :func:`pack_rows`)."""
    sequences = [e.prompt_ids + e.completion_ids for e in examples]
    layout = pack_rows([len(s) for s in sequences], max_length, packing)
    width = max(sum(len(sequences[i]) for i in row) for row in layout)
    input_ids = torch.full((len(layout), width), pad_id, dtype=torch.long)  # (R, T)
    position_ids = torch.zeros((len(layout), width), dtype=torch.long)  # (R, T)
    rows: list[int] = []
    columns: list[int] = []
    targets: list[int] = []
    for r, row in enumerate(layout):
        offset = 0
        for i in row:
            ids, n_prompt = sequences[i], len(examples[i].prompt_ids)
            input_ids[r, offset : offset + len(ids)] = torch.tensor(ids)
            position_ids[r, offset : offset + len(ids)] = torch.arange(len(ids))
            n = len(examples[i].completion_ids)
            rows += [r] * n
            columns += range(offset + n_prompt - 1, offset + n_prompt - 1 + n)  # t predicts t+1
            targets += examples[i].completion_ids
            offset += len(ids)
        position_ids[r, offset:] = torch.arange(width - offset)  # padding: its own sequence
    return PackedBatch(
        input_ids, position_ids, torch.tensor(rows), torch.tensor(columns), torch.tensor(targets)
    )


def completion_token_logprobs(
    model: PreTrainedModel, batch: PackedBatch, chunk_tokens: int = 1024
) -> torch.Tensor:
    """Log-prob (N,) of every completion token of a packed batch.

    The LM head runs only at the positions predicting completion tokens (a (T, V) head over
    prompt positions would be wasted work), in chunks of ``chunk_tokens`` rows as in the RL
    loss (:func:`~posttrain.trainer.algorithms.logprobs.chunked_token_logprobs`), so memory
    is bounded by the chunk, not by completion tokens x vocabulary. Models whose forward post-processes
    logits (soft-capping, logit scales) take their full forward.
    """
    from posttrain.trainer.algorithms.logprobs import chunked_token_logprobs, input_device

    device = input_device(model)
    batch = batch.to(device)
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or hasattr(config, "logit_scale"):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        logits = logits[batch.rows, batch.columns].float()  # (N, V)
        chosen = logits.gather(-1, batch.targets[:, None]).squeeze(-1)  # (N,)
        return chosen - torch.logsumexp(logits, dim=-1)  # (N,)
    decoder = getattr(model, model.base_model_prefix)
    hidden = decoder(
        input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False
    ).last_hidden_state  # (R, T, H)
    return chunked_token_logprobs(
        hidden[batch.rows, batch.columns],  # (N, H)
        model.get_output_embeddings(),
        batch.targets,
        1.0,
        chunk_tokens,
    )  # (N,)


def sft_loss_sum(
    model: PreTrainedModel,
    examples: Sequence[SftExample],
    *,
    max_length: int,
    pad_id: int,
    packing: bool,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of every completion token, and how many there were.

    ``model`` is the plain HF model; the trainer runs this through the policy's FSDP root
    (:meth:`~posttrain.trainer.model.policy.Policy.run`).
    """
    batch = packed_batch(examples, max_length, pad_id, packing)
    logp = completion_token_logprobs(model, batch, chunk_tokens)  # (N,)
    return -logp.sum(), int(batch.targets.numel())
