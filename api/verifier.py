"""How a domain's output is scored: rule and sandbox verifiers, and model-based scorers
(an LLM judge, a reward model) served over HTTP by a RolloutPool or any OpenAI-compatible
endpoint."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from .base import DNS_LABEL, ApiModel

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
HTTP_URL = r"^https?://[^\s/]+(/\S*)?$"
MODEL_KINDS = ("judge", "reward_model")


class SecretKeyRef(ApiModel):
    """One key of a Secret in the run's namespace."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)
    """The Secret's name."""
    key: str = Field(pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)
    """The key inside the Secret."""


class ModelEndpoint(ApiModel):
    """Where a scoring model is served, and how hard to try before a sample is masked.

    A request that still fails after ``maxRetries`` retries (timeout, connection refused, a
    5xx, no ready replica, an answer that does not parse) is an *infrastructure failure*: the
    sample is masked out of the loss, like an errored episode, never scored 0.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.pool) != has(self.url)",
                    "message": "set exactly one of pool and url",
                },
                {
                    "rule": "!has(self.apiKeySecret) || has(self.apiKeyEnv)",
                    "message": "apiKeySecret needs apiKeyEnv (the variable the trainer reads)",
                    "fieldPath": ".apiKeyEnv",
                },
            ]
        }
    )

    pool: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63)
    """A RolloutPool in the run's namespace; the trainer sends to its ready replicas
    (status.replicaEndpoints), each at ``<replica>/v1``."""
    url: str | None = Field(default=None, pattern=HTTP_URL, max_length=2048)
    """Base URL of an OpenAI-compatible API including its version path, e.g.
    https://api.openai.com/v1 or http://judge.ns.svc:8000/v1."""
    model: str | None = Field(default=None, max_length=256)
    """Model name sent in each request (unset: the server's first /v1/models entry)."""
    api_key_env: str | None = Field(default=None, pattern=ENV_NAME, max_length=128)
    """Environment variable of the trainer holding the API key, sent as a Bearer token
    (locally: export it; in the cluster: the operator fills it from ``apiKeySecret``)."""
    api_key_secret: SecretKeyRef | None = None
    """Secret key the operator passes to the trainer pods as ``apiKeyEnv`` (a secretKeyRef,
    never a literal)."""
    timeout_seconds: float = Field(default=60.0, gt=0, le=3600)
    """Wall clock of one request."""
    max_retries: int = Field(default=3, ge=0, le=20)
    """Retries of a failed request (capped exponential backoff from ``backoffSeconds``)."""
    backoff_seconds: float = Field(default=1.0, ge=0, le=60)
    """Wait before the first retry; doubled each retry, at most 30 s."""
    max_concurrency: int = Field(default=8, ge=1, le=256)
    """Requests in flight at once to this endpoint."""

    @model_validator(mode="after")
    def _check_endpoint(self) -> ModelEndpoint:
        if (self.pool is None) == (self.url is None):
            raise ValueError("set exactly one of pool and url")
        if self.api_key_secret is not None and self.api_key_env is None:
            raise ValueError("apiKeySecret needs apiKeyEnv (the variable the trainer reads)")
        return self


class JudgeSpec(ModelEndpoint):
    """An LLM judge: the rubric, filled with the task and the answer, is sent as a chat
    request; the reply must end with a line ``SCORE: <number>`` on ``scale``, anything else
    is a format failure (retried, then masked)."""

    rubric: str = Field(min_length=1, max_length=32768)
    """The judge's instructions. ``{prompt}``, ``{answer}`` and ``{reference}`` (the task's
    answer, empty when it has none) are replaced; ``{answer}`` is required. The trainer
    appends the required last line's format."""
    scale: Literal["0-1", "1-10"] = "0-1"
    """The SCORE's range: 0-1 is the reward as is; 1-10 maps to (score - 1) / 9."""
    pass_threshold: float = Field(default=0.5, ge=0, le=1)
    """A reward at or above it counts as passed (accuracy, curriculum, audit)."""
    max_tokens: int = Field(default=512, ge=8, le=32768)
    """Judge reply budget (rationale and SCORE line)."""
    temperature: float = Field(default=0.0, ge=0, le=2)
    """Judge sampling temperature; 0 makes a retry after a format failure pointless on a
    deterministic server, so raise it if format failures are common."""
    rule_check: Literal["exact", "numeric"] | None = None
    """A rule verifier run beside the judge on tasks that carry an answer: never the reward,
    only the audit's judge-vs-rule disagreement rate."""

    @model_validator(mode="after")
    def _check_rubric(self) -> JudgeSpec:
        if "{answer}" not in self.rubric:
            raise ValueError("judge.rubric must contain {answer} (where the completion goes)")
        return self


class RewardModelSpec(ModelEndpoint):
    """A sequence-classification reward model served at ``POST /v1/rewards`` (``posttrain
    serve --reward-model``): each (prompt, completion) conversation gets the model's logit,
    squashed into [0, 1] by a sigmoid."""

    batch_size: int = Field(default=16, ge=1, le=1024)
    """Conversations per request: concurrent scorings are gathered into batches of this."""
    pass_threshold: float = Field(default=0.5, ge=0, le=1)
    """A reward at or above it counts as passed."""


class VerifierSpec(ApiModel):
    """How a domain's (or task's) output is scored into a reward in [0, 1]."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(self.kind == 'judge') == has(self.judge)",
                    "message": "judge is required for kind judge and only allowed with it",
                    "fieldPath": ".judge",
                },
                {
                    "rule": "(self.kind == 'reward_model') == has(self.rewardModel)",
                    "message": "rewardModel is required for kind reward_model and only "
                    "allowed with it",
                    "fieldPath": ".rewardModel",
                },
            ]
        }
    )

    kind: Literal[
        "exact",
        "numeric",
        "regex",
        "json_tool_call",
        "bfcl_ast",
        "unit_tests",
        "shell",
        "judge",
        "reward_model",
    ]
    """exact: normalised string match; numeric: final number within tolerance; regex: format
    compliance; json_tool_call: a JSON tool call matching a schema; bfcl_ast: python-syntax
    calls judged by BFCL's AST checker against the task's accepted answers; unit_tests: Python
    tests run in the sandbox (reward = pass rate); shell: terminal task checked by a verify
    script; judge: an LLM grades the answer against a rubric (``judge``); reward_model: a
    sequence-classification model scores it (``rewardModel``)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Kind-specific settings, e.g. {"pattern": "..."} for regex, {"rel_tol": 1e-6} for numeric."""
    judge: JudgeSpec | None = None
    """The judge (kind judge only)."""
    reward_model: RewardModelSpec | None = None
    """The reward model (kind reward_model only)."""

    @model_validator(mode="after")
    def _check_model_scorer(self) -> VerifierSpec:
        if (self.kind == "judge") != (self.judge is not None):
            raise ValueError("judge is required for kind judge and only allowed with it")
        if (self.kind == "reward_model") != (self.reward_model is not None):
            raise ValueError(
                "rewardModel is required for kind reward_model and only allowed with it"
            )
        return self

    def endpoint(self) -> ModelEndpoint | None:
        """The judge or reward model, when this verifier is one."""
        return self.judge or self.reward_model

    def scorer_config(self) -> dict[str, Any]:
        """What the trainer's ``verify(kind, ..., config)`` receives: ``config``, plus the
        judge's or reward model's settings under ``"endpoint"`` (snake_case)."""
        endpoint = self.endpoint()
        if endpoint is None:
            return dict(self.config)
        return {**self.config, "endpoint": endpoint.model_dump(mode="json")}
