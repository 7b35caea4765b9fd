"""Stages of one run (SFT -> DPO -> RL): step ranges, the SFT/DPO step, stage records.

Steps are numbered globally across stages (``status.step``, checkpoints and
``metrics.jsonl`` lines never repeat a number): stage *i* owns steps ``first_step ..
last_step``. A checkpoint is always written at a stage's last step, so the next stage starts
from exactly those weights (with a fresh optimizer at its own learning rate), and a resumed
run finds its place from the checkpoint's step alone: inside a stage it restores that
stage's optimizer and state; at a boundary it starts the next stage.

The SFT and DPO steps run on the same :class:`~posttrain.trainer.policy.Policy` as RL (its
forward, its :meth:`~posttrain.trainer.policy.Policy.apply_gradients` for clipping,
multi-node averaging and the non-finite guard, its checkpoints).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.trainer.dpo import dpo_loss, sequence_logps
from posttrain.trainer.progress import StageStepMetrics
from posttrain.trainer.sft import sft_loss_sum
from posttrain.trainer.stage_data import StageData, batch_indices, load_stage_data

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagePlan:
    """One resolved stage and the global steps it owns."""

    index: int
    spec: Any  # posttrain.api.StageSpec, resolved (every hyper-parameter set)
    first_step: int
    last_step: int

    @property
    def name(self) -> str:
        return str(self.spec.name)

    @property
    def type(self) -> str:
        return str(self.spec.type)


def plan_stages(spec: Any) -> list[StagePlan]:
    """Global step ranges of ``spec.pipeline()``.

    >>> from posttrain.api import TrainingRunSpec
    >>> spec = TrainingRunSpec.model_validate({"model": "m", "algorithm": {"maxSteps": 4},
    ...     "domains": [{"name": "a", "dataset": "builtin:arithmetic",
    ...                  "verifier": {"kind": "numeric"}}],
    ...     "stages": [{"name": "warm", "type": "sft", "datasets": ["builtin:arithmetic"],
    ...                 "maxSteps": 3}, {"name": "rl", "type": "rl"}]})
    >>> [(p.name, p.first_step, p.last_step) for p in plan_stages(spec)]
    [('warm', 1, 3), ('rl', 4, 7)]
    """
    plans, done = [], 0
    for index, stage in enumerate(spec.pipeline()):
        plans.append(StagePlan(index, stage, done + 1, done + int(stage.max_steps)))
        done += int(stage.max_steps)
    return plans


def load_pipeline_data(plans: list[StagePlan], tokenizer: Any) -> dict[str, StageData]:
    """Every SFT/DPO stage's data, read and tokenized up front: a missing file or an empty
    dataset fails the run before any training, naming the path."""
    from posttrain.trainer.policy import chat_messages_ids, chat_prompt_ids

    def encode_prompt(prompt: str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, list):  # a chat (``messages``), as environments start one
            return chat_messages_ids(tokenizer, prompt)
        return chat_prompt_ids(tokenizer, prompt)

    def encode_completion(text: str) -> list[int]:
        return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]

    data = {}
    for plan in plans:
        if plan.type == "rl":
            continue
        stage = plan.spec
        data[plan.name] = load_stage_data(
            plan.type,
            list(stage.datasets),
            encode_prompt,
            encode_completion,
            int(stage.max_length),
            plan.name,
        )
        loaded = data[plan.name]
        log.info(
            "stage %s: %d %s examples (skipped %s, truncated %d)",
            plan.name,
            len(loaded.examples),
            plan.type,
            loaded.skipped or "none",
            loaded.truncated,
        )
    return data


def stage_batch(
    plan: StagePlan, data: StageData, step: int, seed: int, rank: int, world_size: int
) -> list[int]:
    """This rank's example indices for global ``step`` (ranks split the step's batch)."""
    indices = batch_indices(
        len(data.examples),
        int(plan.spec.batch_size),
        step - plan.first_step + 1,
        seed=_data_seed(seed, plan),
    )
    return indices[rank::world_size]


def _data_seed(seed: int, plan: StagePlan) -> int:
    return seed * 1_000_003 + plan.index


def reference_logps(policy: Any, plan: StagePlan, data: StageData, seed: int) -> dict[str, Any]:
    """The frozen stage-start model's log-probs of every pair the stage will train on,
    computed once per pair before the first update: ``{"reference_logps": {index: [c, r]}}``."""
    used = sorted(
        {
            i
            for step in range(plan.first_step, plan.last_step + 1)
            for i in stage_batch(plan, data, step, seed, 0, 1)
        }
    )
    out: dict[str, list[float]] = {}
    micro = int(plan.spec.micro_batch_size)
    started = time.monotonic()
    with torch.no_grad():
        for start in range(0, len(used), micro):
            chunk = used[start : start + micro]
            chosen, rejected = sequence_logps(
                policy.model, [data.examples[i] for i in chunk], policy.pad_id
            )
            for i, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):
                out[str(i)] = [c, r]
    log.info(
        "stage %s: reference log-probs of %d pairs in %.0fs",
        plan.name,
        len(used),
        time.monotonic() - started,
    )
    return {"reference_logps": out}


def offline_step(
    policy: Any,
    plan: StagePlan,
    data: StageData,
    indices: list[int],
    stage_state: dict[str, Any],
    *,
    grad_clip: float,
    world_size: int,
    step: int,
) -> StageStepMetrics:
    """One SFT or DPO optimizer step over ``indices`` (micro-batched; same update for any
    micro-batch size because every micro-batch is scaled by a step-level coefficient)."""
    stage = plan.spec
    started = time.monotonic()
    examples = [data.examples[i] for i in indices]
    micro = int(stage.micro_batch_size)
    policy.optimizer.zero_grad(set_to_none=True)
    total_loss, tokens = 0.0, 0
    chosen_rewards: list[torch.Tensor] = []
    rejected_rewards: list[torch.Tensor] = []
    if plan.type == "sft":
        # token mean over the whole step (TRL divides by the step's completion tokens too)
        step_tokens = sum(len(e.completion_ids) for e in examples)
        for start in range(0, len(examples), micro):
            loss_sum, n = sft_loss_sum(
                policy.model,
                examples[start : start + micro],
                max_length=int(stage.max_length),
                pad_id=policy.pad_id,
                packing=bool(stage.packing),
            )
            loss = loss_sum / max(step_tokens, 1)
            loss.backward()
            total_loss += float(loss.detach())
            tokens += n
    else:
        references = stage_state["reference_logps"]
        for start in range(0, len(examples), micro):
            chunk = indices[start : start + micro]
            pairs = [data.examples[i] for i in chunk]
            chosen, rejected = sequence_logps(policy.model, pairs, policy.pad_id)  # (B,), (B,)
            ref = torch.tensor([references[str(i)] for i in chunk], dtype=chosen.dtype)  # (B, 2)
            terms = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], float(stage.beta))
            loss = terms.losses.sum() / len(examples)  # mean over the step's pairs
            loss.backward()
            total_loss += float(loss.detach())
            tokens += sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
            chosen_rewards.append(terms.chosen_rewards)
            rejected_rewards.append(terms.rejected_rewards)
    grad_norm, applied, skip_reason = policy.apply_gradients(
        total_loss, grad_clip=grad_clip, world_size=world_size
    )
    metrics = StageStepMetrics(
        step=step,
        stage=plan.name,
        stage_type=plan.type,
        stage_step=step - plan.first_step + 1,
        loss=total_loss,
        grad_norm=grad_norm,
        applied=applied,
        skip_reason=skip_reason,
        examples=len(examples),
        tokens=tokens,
        learning_rate=float(policy.optimizer.param_groups[0]["lr"]),
        step_seconds=time.monotonic() - started,
        skipped_examples=dict(data.skipped),
        truncated_examples=data.truncated,
    )
    if chosen_rewards:
        chosen_all, rejected_all = torch.cat(chosen_rewards), torch.cat(rejected_rewards)
        metrics.reward_chosen = float(chosen_all.mean())
        metrics.reward_rejected = float(rejected_all.mean())
        metrics.reward_margin = float((chosen_all - rejected_all).mean())
        metrics.reward_accuracy = float((chosen_all > rejected_all).float().mean())
    return metrics


def stage_record(
    plan: StagePlan,
    phase: str,
    started: str | None,
    finished: str | None,
    accuracy: dict[str, float],
    skipped: dict[str, int],
) -> dict[str, Any]:
    """One ``status.stages[]`` entry (StageStatus on the wire).

    >>> from posttrain.api import StageSpec
    >>> stage_record(StagePlan(0, StageSpec(name="s", type="sft"), 1, 3), "Running",
    ...              "2026-12-03T00:00:00+00:00", None, {}, {})["lastStep"]
    3
    """
    record: dict[str, Any] = {
        "name": plan.name,
        "type": plan.type,
        "phase": phase,
        "firstStep": plan.first_step,
        "lastStep": plan.last_step,
    }
    if started:
        record["startTime"] = started
    if finished:
        record["completionTime"] = finished
    if accuracy:
        record["evalAccuracy"] = accuracy
    if skipped:
        record["skippedExamples"] = skipped
    return record
