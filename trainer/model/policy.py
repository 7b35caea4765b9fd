"""The trainable policy: model, tokenizer, KL reference, and one policy-gradient step.

The trainer owns tokenisation (the chat template is applied here and token ids are sent
to the rollout server), so the ids the server samples after are exactly the ids the
loss is computed on. The step accumulates micro-batch gradients with batch-level loss
coefficients (see :mod:`posttrain.trainer.algorithms.loss`), so ``micro_batch_size`` only
trades memory for time and never changes the update. A non-finite loss or gradient norm skips
the optimizer step (on every rank) instead of corrupting the weights.

The model runs on the engine of :mod:`posttrain.trainer.model.training_engine`: its device,
precision and FSDP2 sharding. The forward that the loss needs
(:class:`~posttrain.trainer.algorithms.logprobs.TokenLogprobs`) is the FSDP root, so the
embeddings and the LM head are gathered for it like every decoder block. Its AdamW, learning-rate
curve and clipped step are :class:`~posttrain.trainer.model.optimizer.PolicyOptimizer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.trainer.algorithms.logprobs import (
    DEFAULT_LOGPROB_CHUNK_TOKENS,
    Objective,
    TokenLogprobs,
    TrainSample,
)
from posttrain.trainer.algorithms.loss import LossConfig, clipped_policy_loss
from posttrain.trainer.model.lora import LoraOptions
from posttrain.trainer.model.optimizer import PolicyOptimizer
from posttrain.trainer.model.training_engine import (
    DevicePlan,
    LrSchedule,
    available_bytes,
    check_fits,
    check_placement,
    compute_dtype,
    count_parameters,
    decoder_layers,
    ensure_process_group,
    estimate_training_memory,
    needs_sharding,
    plan_device,
    shard,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from posttrain.api import TrainingRunSpec

log = logging.getLogger(__name__)


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Chat-template a user prompt into token ids ending with the assistant turn header."""
    return chat_messages_ids(tokenizer, [{"role": "user", "content": prompt}])


def chat_messages_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template whole messages (e.g. a system prompt and a question) into token ids
    ending with the assistant turn header: the same ids ``envs.episode.ChatTokens``
    starts an episode with."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class StepStats:
    """What one optimizer step did (``applied`` is False when it was skipped)."""

    loss: float
    grad_norm: float
    applied: bool
    clip_fraction: float
    ratio_mean: float
    kl: float  # mean per-token k3 KL to the reference (0 without one)
    tokens: int
    skip_reason: str = ""


@dataclass(frozen=True)
class EngineOptions:
    """How the policy is placed and trained (spec.resources + spec.engine + the LR schedule)."""

    gpus_per_node: int = 0
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    activation_checkpointing: bool = False
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS
    lr_schedule: str = "constant"  # constant | cosine
    lr_warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int = 1
    lora: LoraOptions | None = None
    ranks_on_node: int = 1  # ranks sharing this host's memory (for the CPU memory check)
    # Sharded runs build the model on the meta device and read only each rank's slices
    # (trainer/model/sharded_load.py). True loads the full model on every rank first, then shards:
    # the old way, kept only so bench/trainer_scale.py can measure both side by side.
    full_load_before_sharding: bool = False

    @classmethod
    def from_spec(cls, spec: TrainingRunSpec, ranks_on_node: int = 1) -> EngineOptions:
        """The options a TrainingRunSpec asks for."""
        engine, algo = spec.engine, spec.algorithm
        lora = None
        if engine.lora is not None:
            lora = LoraOptions(
                engine.lora.rank, engine.lora.alpha, tuple(engine.lora.target_modules)
            )
        return cls(
            gpus_per_node=spec.resources.gpus_per_node,
            precision=engine.precision,
            activation_checkpointing=engine.activation_checkpointing,
            logprob_chunk_tokens=engine.logprob_chunk_tokens,
            lr_schedule=algo.lr_schedule,
            lr_warmup_steps=algo.lr_warmup_steps,
            min_lr_ratio=algo.min_lr_ratio,
            total_steps=algo.max_steps,
            lora=lora,
            ranks_on_node=ranks_on_node,
        )


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the group (a subset of distributed.DistContext)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


class Policy:
    """A causal LM being trained with AdamW, plus an optional frozen reference for KL.

    ``self.model`` is the Hugging Face model (its parameters are DTensor shards once
    sharded); ``self.module`` wraps it as the loss forward and is what FSDP roots.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        learning_rate: float,
        weight_decay: float = 0.0,
        reference_dir: Path | None = None,
        seed: int = 0,
        engine: EngineOptions | None = None,
        rank: RankInfo | None = None,
        weights_from_checkpoint: bool = False,
    ) -> None:
        """``weights_from_checkpoint``: the caller loads every weight from a DCP checkpoint
        right after (a resume), so a rank that reads its own slices (:attr:`reads_own_slices`)
        only allocates them and ``model_dir`` needs no weight files; ignored otherwise."""
        from transformers import AutoTokenizer

        self.engine = engine or EngineOptions()
        self.rank = rank or RankInfo()
        self.plan: DevicePlan = plan_device(self.engine.gpus_per_node, self.rank.local_rank)
        self.dtype = compute_dtype(self.engine.precision, self.plan)
        self.sharded = needs_sharding(self.rank.world_size, self.plan, self.dtype)
        self._check_memory(Path(model_dir), reference=reference_dir is not None)
        if self.sharded:
            ensure_process_group(self.plan)
        torch.manual_seed(seed)
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id)
        self.seed = seed
        # Sharded: parameters on the meta device until each rank reads its own slices.
        self._per_rank_load = self.reads_own_slices(self.engine, self.rank)
        self.model = self._load(self.model_dir)
        self.peft: torch.nn.Module | None = None
        if self.engine.lora is not None:
            from posttrain.trainer.model.lora import add_adapters
            from posttrain.trainer.model.sharded_load import init_adapters

            # PEFT injects the adapters into the model's own modules and freezes the rest;
            # the trainer keeps using the plain model (its names, its decoder).
            self.peft = add_adapters(self.model, self.engine.lora)
            if not self._per_rank_load:  # else materialize() does it after sharding
                init_adapters(self.model, seed)  # the same adapters on every world size
        self.module = self._place(
            self.model,
            trainable=True,
            source=self.model_dir,
            read_weights=not (weights_from_checkpoint and self._per_rank_load),
        )
        # The KL anchor: the model the RL stage started from (``reference_dir``: the base
        # model, or a pipeline stage's start, then :meth:`anchor_reference`).
        self.reference: PreTrainedModel | None = None
        self.reference_module: torch.nn.Module | None = None
        if reference_dir is not None:
            self.reference = self._load(Path(reference_dir)).requires_grad_(False)
            self.reference_module = self._place(
                self.reference, trainable=False, source=Path(reference_dir)
            )
        self.optimization = PolicyOptimizer(
            self.module,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            schedule=LrSchedule(
                self.engine.lr_schedule,
                self.engine.lr_warmup_steps,
                self.engine.total_steps,
                self.engine.min_lr_ratio,
            ),
            world_size=self.rank.world_size,
            device=self.plan.device,
        )

    @staticmethod
    def reads_own_slices(engine: EngineOptions, rank: RankInfo) -> bool:
        """Whether a policy with these options shards and fills its shards per rank from
        the model directory (so a resume can skip downloading the HF weights)."""
        plan = plan_device(engine.gpus_per_node, rank.local_rank)
        sharded = needs_sharding(rank.world_size, plan, compute_dtype(engine.precision, plan))
        return sharded and not engine.full_load_before_sharding

    @property
    def optimizer(self) -> torch.optim.AdamW:
        """The AdamW of :attr:`optimization` (checkpoints save and restore its state)."""
        return self.optimization.adamw

    def _check_memory(self, model_dir: Path, *, reference: bool) -> None:
        """Refuse before loading when the per-rank training state cannot fit."""
        total, largest, outside = count_parameters(model_dir)
        trainable = total
        if self.engine.lora is not None:
            from posttrain.trainer.model.lora import estimate_adapter_parameters

            trainable = estimate_adapter_parameters(model_dir, self.engine.lora)
        world = self.rank.world_size if self.sharded else 1
        estimate = estimate_training_memory(
            total,
            trainable,
            largest,
            outside,
            world_size=world,
            compute_bytes=self.dtype.itemsize,
            reference=reference,
        )
        where = (
            f"{self.plan.device}"
            if self.plan.is_cuda
            else f"host memory shared by {self.engine.ranks_on_node} rank(s)"
        )
        check_fits(estimate, available_bytes(self.plan, self.engine.ranks_on_node), where)

    def _load(self, model_dir: Path) -> PreTrainedModel:
        """The model to place: empty (meta) when each rank will read its own slices."""
        if self._per_rank_load:
            from posttrain.trainer.model.sharded_load import build_empty

            return build_empty(model_dir)
        return _load_model(model_dir)

    def _place(
        self, model: PreTrainedModel, *, trainable: bool, source: Path, read_weights: bool = True
    ) -> torch.nn.Module:
        """Wrap ``model`` as the loss forward, then checkpoint, shard (and, loaded per rank,
        fill this rank's shards from ``source``, or only allocate them without
        ``read_weights``) and check its placement."""
        model.train(trainable)
        model.config.use_cache = False
        # Dropout off: RL ratios must compare the same function the sampler ran.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        checkpointing = self.engine.activation_checkpointing and trainable
        # Shared prompts run every decoder block twice per forward (prompt pass, then the
        # completions on its cache). Two cases take one full forward per sample instead:
        # a recomputed block would append its keys/values to the shared cache twice; and
        # under FSDP each pass gathers every block again, forward and backward, and the
        # unsharded weights and gradients of both passes overlap: at 0.69B on two Gloo ranks
        # sharing peaked 1.8 GiB higher per rank and took 20% longer per step, side by side
        # in one run (docs/benchmarks.md, "Where a rank's memory goes").
        share_prompts = not checkpointing and not self.sharded
        wrapper = TokenLogprobs(
            model, self.pad_id, self.engine.logprob_chunk_tokens, share_prompts=share_prompts
        )
        if checkpointing:
            from posttrain.trainer.model.training_engine import apply_activation_checkpointing

            apply_activation_checkpointing(decoder_layers(model))
        if self.sharded:
            shard(wrapper, decoder_layers(model), self.plan, self.dtype)
            if self._per_rank_load:
                from posttrain.trainer.model.sharded_load import materialize

                started = time.monotonic()
                materialize(
                    model,
                    source,
                    self.plan.device,
                    seed=self.seed,
                    root=wrapper,
                    read_weights=read_weights,
                )
                log.info(
                    "%s this rank's shards of %s in %.1fs",
                    "loaded" if read_weights else "allocated (weights follow from the checkpoint)",
                    source,
                    time.monotonic() - started,
                )
        else:
            wrapper.to(self.plan.device)
        check_placement(wrapper, self.plan)
        return wrapper

    def encode_prompt(self, prompt: str) -> list[int]:
        return chat_prompt_ids(self.tokenizer, prompt)

    def token_logprobs(
        self, samples: Sequence[TrainSample], temperature: float = 1.0
    ) -> torch.Tensor:
        """Log-prob (N,) of every completion token of ``samples`` under the policy: the RL
        loss forward (shared prompts, chunked LM head), for any objective that needs it (DPO).
        Collective when sharded: every rank runs as many forwards."""
        return self.module(samples, temperature)  # type: ignore[no-any-return]

    def run(self, objective: Objective) -> torch.Tensor:
        """``objective(model)`` as the FSDP root's forward (SFT's packed rows): the root's
        weights are gathered for it and its gradients reduced like every other forward.
        Calling ``self.model`` directly would bypass the root and fail once sharded."""
        return self.module([], 1.0, objective)  # type: ignore[no-any-return]

    def anchor_reference(self) -> None:
        """Make the frozen KL reference the policy's current weights (an RL stage's start).

        Streamed one tensor at a time from the shards (LoRA adapters merged) into the
        reference's own shards, so the model is never held twice. Collective when sharded.
        """
        if self.reference is None:
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        targets = dict(self.reference.named_parameters())
        copied = set()
        with torch.no_grad():
            for name, full in self.full_weights(torch.float32):
                target = targets.get(name)
                if target is None:
                    continue  # a buffer the reference has as a buffer too (not trained)
                if isinstance(target, DTensor):
                    shard = distribute_tensor(
                        full.to(target.device),
                        target.device_mesh,
                        target.placements,
                        src_data_rank=None,  # every rank has the full tensor: just slice
                    ).to_local()
                    target.to_local().copy_(shard)
                else:
                    target.copy_(full.to(target.device))
                copied.add(name)
        missing = sorted(set(targets) - copied)
        if missing:
            raise RuntimeError(f"anchor_reference: no policy weights for {missing[:5]}")

    @property
    def is_main(self) -> bool:
        return self.rank.rank == 0

    @property
    def export_dtype(self) -> torch.dtype:
        """Exported weights are in the compute dtype: bf16 on GPUs, fp32 on a CPU fp32 run."""
        return self.dtype

    def full_weights(
        self, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, full tensor on device)`` of the servable weights, gathered one at a time.

        Every rank must consume the iterator (each tensor is an all-gather). With LoRA each
        adapted weight comes merged (``W + scale * B @ A``), so servers see plain weights. The tied output embedding is left out, as ``save_pretrained``
        does (the loaders re-tie it). ``dtype`` overrides :attr:`export_dtype` (a pool's
        serving dtype).
        """
        from posttrain.trainer.model.lora import servable_weights

        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        yield from servable_weights(
            self.model,
            dtype=dtype or self.export_dtype,
            skip=frozenset({"lm_head.weight"}) if tied else frozenset(),
            device=device,
        )

    def save_weights(
        self, dest: Path, *, weights_only: bool = False, dtype: torch.dtype | None = None
    ) -> Path | None:
        """Write an HF directory (safetensors + config + tokenizer), streamed tensor by tensor;
        ``weights_only`` writes just the safetensors.

        Collective: every rank calls it; rank 0 writes and returns ``dest``, the others None.
        """
        from posttrain.trainer.model.export import write_hf_directory

        return write_hf_directory(self, dest, weights_only=weights_only, dtype=dtype)

    def completion_logprobs(
        self, model: PreTrainedModel, samples: Sequence[TrainSample], temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-probs of each completion token under ``model``, aligned with a mask.

        Returns ``(logp, behaviour, mask)``, each (B, L) with L the longest completion;
        the logits are divided by ``temperature`` exactly as the sampler did. ``model`` is
        ``self.model`` or ``self.reference`` (their loss-forward wrappers run).
        """
        module = self.reference_module if model is self.reference else self.module
        assert module is not None
        device = self.plan.device
        batch = len(samples)
        longest = max(len(s.completion_ids) for s in samples)
        behaviour = torch.zeros((batch, longest), device=device)  # (B, L)
        mask = torch.zeros((batch, longest), device=device)  # (B, L)
        rows: list[int] = []
        columns: list[int] = []
        for i, s in enumerate(samples):
            n = len(s.completion_ids)
            if s.loss_mask is not None and len(s.loss_mask) != n:
                raise ValueError(
                    f"loss_mask has {len(s.loss_mask)} entries for {n} "
                    "completion tokens; it needs one per token"
                )
            rows += [i] * n
            columns += range(n)
            behaviour[i, :n] = torch.tensor(s.behaviour_logprobs[:n])
            mask[i, :n] = (
                1.0 if s.loss_mask is None else torch.tensor(s.loss_mask[:n], dtype=torch.float32)
            )
        chosen = module(samples, temperature)  # (N,)
        index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
        logp = torch.zeros((batch, longest), device=device).index_put(index, chosen)  # (B, L)
        return logp, behaviour, mask

    def _micro_batches(
        self, samples: Sequence[TrainSample], micro_batch_size: int
    ) -> list[tuple[list[TrainSample], bool]]:
        """This rank's micro-batches, padded so every rank runs as many forwards.

        FSDP's gathers are collectives: a rank with fewer samples (dynamic sampling keeps
        different numbers of groups per rank) runs a one-token micro-batch with coefficient
        0, which adds nothing to the gradient.
        """
        chunks = [
            (c, False)
            for start in range(0, len(samples), micro_batch_size)
            if (c := [s for s in samples[start : start + micro_batch_size] if s.completion_ids])
        ]
        if self.rank.world_size > 1:
            import torch.distributed as dist

            count = torch.tensor([len(chunks)], device=self.plan.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            filler = TrainSample([self.pad_id], [self.pad_id], [0.0], 0.0, 0.0)
            chunks += [([filler], True)] * (int(count.item()) - len(chunks))
        return chunks

    def train_step(
        self,
        samples: Sequence[TrainSample],
        config: LossConfig,
        *,
        micro_batch_size: int,
        grad_clip: float,
        temperature: float,
        step: int | None = None,
        world_size: int = 1,  # unused: the process group decides (kept for callers)
    ) -> StepStats:
        """One optimizer step over ``samples`` (already filtered and with advantages).

        Collective with several ranks: every rank calls it, also with no samples. Gradients
        are averaged over ranks by FSDP's reduce-scatter, so each rank's coefficients give
        the mean over its share. ``step`` (1-based) sets the learning rate from the schedule.
        """
        del world_size
        chunks = self._micro_batches(samples, micro_batch_size)
        if not chunks:
            return StepStats(0.0, 0.0, False, 0.0, 0.0, 0.0, 0, "no samples with signal")
        self.optimizer.zero_grad(set_to_none=True)
        device = self.plan.device
        sums = torch.zeros(5, dtype=torch.float64)  # loss, clipped, tokens, ratio, kl
        for chunk, is_filler in chunks:
            logp, behaviour, mask = self.completion_logprobs(self.model, chunk, temperature)
            ref_logp = None
            if self.reference is not None and config.kl_coef > 0:
                with torch.no_grad():
                    ref_logp, _, _ = self.completion_logprobs(self.reference, chunk, temperature)
            terms = clipped_policy_loss(
                logp,
                behaviour,
                torch.tensor([s.advantage for s in chunk], device=device),  # (B,)
                mask,
                torch.tensor([s.coefficient for s in chunk], device=device),  # (B,)
                config,
                ref_logp,
            )
            terms.loss.backward()
            if not is_filler:
                sums += torch.tensor(
                    [
                        float(terms.loss.detach()),
                        terms.clipped_tokens,
                        terms.tokens,
                        terms.ratio_sum,
                        terms.kl_sum,
                    ],
                    dtype=torch.float64,
                )
        if self.rank.world_size > 1:
            import torch.distributed as dist

            reduced = sums.to(device)
            dist.all_reduce(reduced)  # (5,) summed over ranks
            sums = reduced.cpu()
            sums[0] /= self.rank.world_size  # the step's loss: the mean of the ranks' losses
        total_loss, clipped, tokens, ratio_sum, kl_sum = sums.tolist()
        if tokens == 0:  # every rank agrees: the sums are global
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(total_loss, 0.0, False, 0.0, 0.0, 0.0, 0, "no samples with signal")
        grad_norm, applied, skip_reason = self.optimization.apply(
            total_loss, grad_clip=grad_clip, step=step
        )
        return StepStats(
            loss=total_loss,
            grad_norm=grad_norm,
            applied=applied,
            clip_fraction=clipped / max(tokens, 1.0),
            ratio_mean=ratio_sum / max(tokens, 1.0),
            kl=kl_sum / max(tokens, 1.0),
            tokens=int(tokens),
            skip_reason=skip_reason,
        )


def _load_model(model_dir: Path | str) -> PreTrainedModel:
    """The HF model in fp32 on the CPU (the master weights; sharding moves them)."""
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    log.info("loaded %s in %.1fs", model_dir, time.monotonic() - started)
    return model
