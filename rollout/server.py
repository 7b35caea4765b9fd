"""OpenAI-compatible HTTP server over the CPU engine (the same contract vLLM serves).

The trainer talks to rollout servers only through this contract, so the same client works
against ``posttrain serve`` on a laptop and vLLM on GPUs. Beyond OpenAI we implement the
vLLM extension ``return_tokens_as_token_ids`` and posttrain's weight-sync endpoints
(``/v1/weights/load``, ``/v1/weights/version``); every completion reports the weight
version it was sampled with (body ``weight_version`` and the ``x-weight-version`` header).

The model loads in a background thread after the socket is open, so Kubernetes sees the
pod listening immediately while ``/health`` answers 503 until the model *and* the latest
published weights are in place (new replicas join at the latest version).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException

from posttrain.httplimits import BoundedBody, uvicorn_options
from posttrain.rollout.auth import WeightLoadDenied, check_weight_load
from posttrain.rollout.limits import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    WeightLoadRequest,
    check_limits,
    describe_validation_errors,
    error_body,
    normalize_prompts,
    sampling_params,
)
from posttrain.rollout.protocol import TOKEN_ID_PREFIX, WEIGHT_VERSION_HEADER, SamplingParams
from posttrain.rollout.reward_model import RewardRequest
from posttrain.telemetry import extract_context, get_tracer

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

REQUESTS = Counter(
    "posttrain_rollout_requests_total", "HTTP requests served", ["endpoint", "status"]
)
REQUEST_LATENCY = Histogram(
    "posttrain_rollout_request_latency_seconds",
    "End-to-end latency of completion requests",
    ["endpoint"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
CANCELLED_REQUESTS = Counter(
    "posttrain_rollout_cancelled_requests_total", "Requests cancelled by client disconnects"
)
DISCONNECT_POLL_S = 0.5
FASTAPI_PARSE_ERROR = "There was an error parsing the body"
UNPARSEABLE_BODY = (
    "the body could not be parsed as JSON (nested deeper than the parser allows?); "
    "send one JSON object"
)
WEIGHT_LOAD_SECONDS = Histogram(
    "posttrain_rollout_weight_load_seconds", "Fetch + swap time of /v1/weights/load"
)


@dataclass
class ServerConfig:
    """What ``posttrain serve`` was asked to do."""

    model: str
    served_model_name: str | None = None
    weights_uri: str | None = None
    poll_seconds: float = 0.0  # >0: an idle replica polls weights_uri for newer versions
    max_batch_size: int = 64
    num_threads: int | None = None
    reward_model: str | None = None  # also serve this sequence classifier at /v1/rewards
    limits: RequestLimits = field(default_factory=RequestLimits)
    """What one request may ask for, and the HTTP bounds (body size, read deadlines)."""
    weights_token: str | None = field(default=None, repr=False)
    """The pool's weight token: /v1/weights/load needs it (rollout/auth.py); None: open."""
    drain_seconds: float = 25.0
    """On SIGTERM (a scale-down, a rolling update) stop accepting connections and let
    in-flight requests finish for up to this long; the rest fail and the trainer's client
    retries them on another replica. Below a pod's default 30 s grace period; an idle
    replica exits at once."""


@dataclass
class ServerState:
    """Mutable state shared by the handlers and the loader thread."""

    config: ServerConfig
    engine: Any = None  # GenerationEngine once loaded (torch imported lazily)
    reward_model: Any = None  # rollout.reward_model.RewardModel, with --reward-model
    ready: threading.Event = field(default_factory=threading.Event)
    load_error: str | None = None
    weights_lock: threading.Lock = field(default_factory=threading.Lock)
    refused: dict[int, str] = field(default_factory=dict)  # versions that failed verification
    held: Any = None  # rollout.weights.HeldWeights: the served version's bytes (delta base)
    held_root: Any = None  # pathlib.Path: where downloads and held copies live

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.config.model


def load_engine(state: ServerState) -> None:
    """Resolve the model, start the engine, load the latest published weights; then ready."""
    from posttrain.models import resolve_model
    from posttrain.rollout import weights
    from posttrain.rollout.engine import GenerationEngine

    config = state.config
    try:
        model_dir = resolve_model(config.model)
        engine = GenerationEngine(
            model_dir, max_batch_size=config.max_batch_size, num_threads=config.num_threads
        )
        state.engine = engine
        if config.reward_model:
            from posttrain.rollout.reward_model import RewardModel

            state.reward_model = RewardModel(resolve_model(config.reward_model))
        if config.weights_uri:
            if not weights.committed_versions(config.weights_uri):
                log.info(
                    "no weights published under %s yet; serving the base model as v0",
                    config.weights_uri,
                )
            else:
                load_newest_verified(state, config.weights_uri)
        state.ready.set()
        log.info("ready: %s at weight version %d", state.model_name, engine.weight_version)
    except Exception as exc:
        state.load_error = f"{type(exc).__name__}: {exc}"
        log.exception("model load failed; /health stays 503")


def load_weights(state: ServerState, uri: str, version: int) -> dict[str, float]:
    """Fetch version ``version`` from ``uri`` and swap it in; returns seconds per phase, as
    the vLLM front door names them: ``fetch`` (download, digests, a delta's rebuild, the
    read), ``drain`` (waiting for the running batch to finish) and ``reload`` (the copy
    into the model), plus ``total``."""
    from posttrain.rollout import weights
    from posttrain.rollout.engine import read_safetensors_dir

    started = time.monotonic()
    with state.weights_lock, tracer.start_as_current_span("rollout.load_weights") as span:
        span.set_attribute("weights.uri", uri)
        span.set_attribute("weights.version", version)
        if state.held_root is None:
            # Not the bare temporary directory: a server killed with SIGKILL leaves its
            # copies behind (hundreds of MB each), and the next one removes them.
            state.held_root = weights.held_root(weights.scratch_dir())
        path, temporary = weights.fetch_version(uri, version, state.held_root, state.held)
        try:
            state_dict = read_safetensors_dir(path)
            fetched = time.monotonic()
            drain = state.engine.swap_weights(state_dict, version).result()
        except BaseException:
            if temporary:
                shutil.rmtree(path, ignore_errors=True)
            raise
        if temporary or weights.version_metadata(uri, version) is not None:
            # A registry version: keep its bytes as the base of the next delta.
            previous, state.held = (
                state.held,
                weights.hold(version, path, temporary, state.held_root),
            )
            if previous is not None and previous.directory != state.held.directory:
                shutil.rmtree(previous.directory, ignore_errors=True)
    elapsed = time.monotonic() - started
    WEIGHT_LOAD_SECONDS.observe(elapsed)
    log.info("loaded weights v%d from %s in %.2fs (waited %.2fs for the running batch)",
             version, uri, elapsed, drain)  # fmt: skip
    return {
        "fetch": fetched - started,
        "drain": drain,
        "reload": max(elapsed - (fetched - started) - drain, 0.0),
        "total": elapsed,
    }


def load_newest_verified(state: ServerState, uri: str) -> None:
    """Load the newest committed version above the served one that verifies (pull on join,
    and the poll). A version that fails its digest or misses files is refused once,
    remembered in ``state.refused`` (shown by ``/health``) and the next older one tried; at
    start-up with none verifying the base model stays, as v0, and the log says so."""
    from posttrain.rollout import weights

    starting = not state.ready.is_set()
    current = -1 if starting else state.engine.weight_version
    for version in weights.join_candidates(uri, current, set(state.refused)):
        try:
            load_weights(state, uri, version)
        except weights.unusable_version_errors() as exc:
            state.refused[version] = str(exc)
            log.error("refused weights v%d from %s: %s; trying the next older version",
                      version, uri, exc)  # fmt: skip
            continue
        if any(r > version for r in state.refused):
            log.warning("serving v%d, the newest weight version under %s that verifies "
                        "(refused %s)", version, uri, sorted(state.refused))  # fmt: skip
        return
    if starting and state.refused:
        log.error("no committed weight version under %s verifies (refused %s); serving the "
                  "base model as v0", uri, sorted(state.refused))  # fmt: skip


def poll_weights(state: ServerState, stop: threading.Event) -> None:
    """Pick up versions the trainer published without telling us (e.g. we were restarting)."""
    config = state.config

    while not stop.wait(config.poll_seconds):
        if not state.ready.is_set() or not config.weights_uri:
            continue
        try:
            load_newest_verified(state, config.weights_uri)
        except Exception:
            log.exception("polling %s for new weights failed; will retry", config.weights_uri)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI app; ``state`` is filled by :func:`load_engine` (possibly later).

    One router per concern, each built over the shared ``state``: status (health, metrics,
    models), weights, generation (completions, chat) and rewards.
    """
    app = FastAPI(title="posttrain rollout server")
    app.add_middleware(BoundedBody, limits=state.config.limits.http, render=error_body)
    _install_error_handlers(app)
    for router in (
        status_router(state),
        weights_router(state),
        generation_router(state),
        rewards_router(state),
    ):
        app.include_router(router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every refusal in the OpenAI error shape (routers cannot carry exception handlers)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI and vLLM answer malformed bodies with 400 and an error object, not 422.
        refused = describe_validation_errors(list(exc.errors()))
        return _error(refused.status, refused.message, refused.param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # FastAPI's own refusals (unknown route, unparseable body) in our error shape.
        message = str(exc.detail)
        if message == FASTAPI_PARSE_ERROR:  # its words for JSON Python cannot parse
            message = UNPARSEABLE_BODY
        return _error(exc.status_code, message)


def status_router(state: ServerState) -> APIRouter:
    """``/health`` (503 until the model and latest weights are in), ``/metrics``, ``/v1/models``."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if state.ready.is_set():
            body: dict[str, Any] = {"status": "ok", "weight_version": state.engine.weight_version}
            if state.refused:
                body["refused_versions"] = sorted(state.refused)
            return JSONResponse(body)
        detail = state.load_error or "loading model and latest weights"
        return JSONResponse({"status": "loading", "detail": detail}, status_code=503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "owned_by": "posttrain",
                    "root": state.config.model,
                    "max_model_len": state.engine.max_positions if state.engine else None,
                }
            ],
        }

    return router


def weights_router(state: ServerState) -> APIRouter:
    """``/v1/weights/version`` and ``/v1/weights/load`` (token-checked, rollout/auth.py)."""
    router = APIRouter()

    @router.get("/v1/weights/version")
    async def weight_version() -> Response:
        engine = _engine(state)
        return JSONResponse(
            {"weight_version": engine.weight_version},
            headers={WEIGHT_VERSION_HEADER: str(engine.weight_version)},
        )

    @router.post("/v1/weights/load")
    async def weights_load(body: WeightLoadRequest, request: Request) -> Response:
        return await _weights_load(state, body, request)

    return router


async def _weights_load(state: ServerState, body: WeightLoadRequest, request: Request) -> Response:
    try:
        check_weight_load(
            request.headers, body.uri, state.config.weights_token, state.config.weights_uri
        )
    except WeightLoadDenied as exc:
        REQUESTS.labels("weights_load", str(exc.status)).inc()
        return _error(exc.status, str(exc), "uri" if exc.status == 403 else None)
    _engine(state)
    with tracer.start_as_current_span(
        "rollout.weights_load", context=extract_context(request.headers)
    ):
        try:
            phases = await asyncio.to_thread(load_weights, state, body.uri, body.version)
        except Exception as exc:
            status = weight_load_status(exc)
            if status is None:
                raise
            REQUESTS.labels("weights_load", str(status)).inc()
            message = f"cannot load weights v{body.version} from {body.uri}: {exc}"
            return _error(status, message, "uri" if status < 500 else None)
    REQUESTS.labels("weights_load", "200").inc()
    return JSONResponse(
        {
            "weight_version": body.version,
            "load_seconds": phases.pop("total"),
            "phases": {k: round(v, 4) for k, v in phases.items()},
        },
        headers={WEIGHT_VERSION_HEADER: str(body.version)},
    )


def generation_router(state: ServerState) -> APIRouter:
    """``/v1/completions`` and ``/v1/chat/completions`` on the engine."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _completions(state, body, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await _chat_completions(state, body, request)

    return router


async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    started = time.monotonic()
    engine = _engine(state)
    if body.stream or body.echo:
        unsupported = "stream" if body.stream else "echo"
        raise ApiError(400, f"{unsupported} is not supported by posttrain serve", unsupported)
    prompts = normalize_prompts(body.prompt)
    check_limits(body, state.config.limits, len(prompts), engine.max_positions)
    token_prompts = [
        p if isinstance(p, list) else engine.tokenizer.encode(p, add_special_tokens=False)
        for p in prompts
    ]
    params = sampling_params(body)
    with tracer.start_as_current_span(
        "rollout.completions", context=extract_context(request.headers)
    ) as span:
        span.set_attribute("rollout.prompts", len(token_prompts))
        span.set_attribute("rollout.n", body.n)
        results = await _generate(engine, token_prompts, params, body.logprobs or 0, request)
    choices = [
        {
            "index": prompt_index * body.n + sample_index,
            "text": sample.text,
            "finish_reason": sample.finish_reason,
            "token_ids": sample.token_ids,
            "weight_version": sample.weight_version,
            "logprobs": (
                _completion_logprobs(engine, sample, body.return_tokens_as_token_ids)
                if body.logprobs is not None
                else None
            ),
        }
        for prompt_index, samples in enumerate(results)
        for sample_index, sample in enumerate(samples)
    ]
    version = min(c["weight_version"] for c in choices)
    payload = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(token_prompts, results, body.n),
        "weight_version": version,
    }
    REQUESTS.labels("completions", "200").inc()
    REQUEST_LATENCY.labels("completions").observe(time.monotonic() - started)
    return JSONResponse(payload, headers={WEIGHT_VERSION_HEADER: str(version)})


async def _chat_completions(state: ServerState, body: ChatRequest, request: Request) -> Response:
    started = time.monotonic()
    engine = _engine(state)
    if body.stream:
        raise ApiError(400, "stream is not supported by posttrain serve", "stream")
    check_limits(body, state.config.limits, 1, engine.max_positions)
    prompt_ids = _chat_prompt_ids(engine, body)
    params = sampling_params(body)
    top = body.top_logprobs if body.logprobs else 0
    with tracer.start_as_current_span(
        "rollout.chat_completions", context=extract_context(request.headers)
    ):
        (samples,) = await _generate(engine, [prompt_ids], params, top, request)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": sample.text},
            "finish_reason": sample.finish_reason,
            "token_ids": sample.token_ids,
            "weight_version": sample.weight_version,
            "logprobs": (
                _chat_logprobs(engine, sample, body.return_tokens_as_token_ids)
                if body.logprobs
                else None
            ),
        }
        for i, sample in enumerate(samples)
    ]
    version = min(c["weight_version"] for c in choices)
    payload = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "prompt_token_ids": prompt_ids,
        "usage": _usage([prompt_ids], [samples], body.n),
        "weight_version": version,
    }
    REQUESTS.labels("chat", "200").inc()
    REQUEST_LATENCY.labels("chat").observe(time.monotonic() - started)
    return JSONResponse(payload, headers={WEIGHT_VERSION_HEADER: str(version)})


def _chat_prompt_ids(engine: Any, body: ChatRequest) -> list[int]:
    """The messages through the model's chat template, as token ids (400 if they do not fit)."""
    try:
        prompt_ids = engine.tokenizer.apply_chat_template(
            body.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:
        message = f"messages do not fit the chat template: {exc}"
        raise ApiError(400, message, "messages") from exc
    if hasattr(prompt_ids, "input_ids"):
        prompt_ids = prompt_ids["input_ids"]
    return list(prompt_ids)


def rewards_router(state: ServerState) -> APIRouter:
    """``/v1/rewards``: the sequence classifier of ``--reward-model`` (404 without one)."""
    router = APIRouter()

    @router.post("/v1/rewards")
    async def rewards(body: RewardRequest) -> Response:
        started = time.monotonic()
        _engine(state)  # 503 while loading
        if state.reward_model is None:
            raise ApiError(404, "this server has no reward model; start it with --reward-model")
        try:
            scores = await asyncio.to_thread(state.reward_model.score, body.input)
        except Exception as exc:  # a message list the chat template refuses
            raise ApiError(400, f"input does not fit the chat template: {exc}", "input") from exc
        payload = {
            "object": "list",
            "model": state.config.reward_model,
            "data": [{"index": i, "score": s} for i, s in enumerate(scores)],
        }
        REQUESTS.labels("rewards", "200").inc()
        REQUEST_LATENCY.labels("rewards").observe(time.monotonic() - started)
        return JSONResponse(payload)

    return router


def _engine(state: ServerState) -> Any:
    if not state.ready.is_set():
        raise ApiError(503, state.load_error or "model is still loading; retry after /health")
    return state.engine


async def _generate(
    engine: Any,
    prompts: list[list[int]],
    params: SamplingParams,
    top_logprobs: int,
    request: Request,
) -> list[list[Any]]:
    """Submit every prompt and wait; cancel them in the engine if the client disconnects.

    Without this, a client that timed out and retried elsewhere would leave its abandoned
    request decoding here, and under load the retries compound.
    """
    try:
        futures = [engine.submit(p, params, top_logprobs=top_logprobs) for p in prompts]
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    gathered = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=DISCONNECT_POLL_S)
        if done:
            try:
                return list(gathered.result())
            except RuntimeError as exc:  # engine shutting down
                raise ApiError(503, str(exc)) from exc
        if await request.is_disconnected():
            for future in futures:
                future.cancel()
            gathered.cancel()
            # Mark the outcome as seen so asyncio does not log "exception never retrieved".
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
            CANCELLED_REQUESTS.inc()
            raise ApiError(499, "client disconnected; request cancelled")


def _token_str(engine: Any, token_id: int, as_ids: bool) -> str:
    return f"{TOKEN_ID_PREFIX}{token_id}" if as_ids else engine.tokenizer.decode([token_id])


def _completion_logprobs(engine: Any, sample: Any, as_ids: bool) -> dict[str, Any]:
    tokens = [_token_str(engine, t, as_ids) for t in sample.token_ids]
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += 0 if as_ids else len(token)
    top = None
    if sample.top_logprobs is not None:
        top = [
            {_token_str(engine, t, as_ids): lp for t, lp in step} for step in sample.top_logprobs
        ]
    return {
        "tokens": tokens,
        "token_logprobs": sample.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(engine: Any, sample: Any, as_ids: bool) -> dict[str, Any]:
    content = []
    for position, (token_id, logprob) in enumerate(
        zip(sample.token_ids, sample.logprobs, strict=True)
    ):
        token = _token_str(engine, token_id, as_ids)
        top = []
        if sample.top_logprobs is not None:
            top = [
                {"token": _token_str(engine, t, as_ids), "logprob": lp}
                for t, lp in sample.top_logprobs[position]
            ]
        content.append(
            {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": top}
        )
    return {"content": content}


def _usage(prompts: list[list[int]], results: list[list[Any]], n: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(s.token_ids) for samples in results for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def weight_load_status(exc: BaseException) -> int | None:
    """The status of a failed weight load (None: a bug, 500): as
    :func:`~posttrain.rollout.weights.load_failure_status`, and 400 for weights that do not
    fit this model (the engine's copy raises RuntimeError or KeyError on a shape or name
    mismatch).

    >>> weight_load_status(RuntimeError("size mismatch")), weight_load_status(TypeError())
    (400, None)
    """
    from posttrain.rollout import weights

    status = weights.load_failure_status(exc)
    if status is None and isinstance(exc, RuntimeError | KeyError):
        return 400
    return status


class ServerThread:
    """Run the server in this process on a background thread (tests, benchmarks, notebooks).

    ``posttrain serve`` uses :func:`run` instead; this exists so tests drive the real HTTP
    stack without subprocess start-up costs.
    """

    def __init__(self, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 0) -> None:
        import socket

        import uvicorn

        self.state = ServerState(config)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        options = uvicorn_options(config.limits.http)
        self._server = uvicorn.Server(
            uvicorn.Config(create_app(self.state), log_level="warning", lifespan="off", **options)
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._loader = threading.Thread(target=load_engine, args=(self.state,), daemon=True)

    def start(self, wait_ready_s: float = 300.0) -> ServerThread:
        self._thread.start()
        self._loader.start()
        if not self.state.ready.wait(wait_ready_s):
            raise TimeoutError(f"server not ready after {wait_ready_s}s: {self.state.load_error}")
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        if self.state.engine is not None:
            self.state.engine.close()
        self._sock.close()
        if self.state.held is not None:
            shutil.rmtree(self.state.held.directory, ignore_errors=True)


def run(config: ServerConfig, *, host: str, port: int) -> None:
    """Serve until interrupted (``posttrain serve``)."""
    import uvicorn

    state = ServerState(config)
    # Drain on SIGTERM: uvicorn closes the listener and idle connections at once, then
    # waits up to drain_seconds for in-flight requests (a removed replica's rollouts finish
    # instead of being sampled again elsewhere); engine.close() fails what is left.
    app = create_app(state)

    @contextlib.asynccontextmanager
    async def releasing(_: FastAPI) -> AsyncIterator[None]:
        # After the drain uvicorn re-raises SIGTERM, which ends the process before the
        # `finally` below runs: the app's shutdown (after the drain) releases what it holds.
        yield
        _release(state)

    app.router.lifespan_context = releasing
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            timeout_graceful_shutdown=max(1, round(config.drain_seconds)),
            **uvicorn_options(config.limits.http),
        )
    )

    def load_or_stop() -> None:
        # A model that cannot load never will: stop serving so the process exits non-zero
        # and the pod restarts visibly, instead of a replica that stays unready forever
        # with the reason only in /health.
        load_engine(state)
        if state.load_error is not None:
            log.error("stopping: model %r cannot be loaded", config.model)
            server.should_exit = True

    threading.Thread(target=load_or_stop, name="model-loader", daemon=True).start()
    stop_polling = threading.Event()
    if config.weights_uri and config.poll_seconds > 0:
        threading.Thread(
            target=poll_weights, args=(state, stop_polling), name="weights-poller", daemon=True
        ).start()
    try:
        server.run()
    finally:
        stop_polling.set()
        _release(state)
    if state.load_error is not None:
        raise ModelLoadError(f"could not load model {config.model!r}: {state.load_error}")


def _release(state: ServerState) -> None:
    """Stop the engine (unfinished requests fail) and delete the held weights: all of the
    held root, as ``posttrain serve`` runs one server per process."""
    if state.engine is not None:
        state.engine.close()
    if state.held_root is not None:
        shutil.rmtree(state.held_root, ignore_errors=True)


class ModelLoadError(RuntimeError):
    """The served model failed to load (``posttrain serve`` exits 1 with this message)."""


__all__ = ["ServerConfig", "ServerThread", "create_app", "run"]
