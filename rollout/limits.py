"""What a rollout server accepts: the request bodies, strictly typed, and the limits a server
puts on the work one request may ask for (#31).

``posttrain serve`` and the vLLM front door parse completions with the same models and the
same :func:`check_limits`, so both refuse the same requests with the same messages: a 400
whose OpenAI-style error names the field (``param``) and the limit. Types are strict (JSON
``"9"`` is not a number of tokens, ``true`` is not 1) and sampling floats finite (``NaN``
and ``Infinity``, which Python's JSON parser accepts, are refused): a request that means
something other than what it says is a client bug to surface, not to guess at.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.httplimits import HttpLimits
from posttrain.rollout.protocol import SamplingParams

# extra="ignore": OpenAI and vLLM bodies carry fields we do not use (user, presence_penalty);
# they pass through the front door to vLLM untouched.
STRICT = ConfigDict(extra="ignore", strict=True)
CHAT_DEFAULT_MAX_TOKENS = 128
Body = TypeVar("Body", bound=BaseModel)


@dataclass(frozen=True)
class RequestLimits:
    """The most one request may ask of a rollout server (``posttrain serve`` and
    ``posttrain rollout vllm-entry`` flags)."""

    max_n: int = 512
    """Samples one request may ask for in all: ``n`` times its number of prompts. 512 is the
    largest ``spec.algorithm.groupSize`` a TrainingRun may set, and the trainer sends one
    group (one prompt, ``n`` = group size) per request."""
    max_tokens: int | None = None
    """Tokens one sample may ask for (``max_tokens``, ``max_completion_tokens``). None: the
    model's context length where the server knows it (the CPU engine always does; vLLM
    checks against its ``--max-model-len`` itself)."""
    max_logprobs: int = 20
    """Top logprobs per token (``logprobs``, ``top_logprobs``); 20 is vLLM's default
    ``--max-logprobs`` and OpenAI's ceiling."""
    http: HttpLimits = field(default_factory=HttpLimits)
    """Body size and read deadlines, connections."""

    def __post_init__(self) -> None:
        for name in ("max_n", "max_tokens", "max_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


class ApiError(Exception):
    """An error to return as an OpenAI-style JSON error body; ``param`` names the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object.

    >>> error_body(400, "n must be <= 512", "n")["error"]["param"]
    'n'
    """
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` body (OpenAI legacy completions + vLLM extensions)."""

    model_config = STRICT
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int = 1
    max_tokens: int = 16
    temperature: float = Field(default=1.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    stream: bool = False
    return_tokens_as_token_ids: bool = False


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` body."""

    model_config = STRICT
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(default=1.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, allow_inf_nan=False)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0)
    stream: bool = False
    return_tokens_as_token_ids: bool = False

    @property
    def wanted_tokens(self) -> int:
        """The completion budget asked for (OpenAI's newer field wins; 128 when neither)."""
        for value in (self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return CHAT_DEFAULT_MAX_TOKENS


class WeightLoadRequest(BaseModel):
    """``POST /v1/weights/load`` body."""

    model_config = STRICT
    uri: str = Field(min_length=1)
    version: int = Field(ge=0)
    stream: bool | None = None
    """vLLM replicas: stream a full ``s3://`` version into the engine while it downloads
    (True), download it first (False), or choose (None: stream when idle); see
    docs/rollout.md, "Streamed loads". The CPU engine's server always downloads first."""


class WeightTransferRequest(BaseModel):
    """``POST /v1/weights/transfer`` body: one step of a transfer session
    (docs/rollout.md, "Direct transfer"): ``start``, ``update`` (with vLLM's packed update
    info for one bucket), ``finish`` (serve ``version``) or ``abort``."""

    model_config = STRICT
    version: int = Field(ge=1)
    op: Literal["start", "update", "finish", "abort"]
    update_info: dict[str, Any] | None = None
    device: Literal["cpu", "cuda"] | None = None  # of the staging buffers (start)


def normalize_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[str | list[int]]:
    """The four OpenAI prompt forms as a list of single prompts.

    >>> normalize_prompts([1, 2, 3])
    [[1, 2, 3]]
    >>> normalize_prompts("hi")
    ['hi']
    """
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def describe_validation_errors(errors: list[Any]) -> ApiError:
    """One 400 for pydantic's errors: every problem in the message, the first field as
    ``param``. ``loc`` paths are shown without the body prefix FastAPI adds.

    >>> describe_validation_errors([{"loc": ("body", "n"), "msg": "Input should be a valid integer"}]).message
    'invalid request body: n: Input should be a valid integer'
    """
    paths = [".".join(str(p) for p in err["loc"] if p != "body") or "body" for err in errors]
    problems = "; ".join(f"{path}: {err['msg']}" for path, err in zip(paths, errors, strict=True))
    param = paths[0].split(".")[0] if paths else None
    return ApiError(400, f"invalid request body: {problems}", param)


def parse_body(model: type[Body], body: bytes) -> Body:
    """``body`` (JSON bytes) as ``model``, or an :class:`ApiError` 400 saying what is wrong.

    Too deeply nested JSON is refused like any malformed JSON (Python's parser raises
    RecursionError past ~1000 levels).
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise describe_validation_errors(exc.errors()) from None


def check_limits(
    request: CompletionRequest | ChatRequest,
    limits: RequestLimits,
    prompts: int = 1,
    context_length: int | None = None,
) -> None:
    """Refuse (ApiError 400 naming the field and the limit) a request that asks for more
    than ``limits`` allow; ``context_length`` is the model's, when the server knows it. Token
    budgets are checked as asked: an unset ``max_tokens`` takes the engine's default.

    >>> try:
    ...     check_limits(CompletionRequest(prompt="x", n=600), RequestLimits())
    ... except ApiError as exc:
    ...     print(exc.status, exc.param, exc.message[:42])
    400 n n=600 for 1 prompt(s) asks for 600 samples
    """
    samples = request.n * prompts
    if samples > limits.max_n:
        raise ApiError(
            400,
            f"n={request.n} for {prompts} prompt(s) asks for {samples} samples; this server "
            f"allows at most {limits.max_n} per request (max_n): send fewer prompts or a "
            "smaller n per request",
            "n",
        )
    caps = [cap for cap in (limits.max_tokens, context_length) if cap is not None]
    token_cap = min(caps) if caps else None
    for name in ("max_tokens", "max_completion_tokens"):
        # What the request asks for: an unset field takes the server's default budget.
        wanted = getattr(request, name) if name in request.model_fields_set else None
        if token_cap is not None and wanted is not None and wanted > token_cap:
            raise ApiError(
                400,
                f"{name}={wanted} is over this server's limit of {token_cap} tokens per sample "
                "(max_tokens, at most the model's context length)",
                name,
            )
    top = request.logprobs if isinstance(request, CompletionRequest) else request.top_logprobs
    name = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
    if top is not None and top > limits.max_logprobs:
        raise ApiError(
            400,
            f"{name}={top} is over this server's limit of {limits.max_logprobs} top "
            "logprobs per token (max_logprobs)",
            name,
        )


def normalize_stop(stop: str | list[str] | None) -> list[str]:
    """OpenAI accepts one stop string or a list; empty strings would match everywhere.

    >>> normalize_stop(["\\n", ""])
    ['\\n']
    """
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [s for s in stop if s]


def sampling_params(request: CompletionRequest | ChatRequest) -> SamplingParams:
    """The request's sampling parameters, checked (ApiError 400 naming the field).

    >>> sampling_params(ChatRequest(messages=[{}], max_completion_tokens=4)).max_tokens
    4
    """
    wanted = request.max_tokens if isinstance(request, CompletionRequest) else request.wanted_tokens
    params = SamplingParams(
        n=request.n,
        max_tokens=wanted,
        temperature=request.temperature,
        top_p=request.top_p,
        stop=normalize_stop(request.stop),
        seed=request.seed,
    )
    try:
        params.validate()
    except ValueError as exc:  # the message starts with the field's name
        raise ApiError(400, str(exc), str(exc).split()[0]) from exc
    return params
