"""Model-based rewards: an LLM judge and a reward model, both served over HTTP.

A rule verifier cannot fail for reasons outside the answer; a model served elsewhere can
(timeouts, a restarting replica, a judge that ignores the output format). Such a failure is
retried with capped exponential backoff and, when the retries run out, raised as
:class:`ScoringUnavailable`: the trainer masks that sample out of the loss (like an errored
episode) and never scores it 0, which would teach the policy that a right answer was wrong.

* ``judge``: the rubric, filled with the task's prompt, the completion and the reference
  answer, goes to ``POST {base}/chat/completions``; the reply's last non-empty line must be
  ``SCORE: <number>`` within the scale (:func:`parse_score`). Verdicts are cached by the
  sha256 of (rubric, prompt, answer, reference), so a repeated completion (common once a
  policy converges) costs no request. The rest of the reply is the rationale, kept in the
  sample's details for the audit's spot checks.
* ``reward_model``: conversations go in batches to ``POST {base}/rewards`` (``posttrain
  serve --reward-model``); the logit becomes a reward in [0, 1] through a sigmoid.

``base`` is the endpoint's ``url``, or ``<replica>/v1`` for each ready replica of its
RolloutPool (read from the pool's status, refreshed every few seconds), tried in turn.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import Counter

from posttrain.api.verifier import MODEL_KINDS
from posttrain.envs.task import content_hash
from posttrain.errors import UsageError

if TYPE_CHECKING:
    from posttrain.sandboxes.verifiers import VerifierResult

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0
POOL_REFRESH_S = 5.0
CACHE_ENTRIES = 65536
RATIONALE_CHARS = 2000
BATCH_WAIT_S = 0.02  # how long the first scoring of a batch waits for others to join it

SCORER_FAILURES = Counter(
    "posttrain_scorer_failures_total",
    "Judge / reward-model requests that failed (retried; masked once retries ran out).",
    ["kind", "reason"],
)
SCORER_MASKED = Counter(
    "posttrain_scorer_masked_samples_total",
    "Samples a judge or reward model could not score: masked out of the loss, not scored 0.",
    ["kind"],
)
JUDGE_CACHE_HITS = Counter("posttrain_judge_cache_hits_total", "Judge verdicts served from cache.")

FORMAT_INSTRUCTION = (
    "\n\nWrite your reasoning first. End your reply with one final line of exactly this "
    "form and nothing after it:\nSCORE: <a number from {low} to {high}>"
)
SCALES = {"0-1": (0.0, 1.0), "1-10": (1.0, 10.0)}
_SCORE_LINE = re.compile(r"SCORE:\s*([0-9]+(?:\.[0-9]+)?)")


class ScoringUnavailable(RuntimeError):
    """The judge or reward model could not score this sample (after its retries): the
    sample is masked out of the loss, never scored 0."""


class ScorerConfigError(UsageError):
    """A judge or reward model that cannot work as configured (no endpoint settings, a pool
    outside a cluster): the step, and the run, fail at once with the reason, rather than
    masking every sample."""


class ScoreFormatError(ValueError):
    """The judge replied without a valid final ``SCORE:`` line."""


def parse_score(reply: str, scale: str) -> tuple[float, str]:
    """``(reward in [0, 1], rationale)`` from a judge reply, strictly.

    The last non-empty line must be ``SCORE: <number>`` and the number within ``scale``
    (``0-1`` or ``1-10``, mapped to (s - 1) / 9); anything else raises ScoreFormatError.

    >>> parse_score("Correct and complete.\\nSCORE: 0.8", "0-1")
    (0.8, 'Correct and complete.')
    >>> parse_score("ok\\nSCORE: 10\\n", "1-10")
    (1.0, 'ok')
    >>> parse_score("SCORE: 7 because", "1-10")
    Traceback (most recent call last):
    ...
    posttrain.trainer.rewards.scorers.ScoreFormatError: the last line is not 'SCORE: <number>': 'SCORE: 7 because'
    >>> parse_score("SCORE: 11", "1-10")
    Traceback (most recent call last):
    ...
    posttrain.trainer.rewards.scorers.ScoreFormatError: SCORE 11 is outside the scale 1-10
    """
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    if not lines:
        raise ScoreFormatError("the judge replied with nothing")
    match = _SCORE_LINE.fullmatch(lines[-1])
    if match is None:
        raise ScoreFormatError(f"the last line is not 'SCORE: <number>': {lines[-1][:200]!r}")
    low, high = SCALES[scale]
    score = float(match.group(1))
    if not low <= score <= high:
        raise ScoreFormatError(f"SCORE {match.group(1)} is outside the scale {scale}")
    reward = (score - low) / (high - low)
    return reward, "\n".join(lines[:-1])


def fill_rubric(rubric: str, prompt: str, answer: str, reference: str) -> str:
    """The rubric with its placeholders replaced (plain replacement, so braces elsewhere in
    a rubric, e.g. JSON, need no escaping).

    >>> fill_rubric("Q: {prompt} A: {answer} Ref: {reference} {x}", "1+1?", "2", "2")
    'Q: 1+1? A: 2 Ref: 2 {x}'
    """
    return (
        rubric.replace("{prompt}", prompt)
        .replace("{reference}", reference)
        .replace("{answer}", answer)
    )


class VerdictCache:
    """Thread-safe LRU of judge verdicts by content digest."""

    def __init__(self, capacity: int = CACHE_ENTRIES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[float, str]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[float, str] | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: str, value: tuple[float, str]) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class Endpoint:
    """One judge's or reward model's endpoint: base URLs, auth, and retried requests."""

    def __init__(
        self,
        kind: str,
        settings: Mapping[str, Any],
        *,
        discover: Callable[[str], list[str]] | None = None,
        environ: Mapping[str, str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.kind = kind
        self.settings = dict(settings)
        self.timeout_s = float(settings.get("timeout_seconds", 60.0))
        self.max_retries = int(settings.get("max_retries", 3))
        self.backoff_s = float(settings.get("backoff_seconds", 1.0))
        self.pool: str | None = settings.get("pool")
        self.url: str | None = settings.get("url")
        self._discover = discover or _pool_replicas
        self._sleep = sleep
        self._bases: list[str] = []
        self._bases_at = -math.inf
        self._next = 0
        self._model: str | None = settings.get("model")
        self._lock = threading.Lock()
        headers = {}
        key_env = settings.get("api_key_env")
        if key_env:
            key = (os.environ if environ is None else environ).get(key_env, "")
            if not key:
                log.warning("%s: $%s is empty; sending requests without a key", kind, key_env)
            else:
                headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(timeout=self.timeout_s, headers=headers)

    @property
    def name(self) -> str:
        return f"RolloutPool {self.pool}" if self.pool else str(self.url)

    def _base(self) -> str:
        """The next base URL in turn (a pool's replicas re-read every few seconds)."""
        with self._lock:
            if self.url is not None:
                return self.url.rstrip("/")
            now = time.monotonic()
            if now - self._bases_at >= POOL_REFRESH_S or not self._bases:
                assert self.pool is not None
                replicas = self._discover(self.pool)
                self._bases = [f"{r.rstrip('/')}/v1" for r in replicas]
                self._bases_at = now
            if not self._bases:
                raise ScoringUnavailable(f"RolloutPool {self.pool} has no ready replica")
            self._next = (self._next + 1) % len(self._bases)
            return self._bases[self._next]

    def model(self, base: str) -> str:
        """The model to name in requests: the spec's, else the server's first one."""
        if self._model is None:
            response = self.client.get(f"{base}/models")
            response.raise_for_status()
            self._model = str(response.json()["data"][0]["id"])
        return self._model

    def request(
        self, path: str, body: Callable[[str], dict[str, Any]], parse: Callable[[Any], Any]
    ) -> Any:
        """POST ``body(model)`` to ``{base}{path}`` and ``parse`` the JSON answer, retrying
        any failure (transport, status, parse) with capped exponential backoff; after
        ``maxRetries`` retries, ScoringUnavailable with the last error."""
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self._sleep(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)))
            reason = "transport"
            try:
                base = self._base()
                response = self.client.post(f"{base}{path}", json=body(self.model(base)))
                if response.status_code >= 400:
                    reason = f"http_{response.status_code}"
                    raise ScoringUnavailable(f"HTTP {response.status_code}: {response.text[:300]}")
                reason = "format"
                return parse(response.json())
            except (httpx.HTTPError, ScoringUnavailable, ScoreFormatError, ValueError, KeyError,
                    IndexError, TypeError) as exc:  # fmt: skip
                last = f"{type(exc).__name__}: {exc}"
                SCORER_FAILURES.labels(self.kind, reason).inc()
                log.warning("%s (%s) failed (attempt %d of %d): %s", self.kind, self.name,
                            attempt + 1, self.max_retries + 1, last)  # fmt: skip
        raise ScoringUnavailable(
            f"{self.kind} at {self.name} failed {self.max_retries + 1} times; last: {last}"
        )


class ChatJudge:
    """Scores a completion by asking an LLM with a rubric; cached by content digest."""

    def __init__(self, endpoint: Endpoint, cache: VerdictCache | None = None) -> None:
        self.endpoint = endpoint
        self.settings = endpoint.settings
        self.cache = cache or VerdictCache()
        self.requests = 0  # verdicts asked for (not cached), for tests and the log
        self._count = threading.Lock()

    def score(self, completion: str, task: Mapping[str, Any]) -> VerifierResult:
        rubric: str = self.settings["rubric"]
        scale: str = self.settings.get("scale", "0-1")
        prompt = str(task.get("prompt", ""))
        reference = "" if task.get("answer") is None else str(task["answer"])
        key = content_hash(rubric, prompt, completion, reference, scale)
        cached = self.cache.get(key)
        if cached is not None:
            JUDGE_CACHE_HITS.inc()
            reward, rationale = cached
        else:
            low, high = SCALES[scale]
            message = fill_rubric(rubric, prompt, completion, reference)
            message += FORMAT_INSTRUCTION.format(low=f"{low:g}", high=f"{high:g}")

            def body(model: str) -> dict[str, Any]:
                return {
                    "model": model,
                    "messages": [{"role": "user", "content": message}],
                    "max_tokens": int(self.settings.get("max_tokens", 512)),
                    "temperature": float(self.settings.get("temperature", 0.0)),
                }

            def parse(answer: Any) -> tuple[float, str]:
                return parse_score(str(answer["choices"][0]["message"]["content"]), scale)

            with self._count:
                self.requests += 1
            reward, rationale = self.endpoint.request("/chat/completions", body, parse)
            self.cache.put(key, (reward, rationale))
        details: dict[str, Any] = {
            "judge": self.endpoint.name,
            "score": reward,
            "rationale": rationale[-RATIONALE_CHARS:],
            "cached": cached is not None,
        }
        from posttrain.sandboxes.verifiers import VerifierResult, verify

        rule = self.settings.get("rule_check")
        if rule and reference:
            details["rule_check"] = rule
            details["rule_passed"] = bool(verify(rule, completion, task).passed)
        threshold = float(self.settings.get("pass_threshold", 0.5))
        return VerifierResult(reward=reward, passed=reward >= threshold, details=details)


class RewardModelScorer:
    """Scores (prompt, completion) conversations with a served sequence-classification
    model; concurrent scorings are gathered into batches of ``batch_size``."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.batch_size = int(endpoint.settings.get("batch_size", 16))
        self.threshold = float(endpoint.settings.get("pass_threshold", 0.5))
        self.batches: list[int] = []  # sizes of the batches sent, for tests and the log
        self._pending: list[tuple[list[dict[str, str]], Future[float]]] = []
        self._lock = threading.Lock()

    def score(self, completion: str, task: Mapping[str, Any]) -> VerifierResult:
        conversation = [
            {"role": "user", "content": str(task.get("prompt", ""))},
            {"role": "assistant", "content": completion},
        ]
        future: Future[float] = Future()
        with self._lock:
            self._pending.append((conversation, future))
            leader = len(self._pending) == 1
        if leader:  # the first one waits a moment for others, then sends until none is left
            time.sleep(BATCH_WAIT_S)
            while True:
                with self._lock:
                    batch = self._pending[: self.batch_size]
                    del self._pending[: self.batch_size]
                if not batch:
                    break
                self._send(batch)
        from posttrain.sandboxes.verifiers import VerifierResult

        logit = future.result()
        reward = 1.0 / (1.0 + math.exp(-logit))
        details = {"reward_model": self.endpoint.name, "logit": logit}
        return VerifierResult(reward=reward, passed=reward >= self.threshold, details=details)

    def _send(self, batch: list[tuple[list[dict[str, str]], Future[float]]]) -> None:
        conversations = [c for c, _ in batch]

        def body(model: str) -> dict[str, Any]:
            return {"model": model, "input": conversations}

        def parse(answer: Any) -> list[float]:
            data = sorted(answer["data"], key=lambda d: int(d["index"]))
            scores = [float(d["score"]) for d in data]
            if len(scores) != len(conversations) or not all(map(math.isfinite, scores)):
                raise ValueError(f"expected {len(conversations)} finite scores, got {scores}")
            return scores

        self.batches.append(len(batch))
        try:
            scores = self.endpoint.request("/rewards", body, parse)
        except ScoringUnavailable as exc:
            for _, future in batch:
                future.set_exception(exc)
            return
        for (_, future), value in zip(batch, scores, strict=True):
            future.set_result(value)


class ModelScorers:
    """The run's judges and reward models, one per distinct endpoint setting, built on
    first use (a run without them opens no connection)."""

    def __init__(self, discover: Callable[[str], list[str]] | None = None) -> None:
        self._discover = discover
        self._scorers: dict[str, ChatJudge | RewardModelScorer] = {}
        self._lock = threading.Lock()

    def scorer(self, kind: str, config: Mapping[str, Any]) -> ChatJudge | RewardModelScorer:
        settings = config.get("endpoint")
        if not isinstance(settings, Mapping):
            raise ScorerConfigError(
                f"verifier kind {kind} needs its endpoint: set verifier.judge (kind judge) or "
                "verifier.rewardModel (kind reward_model) on the domain"
            )
        key = json.dumps([kind, settings], sort_keys=True)
        with self._lock:
            if key not in self._scorers:
                endpoint = Endpoint(kind, settings, discover=self._discover)
                self._scorers[key] = (
                    ChatJudge(endpoint) if kind == "judge" else RewardModelScorer(endpoint)
                )
            return self._scorers[key]

    def verify(
        self, kind: str, completion: str, task: Mapping[str, Any], config: Mapping[str, Any]
    ) -> VerifierResult:
        """Score one sample; ScoringUnavailable when the model could not (masked)."""
        try:
            return self.scorer(kind, config).score(completion, task)
        except ScoringUnavailable:
            SCORER_MASKED.labels(kind).inc()
            raise

    @staticmethod
    def concurrency(configs: Sequence[tuple[str | None, Mapping[str, Any]]]) -> int:
        """Threads worth scoring with at once: the largest of the endpoints' maxConcurrency
        and reward-model batch sizes (so a batch can fill)."""
        sizes = [1]
        for kind, config in configs:
            settings = config.get("endpoint")
            if kind in MODEL_KINDS and isinstance(settings, Mapping):
                sizes.append(int(settings.get("max_concurrency", 8)))
                sizes.append(int(settings.get("batch_size", 1)))
        return max(sizes)


def _pool_replicas(pool: str) -> list[str]:
    """Ready replicas of a RolloutPool in the run's namespace (the trainer's Role may get it)."""
    from posttrain.api.env import RUN_NAMESPACE, TrainerEnv
    from posttrain.rollout.discovery import PoolDiscovery

    namespace = TrainerEnv.from_env().run_namespace
    if not namespace:
        raise ScorerConfigError(
            f"a judge or reward model on RolloutPool {pool} needs ${RUN_NAMESPACE} (the "
            "operator sets it); outside a cluster give the endpoint's url instead"
        )
    try:
        return PoolDiscovery(pool, namespace).ready_endpoints()
    except Exception as exc:  # the API briefly unreachable: a retryable failure
        raise ScoringUnavailable(f"reading RolloutPool {namespace}/{pool}: {exc}") from exc
