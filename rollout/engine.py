"""A batched CPU generation engine on transformers, with hot weight swaps.

Why our own decode loop instead of ``model.generate``: we need per-request seeds that do
not depend on batch composition, per-token behaviour-policy logprobs with an exact
definition, stop strings per request, and a safe point between decode steps at which new
requests join and weights can be swapped. ``generate`` offers none of these together.

Scheduling is continuous at the granularity of decode steps: a background thread owns the
model; between steps it drops finished rows from the KV cache and admits queued requests
(their prompts are prefilled separately and their caches merged into the running batch by
left padding). Weight swaps wait for the running batch to drain -- new requests stay queued
meanwhile -- so every completion is sampled from exactly one weight version, which it
records. See docs/rollout.md.

Logprob definition: for each sampled token we return
``log_softmax(logits / T)[token]`` where ``T`` is the request temperature (``T = 1`` for
greedy, ``temperature == 0``), computed before top-p truncation. This is what a plain
forward pass on the same weights reproduces, so the trainer can use it as the behaviour
policy's logprob for importance correction.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin

from posttrain.api.env import NUM_THREADS
from posttrain.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)

GENERATED_TOKENS = Counter(
    "posttrain_rollout_generated_tokens_total", "Tokens sampled by the rollout engine"
)
PROMPT_TOKENS = Counter("posttrain_rollout_prompt_tokens_total", "Prompt tokens prefilled")
QUEUE_DEPTH = Gauge("posttrain_rollout_queue_depth", "Requests waiting to join a batch")
RUNNING_SEQUENCES = Gauge("posttrain_rollout_running_sequences", "Sequences decoding now")
TOKENS_PER_SECOND = Gauge(
    "posttrain_rollout_tokens_per_second", "Decode throughput over the last engine step window"
)
MIDBATCH_ADMISSIONS = Counter(
    "posttrain_rollout_midbatch_admissions_total",
    "Times queued requests joined a batch that was already decoding (continuous batching)",
)
WEIGHT_VERSION = Gauge("posttrain_rollout_weight_version", "Weight version being served")
WEIGHT_SWAP_SECONDS = Histogram(
    "posttrain_rollout_weight_swap_seconds", "Time the engine paused to copy new weights in"
)


@dataclass
class SampleOutput:
    """One finished sample of a request."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" (EOS or stop string) | "length"
    weight_version: int
    # Per position, the k most likely (token id, logprob) of the same distribution.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future[list[SampleOutput]]
    outputs: list[SampleOutput | None]
    remaining: int
    top_logprobs: int = 0


@dataclass
class _Sequence:
    """One row of the running batch (one of a request's ``n`` samples)."""

    request: _Request
    sample_index: int
    generator: torch.Generator
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class _WeightSwap:
    state_dict: dict[str, torch.Tensor]
    version: int
    done: concurrent.futures.Future[float]
    queued_at: float = field(default_factory=time.monotonic)


@dataclass
class _Batch:
    """The running batch: rows are left-padded, so row ``i`` of every tensor is ``rows[i]``."""

    rows: list[_Sequence]
    cache: Cache  # per layer keys/values (B, H, L, D)
    attention_mask: torch.Tensor  # (B, L), 0 on left padding
    positions: torch.Tensor  # (B,) position id of each row's next token
    last_logits: torch.Tensor  # (B, V) logits that the next token is sampled from


def default_num_threads() -> int:
    """``POSTTRAIN_NUM_THREADS``, else ``OMP_NUM_THREADS``, else every core.

    Intra-op threads beyond the core count only add contention; operators pin replicas by
    setting one of the variables to the pod's CPU limit.
    """
    for variable in (NUM_THREADS, "OMP_NUM_THREADS"):
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def sample_seed(seed: int, sample_index: int) -> int:
    """Mix a request seed and sample index into a generator seed (distinct per sample).

    >>> sample_seed(1, 0) != sample_seed(0, 1)
    True
    """
    return (seed * 0x9E3779B1 + sample_index * 0x85EBCA77 + 1) % (2**63 - 1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the smallest set whose probability mass reaches top_p.

    >>> top_p_filter(torch.tensor([2.0, 1.0, -5.0]), 0.5).isinf().tolist()
    [False, True, True]
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)  # (V,)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # (V,)
    # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p  # (V,)
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)  # (V,)
    return logits.masked_fill(drop, float("-inf"))


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None.

    >>> find_stop("a = 1\\n\\nb", ["\\n\\n", "b"])
    5
    """
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class GenerationEngine:
    """Owns one model on CPU and serves sampling requests from a background thread."""

    def __init__(
        self,
        model_dir: Path,
        *,
        max_batch_size: int = 64,
        num_threads: int | None = None,
        weight_version: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        threads = num_threads or default_num_threads()
        torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.eos_ids = self._eos_ids()
        self.pad_id = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else next(iter(self.eos_ids))
        )
        self._weight_version = weight_version
        self.midbatch_admissions = 0  # observable proof of continuous batching (tests)
        self.active_sequences = 0  # rows decoding now
        WEIGHT_VERSION.set(weight_version)
        self._queue: queue.Queue[_Request | _WeightSwap | None] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()
        log.info(
            "engine ready: %s, %d threads, max batch %d", self.model_dir, threads, max_batch_size
        )

    # ----------------------------------------------------------------- public API

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, *, top_logprobs: int = 0
    ) -> concurrent.futures.Future[list[SampleOutput]]:
        """Queue one prompt; the future resolves to its ``n`` samples."""
        if self._stopping.is_set():
            raise RuntimeError("rollout engine is shut down")
        params.validate()
        if not 0 <= top_logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {top_logprobs}")
        if not prompt_ids:
            raise ValueError("prompt is empty; send at least one token")
        if len(prompt_ids) >= self.max_positions:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens but the model's context is "
                f"{self.max_positions}; shorten the prompt"
            )
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        future: concurrent.futures.Future[list[SampleOutput]] = concurrent.futures.Future()
        self._queue.put(
            _Request(prompt_ids, params, future, [None] * params.n, params.n, top_logprobs)
        )
        QUEUE_DEPTH.inc()
        return future

    def generate(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[list[SampleOutput]]:
        """Synchronous convenience: all prompts batched together, results in order."""
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def swap_weights(
        self, state_dict: dict[str, torch.Tensor], version: int
    ) -> concurrent.futures.Future[float]:
        """Install new weights once the running batch drains; resolves when serving them,
        with the seconds the swap waited for that batch (what a trainer publishing with
        rollouts still in flight waits for: part of its rollout wait)."""
        done: concurrent.futures.Future[float] = concurrent.futures.Future()
        self._queue.put(_WeightSwap(state_dict, version, done))
        return done

    def load_weights_dir(self, weights_dir: Path, version: int) -> None:
        """Read safetensors from ``weights_dir`` (outside the engine thread) and swap them in."""
        state_dict = read_safetensors_dir(Path(weights_dir))
        self.swap_weights(state_dict, version).result()

    def close(self) -> None:
        """Stop after the current decode step; unfinished requests fail with RuntimeError."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ----------------------------------------------------------------- engine thread

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        return ids

    def _loop(self) -> None:  # noqa: C901
        batch: _Batch | None = None
        pending_swap: _WeightSwap | None = None
        waiting: list[_Request] = []
        window_started, window_tokens = time.monotonic(), 0
        while not self._stopping.is_set():
            # Drain the queue; block only when there is nothing else to do.
            try:
                while True:
                    idle = batch is None and not waiting and pending_swap is None
                    item = self._queue.get(block=idle)
                    if item is None:
                        self._stopping.set()
                        break
                    if isinstance(item, _WeightSwap):
                        pending_swap = item
                    else:
                        waiting.append(item)
                    if self._queue.empty():
                        break
            except queue.Empty:
                pass
            if self._stopping.is_set():
                break
            if pending_swap is not None and batch is None:
                # Requests queued behind the swap are sampled with the new weights.
                self._apply_swap(pending_swap)
                pending_swap = None
            if pending_swap is None and waiting:
                batch = self._admit(batch, waiting)
            if batch is None:
                self.active_sequences = 0
                continue
            RUNNING_SEQUENCES.set(len(batch.rows))
            self.active_sequences = len(batch.rows)
            window_tokens += len(batch.rows)
            running = batch
            try:
                batch = self._decode_step(running)
            except Exception as exc:
                log.exception("decode step failed; failing %d sequences", len(running.rows))
                for seq in running.rows:
                    if not seq.request.future.done():
                        seq.request.future.set_exception(exc)
                batch = None
            self.active_sequences = len(batch.rows) if batch else 0
            elapsed = time.monotonic() - window_started
            if elapsed > 1.0:
                TOKENS_PER_SECOND.set(window_tokens / elapsed)
                window_started, window_tokens = time.monotonic(), 0
        RUNNING_SEQUENCES.set(0)
        # Shutting down: fail whatever is left so HTTP handlers return instead of hanging.
        leftovers = [seq.request for seq in batch.rows] if batch else []
        for request in leftovers + waiting:
            if not request.future.done():
                request.future.set_exception(RuntimeError("rollout engine is shutting down"))
        if pending_swap is not None and not pending_swap.done.done():
            pending_swap.done.set_exception(RuntimeError("rollout engine is shutting down"))

    def _admit(self, batch: _Batch | None, waiting: list[_Request]) -> _Batch | None:
        """Prefill as many waiting requests as fit and merge them into the running batch."""
        admitted: list[_Request] = []
        rows = len(batch.rows) if batch else 0
        while waiting:
            if waiting[0].future.cancelled():  # the client went away while queued
                waiting.pop(0)
                QUEUE_DEPTH.dec()
                continue
            needed = waiting[0].params.n
            # A request larger than the whole batch still runs, just alone.
            if rows + needed > self.max_batch_size and rows > 0:
                break
            admitted.append(waiting.pop(0))
            rows += needed
            QUEUE_DEPTH.dec()
        if not admitted:
            return batch
        try:
            fresh = self._prefill(admitted)
        except Exception as exc:  # fail these callers rather than kill the loop
            log.exception("prefill failed")
            for request in admitted:
                request.future.set_exception(exc)
            return batch
        if batch is None:
            return fresh
        self.midbatch_admissions += 1
        MIDBATCH_ADMISSIONS.inc()
        return _merge_batches(batch, fresh)

    def _apply_swap(self, swap: _WeightSwap) -> None:
        started = time.monotonic()
        drained = started - swap.queued_at
        try:
            copy_state_dict(self.model, swap.state_dict)
        except Exception as exc:
            log.exception("weight swap to version %d failed", swap.version)
            swap.done.set_exception(exc)
            return
        self._weight_version = swap.version
        WEIGHT_VERSION.set(swap.version)
        WEIGHT_SWAP_SECONDS.observe(time.monotonic() - started)
        log.info(
            "now serving weight version %d (swap %.3fs)", swap.version, time.monotonic() - started
        )
        swap.done.set_result(drained)

    @torch.inference_mode()
    def _prefill(self, requests: list[_Request]) -> _Batch:
        """Run each distinct prompt of ``requests`` once (left-padded), then give every one of
        its ``n`` samples a copy of its KV cache and last logits.

        Prefix sharing, as vLLM's prefix cache does for ``n`` > 1: a GRPO group of 4 samples
        of a 55-token prompt prefills 55 tokens instead of 220; the rows are identical, so
        sampling is unchanged."""
        rows: list[_Sequence] = []
        prompts, distinct = distinct_prompts(request.prompt_ids for request in requests)
        source: list[int] = []  # row -> index of its distinct prompt
        for request, unique in zip(requests, distinct, strict=True):
            for i in range(request.params.n):
                seed = request.params.seed
                generator = torch.Generator()
                if seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(sample_seed(seed, i))
                budget = min(
                    request.params.max_tokens, self.max_positions - len(request.prompt_ids)
                )
                rows.append(_Sequence(request, i, generator, budget))
                source.append(unique)
        input_ids, attention_mask, position_ids = left_padded(prompts, self.pad_id)  # (U, L)
        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        PROMPT_TOKENS.inc(int(attention_mask.sum()))
        index = torch.tensor(source)  # (B,)
        if len(prompts) < len(rows):
            out.past_key_values.batch_select_indices(index)  # (U, ...) -> (B, ...)
        return _Batch(
            rows=rows,
            cache=out.past_key_values,
            attention_mask=attention_mask[index],  # (B, L)
            positions=position_ids[index, -1] + 1,  # (B,)
            last_logits=out.logits[index, -1, :].float(),  # (B, V)
        )

    @torch.inference_mode()
    def _decode_step(self, batch: _Batch) -> _Batch | None:
        """Sample one token per row, retire finished rows, run the model one step."""
        tokens, token_logprobs = self._sample(batch.rows, batch.last_logits)  # (B,), (B,)
        keep: list[int] = []
        for row, (token, logprob) in enumerate(
            zip(tokens.tolist(), token_logprobs.tolist(), strict=True)
        ):
            seq = batch.rows[row]
            if seq.request.future.cancelled():
                continue  # client disconnected: stop spending compute on it
            self._append(seq, token, logprob)
            if seq.finish_reason is None:
                keep.append(row)
            else:
                self._finish(seq)
        GENERATED_TOKENS.inc(len(batch.rows))
        if not keep:
            return None
        rows, attention_mask, positions = batch.rows, batch.attention_mask, batch.positions
        if len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long)  # (B',)
            batch.cache.batch_select_indices(index)
            attention_mask, positions, tokens = (
                attention_mask[index],
                positions[index],
                tokens[index],
            )
            rows = [rows[i] for i in keep]
        attention_mask = torch.cat(
            [attention_mask, torch.ones((len(rows), 1), dtype=attention_mask.dtype)], dim=1
        )  # (B, L+1)
        out = self.model(
            input_ids=tokens[:, None],  # (B, 1)
            attention_mask=attention_mask,
            position_ids=positions[:, None],  # (B, 1)
            past_key_values=batch.cache,
            use_cache=True,
        )
        return _Batch(
            rows=rows,
            cache=out.past_key_values,
            attention_mask=attention_mask,
            positions=positions + 1,
            last_logits=out.logits[:, -1, :].float(),  # (B, V)
        )

    def _sample(
        self, running: list[_Sequence], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row and its logprob, each row drawing from its own generator.

        Sampling is by inverse CDF with one uniform per row: vectorised over the batch
        (``torch.multinomial`` per row costs ~1 ms at a 49k vocabulary), yet each row's
        draw depends only on its own generator, so seeded requests are reproducible
        whatever else shares the batch.
        """
        params = [seq.request.params for seq in running]
        temperatures = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params]
        )  # (B,)
        scaled = logits.float() / temperatures[:, None]  # (B, V)
        logprobs = torch.log_softmax(scaled, dim=-1)  # (B, V)
        filtered = scaled
        if any(p.top_p < 1.0 for p in params):
            filtered = torch.stack(
                [top_p_filter(scaled[row], p.top_p) for row, p in enumerate(params)]
            )  # (B, V)
        cdf = torch.softmax(filtered, dim=-1).cumsum(dim=-1)  # (B, V)
        uniforms = torch.cat([torch.rand(1, generator=seq.generator) for seq in running])  # (B,)
        sampled = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).squeeze(1)  # (B,)
        sampled = sampled.clamp(max=logits.shape[-1] - 1)
        greedy = torch.tensor([p.temperature == 0 for p in params])  # (B,)
        tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)  # (B,)
        token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)  # (B,)
        for row, seq in enumerate(running):
            k = seq.request.top_logprobs
            if k:
                values, ids = logprobs[row].topk(k)  # (k,), (k,)
                seq.top_logprobs.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        return tokens, token_logprobs

    def _decode(self, token_ids: list[int]) -> str:
        """One sequence's text (``decode`` of a single id list is a str, never a list)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def _append(self, seq: _Sequence, token: int, logprob: float) -> None:
        params = seq.request.params
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in self.eos_ids:
            seq.finish_reason = "stop"
            return
        if params.stop:
            text = self._decode(seq.token_ids)
            cut = find_stop(text, params.stop)
            if cut is not None:
                seq.text = text[:cut]
                seq.finish_reason = "stop"
                return
        if len(seq.token_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"

    def _finish(self, seq: _Sequence) -> None:
        if not (seq.finish_reason == "stop" and seq.request.params.stop and seq.text):
            seq.text = self._decode(seq.token_ids)
            cut = find_stop(seq.text, seq.request.params.stop)
            if cut is not None:
                seq.text = seq.text[:cut]
        request = seq.request
        request.outputs[seq.sample_index] = SampleOutput(
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            text=seq.text,
            finish_reason=seq.finish_reason or "length",
            weight_version=self._weight_version,
            top_logprobs=seq.top_logprobs if request.top_logprobs else None,
        )
        request.remaining -= 1
        if request.remaining == 0 and not request.future.done():
            request.future.set_result([o for o in request.outputs if o is not None])


def distinct_prompts(
    prompts: Iterable[Sequence[int]],
) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in first-seen order, and each input's index among them.

    >>> distinct_prompts([[1, 2], [3], [1, 2]])
    ([(1, 2), (3,)], [0, 1, 0])
    """
    index: dict[tuple[int, ...], int] = {}
    positions = [index.setdefault(tuple(prompt), len(index)) for prompt in prompts]
    return list(index), positions


def left_padded(
    prompts: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)``, each (U, L), of left-padded prompts.

    One definition for the sampler's prefill and the trainer's shared prompt pass
    (``trainer.algorithms.logprobs.completion_logits``): the positions must agree, or the trainer's
    log-probs would not be the sampler's.

    >>> ids, mask, positions = left_padded([[5, 6], [7]], pad_id=0)
    >>> ids.tolist(), mask.tolist(), positions.tolist()
    ([[5, 6], [0, 7]], [[1, 1], [0, 1]], [[0, 1], [0, 0]])
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # (U, L)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (U, L)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _prefilled(layer: object) -> tuple[CacheLayerMixin, torch.Tensor, torch.Tensor]:
    """A prefilled cache layer with its keys and values. The engine's caches are
    DynamicCache of attention layers, which hold both as tensors once prefilled."""
    if not isinstance(layer, CacheLayerMixin) or layer.keys is None or layer.values is None:
        raise TypeError(f"{type(layer).__name__} holds no prefilled keys/values to merge")
    return layer, layer.keys, layer.values


def _merge_batches(running: _Batch, fresh: _Batch) -> _Batch:
    """Concatenate two left-padded batches (running + newly prefilled) along the batch axis.

    The shorter one is left-padded (zeros in K/V, 0 in the mask) to the longer length, so
    every row keeps its tokens right-aligned and attention ignores the padding.
    """
    width = max(running.attention_mask.shape[1], fresh.attention_mask.shape[1])
    for old, new in zip(running.cache.layers, fresh.cache.layers, strict=True):
        layer, keys, values = _prefilled(old)  # (B, H, l, D) each
        _, new_keys, new_values = _prefilled(new)  # (b, H, l', D) each
        layer.keys = torch.cat(
            [_left_pad(keys, width), _left_pad(new_keys, width)]
        )  # (B+b, H, L, D)
        layer.values = torch.cat(
            [_left_pad(values, width), _left_pad(new_values, width)]
        )  # (B+b, H, L, D)
    return _Batch(
        rows=running.rows + fresh.rows,
        cache=running.cache,
        attention_mask=torch.cat(
            [_left_pad(running.attention_mask, width), _left_pad(fresh.attention_mask, width)]
        ),  # (B+b, L)
        positions=torch.cat([running.positions, fresh.positions]),  # (B+b,)
        last_logits=torch.cat([running.last_logits, fresh.last_logits]),  # (B+b, V)
    )


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Left-pad the sequence axis (dim 2 for (B, H, L, D), dim 1 for (B, L)) with zeros."""
    seq_dim = 2 if tensor.dim() == 4 else 1
    missing = width - tensor.shape[seq_dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[seq_dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=seq_dim)


def read_safetensors_dir(weights_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``weights_dir`` (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {weights_dir}; publish weights with "
            "CheckpointManager or save_pretrained(safe_serialization=True)"
        )
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def copy_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model`` in place, refusing partial or mismatched updates.

    A silent partial load would serve a mixture of versions while reporting the new one.
    """
    params = dict(model.state_dict())
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(params) - set(state_dict) - tied)
    unexpected = sorted(set(state_dict) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the served model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]} (was the checkpoint saved from a different model?)"
        )
    with torch.no_grad():
        for name, tensor in state_dict.items():
            target = params[name]
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))
