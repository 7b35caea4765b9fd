"""Plain data types shared by the rollout client, engine and server (no torch here).

Kept separate so the trainer and the operator can import the client without pulling in
torch, and so the engine and the HTTP layer agree on one definition of a sampling request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WEIGHT_VERSION_HEADER = "x-weight-version"
TOKEN_ID_PREFIX = "token_id:"


@dataclass
class SamplingParams:
    """OpenAI/vLLM sampling parameters for one prompt (n samples per prompt).

    ``temperature == 0`` means greedy decoding. ``seed`` makes the request deterministic:
    sample ``i`` of a request draws from its own generator seeded from ``(seed, i)``, so the
    result does not depend on which other requests share the batch.
    """

    n: int = 1
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError with the offending value; the server maps it to HTTP 400."""
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_request_fields(self) -> dict[str, Any]:
        """The matching ``/v1/completions`` body fields.

        >>> SamplingParams(n=2, seed=7).to_request_fields()["n"]
        2
        """
        body: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop:
            body["stop"] = list(self.stop)
        if self.seed is not None:
            body["seed"] = self.seed
        return body


@dataclass
class Completion:
    """One sampled continuation, with what the trainer needs for importance correction.

    ``logprobs[i]`` is ``log_softmax(logits / temperature)[token_ids[i]]`` (temperature 1 when
    greedy), before top-p truncation -- see docs/rollout.md.
    """

    prompt_index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int


def parse_token_id(token: str) -> int:
    """Parse vLLM's ``return_tokens_as_token_ids`` form.

    >>> parse_token_id("token_id:123")
    123
    """
    if not token.startswith(TOKEN_ID_PREFIX):
        raise ValueError(
            f"expected a token of the form 'token_id:N', got {token!r}; the server must "
            "support return_tokens_as_token_ids (vLLM >= 0.6 or posttrain serve)"
        )
    return int(token[len(TOKEN_ID_PREFIX) :])
