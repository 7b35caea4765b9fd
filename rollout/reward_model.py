"""A sequence-classification reward model behind ``POST /v1/rewards`` (``posttrain serve
--reward-model``): the scoring endpoint the trainer's ``reward_model`` verifier calls.

vLLM serves reward models through its pooling API, whose request and response shapes vary by
model and version; this endpoint fixes one small contract the trainer can rely on whatever
serves it: conversations in, one logit each out.

    POST /v1/rewards {"model": "...", "input": [[{"role": "user", "content": "..."},
                                                 {"role": "assistant", "content": "..."}], ...]}
    -> {"object": "list", "model": "...", "data": [{"index": 0, "score": 1.23}, ...]}

A checkpoint saved as ``...ForSequenceClassification`` loads its trained head; a causal LM
(e.g. the packaged SmolLM2) gets a new one-logit head, initialised from a fixed seed so
every replica and restart scores alike (a plumbing test, not a useful reward).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from posttrain.rollout.limits import STRICT

log = logging.getLogger(__name__)

HEAD_SEED = 0
MAX_REWARD_BATCH = 256  # conversations per request


class RewardRequest(BaseModel):
    """``POST /v1/rewards`` body."""

    model_config = STRICT
    model: str | None = None
    input: list[list[dict[str, Any]]] = Field(min_length=1, max_length=MAX_REWARD_BATCH)


class RewardModel:
    """One sequence-classification model scoring batches of conversations (thread-safe)."""

    def __init__(self, model_dir: Path, max_length: int = 2048) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        with torch.random.fork_rng():
            torch.manual_seed(HEAD_SEED)  # a new head is the same on every replica
            self.model = AutoModelForSequenceClassification.from_pretrained(
                model_dir, num_labels=1, dtype=torch.float32
            ).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.max_length = max_length
        self._lock = threading.Lock()

    def score(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        """One logit per conversation; the same value alone or in any batch."""
        import torch

        texts = [
            self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
            for c in conversations
        ]
        encoded = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        )
        with self._lock, torch.inference_mode():
            logits = self.model(**encoded).logits  # (B, 1)
        return [float(v) for v in logits[:, 0]]
