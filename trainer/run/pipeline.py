"""Stages of one run (SFT -> DPO -> RL): step ranges, the SFT/DPO step, stage records.

Steps are numbered globally across stages (``status.step``, checkpoints and
``metrics.jsonl`` lines never repeat a number): stage *i* owns steps ``first_step ..
last_step``. A checkpoint is always written at a stage's last step, so the next stage starts
from exactly those weights (with a fresh optimizer at its own learning rate), and a resumed
run finds its place from the checkpoint's step alone: inside a stage it restores that
stage's optimizer and state; at a boundary it starts the next stage.

The SFT and DPO steps run on the same training engine as RL: every forward goes through the
:class:`~posttrain.trainer.model.policy.Policy`'s FSDP root
(:meth:`~posttrain.trainer.model.policy.Policy.run` for SFT's packed rows,
:meth:`~posttrain.trainer.model.policy.Policy.token_logprobs` for DPO), so
sharding, precision and the chunked LM head are RL's; every step ends in
:meth:`~posttrain.trainer.model.optimizer.PolicyOptimizer.apply` (clipping, the stage's own
learning-rate schedule, the non-finite guard), and checkpoints are the same sharded ones.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from posttrain.trainer.algorithms.dpo import dpo_loss, policy_sequence_logps
from posttrain.trainer.algorithms.sft import sft_loss_sum
from posttrain.trainer.data.stage_data import (
    PreferencePair,
    SftExample,
    StageData,
    batch_indices,
    load_stage_data,
)
from posttrain.trainer.model.training_engine import LrSchedule
from posttrain.trainer.observe.step_metrics import StageStepMetrics

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain.api import StageSpec, TrainingRunSpec
    from posttrain.trainer.model.policy import Policy

log = logging.getLogger(__name__)


V = TypeVar("V")


def resolved(value: V | None, name: str) -> V:
    """A stage setting that :meth:`StageSpec.resolved` filled in for the stages that use it.

    >>> resolved(3, "maxSteps")
    3
    """
    if value is None:
        raise ValueError(f"stage setting {name} is unset; plan stages from spec.pipeline()")
    return value


@dataclass(frozen=True)
class StagePlan:
    """One resolved stage and the global steps it owns."""

    index: int
    spec: StageSpec  # resolved: every setting its stage type uses is set
    first_step: int
    last_step: int

    @property
    def name(self) -> str:
        return str(self.spec.name)

    @property
    def type(self) -> str:
        return str(self.spec.type)


def plan_stages(spec: TrainingRunSpec) -> list[StagePlan]:
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
        steps = resolved(stage.max_steps, "maxSteps")
        plans.append(StagePlan(index, stage, done + 1, done + steps))
        done += steps
    return plans


def load_pipeline_data(plans: list[StagePlan], tokenizer: Any) -> dict[str, StageData]:
    """Every SFT/DPO stage's data, read and tokenized up front: a missing file or an empty
    dataset fails the run before any training, naming the path."""
    from posttrain.trainer.model.policy import chat_messages_ids, chat_prompt_ids

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
            list(resolved(stage.datasets, "datasets")),
            encode_prompt,
            encode_completion,
            resolved(stage.max_length, "maxLength"),
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
        resolved(plan.spec.batch_size, "batchSize"),
        step - plan.first_step + 1,
        seed=_data_seed(seed, plan),
    )
    return indices[rank::world_size]


def _data_seed(seed: int, plan: StagePlan) -> int:
    return seed * 1_000_003 + plan.index


def stage_schedule(plan: StagePlan) -> LrSchedule:
    """The stage's own learning-rate curve: warm-up from its first step, cosine (if asked)
    down to its last.

    >>> from posttrain.api import AlgorithmSpec, StageSpec
    >>> spec = StageSpec(name="s", type="sft", datasets=["x"], max_steps=4, lr_schedule="cosine",
    ...                  lr_warmup_steps=1).resolved(AlgorithmSpec())
    >>> [stage_schedule(StagePlan(1, spec, 9, 12)).factor(s) for s in (9, 10, 12)]
    [1.0, 0.75, 0.0]
    """
    stage = plan.spec
    return LrSchedule(
        kind=str(stage.lr_schedule),
        warmup_steps=resolved(stage.lr_warmup_steps, "lrWarmupSteps"),
        total_steps=resolved(stage.max_steps, "maxSteps"),
        min_ratio=resolved(stage.min_lr_ratio, "minLrRatio"),
        first_step=plan.first_step,
    )


T = TypeVar("T")


def rank_chunks(items: list[T], micro: int, policy: Policy) -> list[list[T]]:
    """This rank's micro-batches of ``items``, padded with empty ones so every rank runs as
    many forwards and backwards: with FSDP each is a collective (weights gathered,
    gradients reduce-scattered), and a rank that stopped early would hang the others."""
    chunks = [items[start : start + micro] for start in range(0, len(items), micro)]
    if policy.rank.world_size > 1:
        import torch.distributed as dist

        count = torch.tensor([len(chunks)], device=policy.plan.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        chunks += [[] for _ in range(int(count.item()) - len(chunks))]
    return chunks


def global_sums(values: list[float], policy: Policy) -> list[float]:
    """``values`` summed over every rank (the values themselves with one rank)."""
    if policy.rank.world_size == 1:
        return values
    import torch.distributed as dist

    total = torch.tensor(values, dtype=torch.float64, device=policy.plan.device)
    dist.all_reduce(total)
    return [float(v) for v in total.cpu()]


def _filler_pair(pad_id: int) -> PreferencePair:
    """A one-token pair a rank with nothing left to do runs with weight 0 (see rank_chunks)."""
    return PreferencePair([pad_id], [pad_id], [pad_id], "filler")


def reference_logps(policy: Policy, plan: StagePlan, data: StageData, seed: int) -> dict[str, Any]:
    """The frozen stage-start model's log-probs of every pair the stage will train on,
    computed once per pair before the first update: ``{"reference_logps": {index: [c, r]}}``.

    Ranks split the pairs and exchange their results, so every rank holds them all (and a
    resume on another number of ranks finds every pair's reference in the checkpoint).
    """
    used = sorted(
        {
            i
            for step in range(plan.first_step, plan.last_step + 1)
            for i in stage_batch(plan, data, step, seed, 0, 1)
        }
    )
    rank, world = policy.rank.rank, policy.rank.world_size
    out: dict[str, list[float]] = {}
    started = time.monotonic()
    with torch.no_grad():
        for chunk in rank_chunks(
            used[rank::world], resolved(plan.spec.micro_batch_size, "microBatchSize"), policy
        ):
            pairs = [data.examples[i] for i in chunk] or [_filler_pair(policy.pad_id)]
            chosen, rejected = policy_sequence_logps(policy, pairs)  # (B,), (B,)
            for i, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=False):
                out[str(i)] = [c, r]
    if world > 1:
        import torch.distributed as dist

        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, out)
        out = {k: v for part in parts for k, v in part.items()}
    log.info(
        "stage %s: reference log-probs of %d pairs in %.0fs",
        plan.name,
        len(used),
        time.monotonic() - started,
    )
    return {"reference_logps": out}


def offline_step(
    policy: Policy,
    plan: StagePlan,
    data: StageData,
    indices: list[int],
    stage_state: dict[str, Any],
    *,
    grad_clip: float,
    step: int,
) -> StageStepMetrics:
    """One SFT or DPO optimizer step over this rank's ``indices`` of the step's batch.

    Every forward goes through the policy's training engine (FSDP root, precision, chunked
    LM head), micro-batched. Each micro-batch's loss is scaled by one step-level
    coefficient over *all* ranks (1 / completion tokens for SFT, 1 / pairs for DPO, times
    the world size because FSDP averages the ranks' gradients), so neither the micro-batch
    size nor the number of ranks changes the update (a two-rank step equals the one-process
    step; tested). Metrics are reduced over ranks.
    """
    stage = plan.spec
    started = time.monotonic()
    world = policy.rank.world_size
    examples = [data.examples[i] for i in indices]
    chunks = rank_chunks(list(indices), resolved(stage.micro_batch_size, "microBatchSize"), policy)
    policy.optimizer.zero_grad(set_to_none=True)
    if plan.type == "sft":
        totals = _sft_backward(policy, stage, data, examples, chunks, world)
    else:
        totals = _dpo_backward(policy, stage, data, examples, chunks, world, stage_state)
    loss, tokens, count, chosen, rejected, correct = global_sums(totals, policy)
    grad_norm, applied, skip_reason = policy.optimization.apply(
        loss, grad_clip=grad_clip, step=step
    )
    metrics = StageStepMetrics(
        step=step,
        stage=plan.name,
        stage_type=plan.type,
        stage_step=step - plan.first_step + 1,
        loss=loss,
        grad_norm=grad_norm,
        applied=applied,
        skip_reason=skip_reason,
        examples=int(count),
        tokens=int(tokens),
        learning_rate=float(policy.optimizer.param_groups[0]["lr"]),
        step_seconds=time.monotonic() - started,
        skipped_examples=dict(data.skipped),
        truncated_examples=data.truncated,
    )
    if plan.type == "dpo":
        metrics.reward_chosen = chosen / count
        metrics.reward_rejected = rejected / count
        metrics.reward_margin = (chosen - rejected) / count
        metrics.reward_accuracy = correct / count
    return metrics


def _sft_backward(
    policy: Policy,
    stage: Any,
    data: StageData,
    examples: list[SftExample],
    chunks: list[list[int]],
    world: int,
) -> list[float]:
    """Backward of the SFT token-mean loss; this rank's ``[loss, tokens, examples, 0, 0, 0]``
    (the loss already divided by the step's tokens over all ranks)."""
    tokens = sum(len(e.completion_ids) for e in examples)
    step_tokens = max(global_sums([float(tokens)], policy)[0], 1.0)
    loss_total = 0.0
    filler = SftExample([policy.pad_id], [policy.pad_id], "filler")
    for chunk in chunks:
        batch = [data.examples[i] for i in chunk] or [filler]
        loss_sum = policy.run(
            partial(
                _sft_objective,
                examples=batch,
                max_length=int(stage.max_length),
                pad_id=policy.pad_id,
                packing=bool(stage.packing),
                chunk_tokens=policy.engine.logprob_chunk_tokens,
            )
        )
        weight = world / step_tokens if chunk else 0.0  # FSDP averages over ranks
        (loss_sum * weight).backward()
        if chunk:
            loss_total += float(loss_sum.detach()) / step_tokens
    return [loss_total, float(tokens), float(len(examples)), 0.0, 0.0, 0.0]


def _sft_objective(model: PreTrainedModel, **kwargs: Any) -> torch.Tensor:
    return sft_loss_sum(model, **kwargs)[0]


def _dpo_backward(
    policy: Policy,
    stage: Any,
    data: StageData,
    examples: list[PreferencePair],
    chunks: list[list[int]],
    world: int,
    stage_state: dict[str, Any],
) -> list[float]:
    """Backward of the DPO pair-mean loss; this rank's ``[loss, tokens, pairs, chosen reward
    sum, rejected reward sum, pairs ranked right]``."""
    step_pairs = max(global_sums([float(len(examples))], policy)[0], 1.0)
    references = stage_state["reference_logps"]
    totals = [0.0, 0.0, float(len(examples)), 0.0, 0.0, 0.0]
    for chunk in chunks:
        pairs = [data.examples[i] for i in chunk] or [_filler_pair(policy.pad_id)]
        chosen, rejected = policy_sequence_logps(policy, pairs)  # (B,), (B,)
        ref = torch.tensor(
            [references[str(i)] for i in chunk] or [[0.0, 0.0]],
            dtype=chosen.dtype,
            device=chosen.device,
        )  # (B, 2)
        terms = dpo_loss(chosen, rejected, ref[:, 0], ref[:, 1], float(stage.beta))
        weight = world / step_pairs if chunk else 0.0  # FSDP averages over ranks
        (terms.losses.sum() * weight).backward()
        if chunk:
            totals[0] += float(terms.losses.detach().sum()) / step_pairs
            totals[1] += sum(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs)
            totals[3] += float(terms.chosen_rewards.sum())
            totals[4] += float(terms.rejected_rewards.sum())
            totals[5] += float((terms.chosen_rewards > terms.rejected_rewards).sum())
    return totals


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


@dataclass
class StageBook:
    """Where the run is in its stages: the stage being trained, that stage's own state
    (DPO: the reference log-probs) and the ``status.stages`` records. A checkpoint saves
    the state and the records, so a resumed run continues the same stage.

    >>> from posttrain.api import StageSpec
    >>> plan = StagePlan(0, StageSpec(name="s", type="sft"), 1, 3)
    >>> book = StageBook(plan)
    >>> book.started(plan, {})
    >>> book.succeeded(plan, {"math": 0.5}, {})
    >>> [(r["name"], r["phase"], r["evalAccuracy"]) for r in book.records]
    [('s', 'Succeeded', {'math': 0.5})]
    """

    plan: StagePlan
    state: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)

    def current_name(self) -> str:
        """The stage a resumed run was in (its last record), else the first stage's."""
        return str(self.records[-1]["name"]) if self.records else self.plan.name

    def started(self, plan: StagePlan, skipped: dict[str, int]) -> None:
        """Record ``plan`` as Running from now."""
        self.records.append(stage_record(plan, "Running", _now(), None, {}, skipped))

    def succeeded(
        self, plan: StagePlan, accuracy: dict[str, float], skipped: dict[str, int]
    ) -> None:
        """Mark ``plan`` Succeeded, with the held-out ``accuracy`` after it."""
        started = next((r.get("startTime") for r in self.records if r["name"] == plan.name), None)
        record = stage_record(plan, "Succeeded", started, _now(), accuracy, skipped)
        self.records = [r for r in self.records if r["name"] != plan.name] + [record]


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()
