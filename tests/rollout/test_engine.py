"""The CPU generation engine against its contract, on a tiny model (and the real 135M once)."""

from __future__ import annotations

import doctest
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from posttrain.models import resolve_model
from posttrain.rollout import client, engine, limits, protocol, server, vllm, weight_stream, weights
from posttrain.rollout.engine import GenerationEngine, copy_state_dict, read_safetensors_dir
from posttrain.rollout.protocol import SamplingParams


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir: Path) -> Iterator[GenerationEngine]:
    eng = GenerationEngine(tiny_model_dir, num_threads=1)
    yield eng
    eng.close()


def prompts(eng: GenerationEngine) -> list[list[int]]:
    texts = ["Hello world", "The quick brown fox jumps over the lazy", "1 2 3"]
    return [eng.tokenizer.encode(t) for t in texts]


def reference_logprobs(
    eng: GenerationEngine, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """log_softmax(logits / T)[token] from one plain, unbatched forward pass."""
    ids = torch.tensor([prompt + completion])  # (1, P+C)
    with torch.no_grad():
        logits = eng.model(ids).logits[0]  # (P+C, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)  # (P+C, V)
    start = len(prompt) - 1
    return [float(logprobs[start + i, tok]) for i, tok in enumerate(completion)]


def test_doctests_pass() -> None:
    for module in (engine, protocol, limits, server, client, vllm, weights, weight_stream):
        result = doctest.testmod(module)
        assert result.failed == 0, f"{module.__name__}: {result}"
        assert result.attempted > 0 or module in (client,), module.__name__


def test_shapes_and_n(tiny_engine: GenerationEngine) -> None:
    results = tiny_engine.generate(prompts(tiny_engine), SamplingParams(n=3, max_tokens=7, seed=1))
    assert len(results) == 3
    for samples in results:
        assert len(samples) == 3
        for sample in samples:
            assert len(sample.token_ids) == len(sample.logprobs) == 7
            assert sample.finish_reason == "length"
            assert all(lp <= 0 for lp in sample.logprobs)
            assert sample.weight_version == 0
    # The n samples of one prompt are distinct draws, not copies.
    assert len({tuple(s.token_ids) for s in results[0]}) > 1


def test_seed_determinism_independent_of_batch(tiny_engine: GenerationEngine) -> None:
    params = SamplingParams(n=2, max_tokens=12, seed=42, temperature=0.9, top_p=0.95)
    batch = tiny_engine.generate(prompts(tiny_engine), params)
    again = tiny_engine.generate(prompts(tiny_engine), params)
    alone = tiny_engine.generate([prompts(tiny_engine)[1]], params)
    assert [[s.token_ids for s in r] for r in batch] == [[s.token_ids for s in r] for r in again]
    assert [s.token_ids for s in alone[0]] == [s.token_ids for s in batch[1]]
    other_seed = tiny_engine.generate(
        prompts(tiny_engine), SamplingParams(n=2, max_tokens=12, seed=7)
    )
    assert [[s.token_ids for s in r] for r in other_seed] != [
        [s.token_ids for s in r] for r in batch
    ]


def test_a_prompt_is_prefilled_once_for_all_its_samples(tiny_engine: GenerationEngine) -> None:
    """Prefix sharing: the n samples of a prompt share one prefill (their KV cache is
    copied), so prompt tokens are counted once; the samples stay distinct draws whose
    log-probs match a plain forward (test_logprobs_match_plain_forward)."""
    from prometheus_client import REGISTRY

    def prefilled() -> float:
        return REGISTRY.get_sample_value("posttrain_rollout_prompt_tokens_total") or 0.0

    prompt = prompts(tiny_engine)[1]
    before = prefilled()
    [samples] = tiny_engine.generate([prompt], SamplingParams(n=4, max_tokens=6, seed=5))
    assert prefilled() - before == len(prompt)
    assert len(samples) == 4 and len({tuple(s.token_ids) for s in samples}) > 1


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_match_plain_forward(
    tiny_engine: GenerationEngine, temperature: float, top_p: float
) -> None:
    params = SamplingParams(n=2, max_tokens=10, temperature=temperature, top_p=top_p, seed=3)
    batch_prompts = prompts(tiny_engine)  # different lengths: exercises left padding
    results = tiny_engine.generate(batch_prompts, params)
    effective_t = temperature if temperature > 0 else 1.0
    for prompt, samples in zip(batch_prompts, results, strict=True):
        for sample in samples:
            expected = reference_logprobs(tiny_engine, prompt, sample.token_ids, effective_t)
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)
    if temperature == 0:
        # Greedy: every token is the argmax of a plain forward pass.
        prompt, sample = batch_prompts[0], results[0][0]
        ids = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            argmax = tiny_engine.model(ids).logits[0].argmax(-1)  # (P+C,)
        assert sample.token_ids == argmax[len(prompt) - 1 : -1].tolist()


def test_stop_strings(tiny_engine: GenerationEngine) -> None:
    prompt = prompts(tiny_engine)[0]
    free = tiny_engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0))[0][0]
    stop = free.text[8:11]
    assert stop.strip(), f"degenerate continuation {free.text!r}"
    stopped = tiny_engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, stop=[stop])
    )[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stop not in stopped.text
    # Token ids keep the tokens that produced the stop string (the trainer scores them).
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < 20


def test_continuous_batching_admits_mid_batch(tiny_engine: GenerationEngine) -> None:
    long_params = SamplingParams(n=2, max_tokens=400, seed=5)
    short_params = SamplingParams(n=1, max_tokens=10, seed=6)
    p_long, p_short = prompts(tiny_engine)[1], prompts(tiny_engine)[0]
    solo_long = tiny_engine.generate([p_long], long_params)[0]
    solo_short = tiny_engine.generate([p_short], short_params)[0]
    before = tiny_engine.midbatch_admissions
    deadline = time.monotonic() + 30
    # The solo run's future resolves a moment before the engine thread resets its row count;
    # a stale count would let the short request queue up next to the long one.
    while tiny_engine.active_sequences != 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    long_future = tiny_engine.submit(p_long, long_params)
    while tiny_engine.active_sequences == 0 and time.monotonic() < deadline:
        time.sleep(0.002)  # join only once the long request is decoding
    short_future = tiny_engine.submit(p_short, short_params)
    short = short_future.result(timeout=60)
    assert not long_future.done(), "short request should finish while the long one decodes"
    long = long_future.result(timeout=60)
    assert tiny_engine.midbatch_admissions > before
    assert [s.token_ids for s in long] == [s.token_ids for s in solo_long]
    assert short[0].token_ids == solo_short[0].token_ids
    assert short[0].logprobs == pytest.approx(solo_short[0].logprobs, abs=1e-4)


def test_weight_swap_changes_outputs_and_waits_for_inflight(
    tiny_model_dir: Path, tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    eng = GenerationEngine(tiny_model_dir, num_threads=1)
    try:
        params = SamplingParams(n=1, max_tokens=15, seed=9)
        prompt = prompts(eng)[0]
        base = eng.generate([prompt], params)[0][0]
        v1_dir = publish_weights(tmp_path, 1, 0.5)
        in_flight = eng.submit(prompt, SamplingParams(max_tokens=150, seed=1))
        deadline = time.monotonic() + 30
        while eng.active_sequences == 0 and time.monotonic() < deadline:
            time.sleep(0.005)  # swap only once the request is decoding
        eng.load_weights_dir(v1_dir, version=1)
        old = in_flight.result(timeout=60)[0]
        assert old.weight_version == 0  # sampled entirely before the swap
        assert len(old.token_ids) == 150
        assert eng.weight_version == 1
        new = eng.generate([prompt], params)[0][0]
        assert new.weight_version == 1
        assert new.token_ids != base.token_ids
        assert new.token_ids == eng.generate([prompt], params)[0][0].token_ids  # deterministic
        eng.load_weights_dir(publish_weights(tmp_path, 2, 0.0), 2)
        assert eng.generate([prompt], params)[0][0].token_ids == base.token_ids
    finally:
        eng.close()


def test_mismatched_weights_are_refused(
    tiny_engine: GenerationEngine, tiny_model_dir: Path
) -> None:
    state = read_safetensors_dir(tiny_model_dir)
    state.pop(next(iter(state)))
    with pytest.raises(ValueError, match="missing"):
        copy_state_dict(tiny_engine.model, state)
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny_engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        tiny_engine.submit([1, 2], SamplingParams(top_p=0))


def test_real_smollm2_answers_and_stops_at_eos() -> None:
    eng = GenerationEngine(resolve_model("smollm2-135m-instruct"), num_threads=2)
    try:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = eng.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        (sample,) = eng.generate([list(prompt)], SamplingParams(max_tokens=40, temperature=0))[0]
        assert "Paris" in sample.text
        assert sample.finish_reason == "stop"
        assert sample.token_ids[-1] == eng.tokenizer.eos_token_id  # EOS kept for training
        assert "<|im_end|>" not in sample.text
    finally:
        eng.close()
