"""Shared fixtures: the real SmolLM2 tokenizer (chat template) and a scripted policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posttrain.rollout.protocol import Completion, SamplingParams


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


class ScriptedPolicy:
    """Plays fixed replies as if sampled: real token ids (reply + end-of-turn token), fixed
    log-probs, a weight version; records every context it was asked to continue."""

    def __init__(self, tokenizer: Any, replies: list[str], weight_version: int = 3) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.contexts: list[list[int]] = []
        self.weight_version = weight_version

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        assert len(prompts) == 1 and params.n == 1
        self.contexts.append(list(prompts[0]))
        text = self.replies.pop(0)
        ids = [
            *self.tokenizer(text, add_special_tokens=False)["input_ids"],
            self.tokenizer.eos_token_id,
        ]
        return [[Completion(0, text, ids, [-0.25] * len(ids), "stop", self.weight_version)]]
