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
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import Counter, Gauge, Histogram

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
    done: concurrent.futures.Future[None]


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

        threads = num_threads or int(os.environ.get("POSTTRAIN_NUM_THREADS", 0)) or (
            os.cpu_count() or 1
        )
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
    ) -> concurrent.futures.Future[None]:
        """Install new weights once the running batch drains; resolves when serving them."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put(_WeightSwap(state_dict, version, done))
        return done

    def load_weights_dir(self, weights_dir: Path, version: int) -> None:
        """Read safetensors from ``weights_dir`` (outside the engine thread) and swap them in."""
        state_dict = read_safetensors_dir(Path(weights_dir))
        self.swap_weights(state_dict, version).result()

    def close(self) -> None:
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

    def _loop(self) -> None:
        running: list[_Sequence] = []
        cache = None
        attention_mask = positions = last_logits = None
        pending_swap: _WeightSwap | None = None
        waiting: list[_Request] = []
        step_started, step_tokens = time.monotonic(), 0
        while not self._stopping.is_set():
            # Admission: block only when nothing is running.
            try:
                while True:
                    idle = not running and not waiting and pending_swap is None
                    item = self._queue.get(block=idle)
                    if item is None:
                        return
                    if isinstance(item, _WeightSwap):
                        pending_swap = item
                    else:
                        waiting.append(item)
                    if self._queue.empty():
                        break
            except queue.Empty:
                pass
            if pending_swap is not None and not running:
                # Requests queued behind the swap are sampled with the new weights.
                self._apply_swap(pending_swap)
                pending_swap = None
            if pending_swap is None and waiting:
                admitted: list[_Request] = []
                rows = len(running)
                while waiting:
                    needed = waiting[0].params.n
                    # A request larger than the whole batch still runs, just alone.
                    if rows + needed > self.max_batch_size and rows > 0:
                        break
                    admitted.append(waiting.pop(0))
                    rows += needed
                    QUEUE_DEPTH.dec()
                if admitted:
                    try:
                        new_rows, new_cache, new_mask, new_pos, new_logits = self._prefill(admitted)
                    except Exception as exc:  # surface to callers rather than kill the loop
                        log.exception("prefill failed")
                        for request in admitted:
                            request.future.set_exception(exc)
                    else:
                        if running:
                            cache, attention_mask = _merge_batches(
                                cache, attention_mask, new_cache, new_mask
                            )
                            positions = torch.cat([positions, new_pos])
                            last_logits = torch.cat([last_logits, new_logits])
                        else:
                            cache, attention_mask = new_cache, new_mask
                            positions, last_logits = new_pos, new_logits
                        running = running + new_rows
            if not running:
                continue
            RUNNING_SEQUENCES.set(len(running))
            sampled_this_step = len(running)
            try:
                running, cache, attention_mask, positions, last_logits = self._decode_step(
                    running, cache, attention_mask, positions, last_logits
                )
            except Exception as exc:
                log.exception("decode step failed; failing %d sequences", len(running))
                for seq in running:
                    if not seq.request.future.done():
                        seq.request.future.set_exception(exc)
                running, cache = [], None
            step_tokens += sampled_this_step
            elapsed = time.monotonic() - step_started
            if elapsed > 1.0:
                TOKENS_PER_SECOND.set(step_tokens / elapsed)
                step_started, step_tokens = time.monotonic(), 0
        RUNNING_SEQUENCES.set(0)

    def _apply_swap(self, swap: _WeightSwap) -> None:
        started = time.monotonic()
        try:
            copy_state_dict(self.model, swap.state_dict)
        except Exception as exc:
            log.exception("weight swap to version %d failed", swap.version)
            swap.done.set_exception(exc)
            return
        self._weight_version = swap.version
        WEIGHT_VERSION.set(swap.version)
        WEIGHT_SWAP_SECONDS.observe(time.monotonic() - started)
        log.info("now serving weight version %d (swap %.3fs)", swap.version,
                 time.monotonic() - started)
        swap.done.set_result(None)

    @torch.inference_mode()
    def _prefill(self, requests: list[_Request]):  # noqa: ANN202 - internal tuple
        """Left-pad and run the prompts of ``requests`` (expanded ``n`` times)."""
        from transformers import DynamicCache

        rows: list[_Sequence] = []
        prompts: list[list[int]] = []
        for request in requests:
            for i in range(request.params.n):
                seed = request.params.seed
                generator = torch.Generator()
                if seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(sample_seed(seed, i))
                budget = min(request.params.max_tokens, self.max_positions - len(request.prompt_ids))
                rows.append(_Sequence(request, i, generator, budget))
                prompts.append(request.prompt_ids)
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # (B, L)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, L)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, L)
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
        last_logits = out.logits[:, -1, :].float()  # (B, V)
        next_positions = position_ids[:, -1] + 1  # (B,)
        return rows, out.past_key_values, attention_mask, next_positions, last_logits

    @torch.inference_mode()
    def _decode_step(self, running, cache, attention_mask, positions, last_logits):  # noqa: ANN001, ANN202
        """Sample one token per row, retire finished rows, run the model one step."""
        tokens = self._sample(running, last_logits)  # (B,)
        keep: list[int] = []
        for row, seq in enumerate(running):
            self._append(seq, int(tokens[row]), last_logits[row])
            if seq.finish_reason is None:
                keep.append(row)
            else:
                self._finish(seq)
        GENERATED_TOKENS.inc(len(running))
        if not keep:
            return [], None, None, None, None
        if len(keep) < len(running):
            index = torch.tensor(keep, dtype=torch.long)
            cache.batch_select_indices(index)
            attention_mask = attention_mask[index]
            positions = positions[index]
            tokens = tokens[index]
            running = [running[i] for i in keep]
        attention_mask = torch.cat(
            [attention_mask, torch.ones((len(running), 1), dtype=attention_mask.dtype)], dim=1
        )  # (B, L+1)
        out = self.model(
            input_ids=tokens[:, None],  # (B, 1)
            attention_mask=attention_mask,
            position_ids=positions[:, None],  # (B, 1)
            past_key_values=cache,
            use_cache=True,
        )
        return running, out.past_key_values, attention_mask, positions + 1, out.logits[:, -1, :]

    def _sample(self, running: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """One token per row, each from that row's own generator (seeded => reproducible)."""
        tokens = torch.empty(len(running), dtype=torch.long)  # (B,)
        for row, seq in enumerate(running):
            params = seq.request.params
            row_logits = logits[row]  # (V,)
            if params.temperature == 0:
                tokens[row] = int(row_logits.argmax())
                continue
            filtered = top_p_filter(row_logits / params.temperature, params.top_p)  # (V,)
            probs = torch.softmax(filtered, dim=-1)  # (V,)
            tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
        return tokens

    def _append(self, seq: _Sequence, token: int, logits: torch.Tensor) -> None:
        params = seq.request.params
        temperature = params.temperature if params.temperature > 0 else 1.0
        logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (V,)
        seq.token_ids.append(token)
        seq.logprobs.append(float(logprobs[token]))
        if seq.request.top_logprobs:
            values, ids = logprobs.topk(seq.request.top_logprobs)  # (k,), (k,)
            seq.top_logprobs.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        if token in self.eos_ids:
            seq.finish_reason = "stop"
            return
        if params.stop:
            text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
            cut = find_stop(text, params.stop)
            if cut is not None:
                seq.text = text[:cut]
                seq.finish_reason = "stop"
                return
        if len(seq.token_ids) >= seq.max_new_tokens:
            seq.finish_reason = "length"

    def _finish(self, seq: _Sequence) -> None:
        if not (seq.finish_reason == "stop" and seq.request.params.stop and seq.text):
            seq.text = self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
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


def _merge_batches(cache, mask: torch.Tensor, new_cache, new_mask: torch.Tensor):  # noqa: ANN001, ANN202
    """Concatenate two left-padded batches (running + newly prefilled) along the batch axis.

    The shorter one is left-padded (zeros in K/V, 0 in the mask) to the longer length, so
    every row keeps its tokens right-aligned and attention ignores the padding.
    """
    width = max(mask.shape[1], new_mask.shape[1])
    for layer, new_layer in zip(cache.layers, new_cache.layers, strict=True):
        layer.keys = torch.cat(
            [_left_pad(layer.keys, width), _left_pad(new_layer.keys, width)]
        )  # (B+b, H, L, D)
        layer.values = torch.cat(
            [_left_pad(layer.values, width), _left_pad(new_layer.values, width)]
        )  # (B+b, H, L, D)
    merged_mask = torch.cat([_left_pad(mask, width), _left_pad(new_mask, width)])  # (B+b, L)
    return cache, merged_mask


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
