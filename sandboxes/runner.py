"""A warm HTTP server that runs many sandboxed executions: ``POST /v1/exec``.

Why a server: the trainer verifies thousands of completions per step; a long-lived process
keeps the executor (resolved binaries, host bind list) and Python warm, so the per-execution
cost is the sandbox itself, and one fleet of runner pods can serve many trainers.

Why a plain ASGI application and not FastAPI: the route is one JSON object in, one out, and
its validation is :func:`~.protocol.validate_request` anyway. FastAPI (routing, dependency
solving, 5 native telemetry spans per request) on h11 cost ~0.5-0.6 ms more server CPU per
request than this application on httptools (``/health``: 0.65 vs 0.15-0.2 ms). uvicorn
still does the HTTP (with httptools and uvloop when they are installed).

Concurrency is a semaphore sized a little above the cores: a sandboxed program is CPU-bound,
so many more at once only stretch every wall clock toward its timeout, but exactly one per
core leaves a core idle while a finished execution's reply travels and the next request's
sandbox starts. Requests beyond that wait in a bounded queue; when the queue is full the
server answers 429 with ``Retry-After`` (back-pressure the client honours) instead of letting
latency grow without bound.

Bounded against its clients (#31): a request may only ask for less than the runner's
:class:`~.protocol.ExecLimits` (the ``serve`` flags), bodies are capped at 64 MiB and must
arrive within 30 s of their headers, headers within 10 s (:mod:`posttrain.httplimits`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import importlib.util
import io
import json
import logging
import os
import tarfile
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from posttrain.httplimits import BodyRefused, HttpLimits, read_body, uvicorn_options
from posttrain.telemetry import extract_context, get_tracer

from .executor import Executor, default_executor
from .protocol import ExecLimits, ExecRequest, SandboxError

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

QUEUE_DEPTH = Gauge(
    "posttrain_sandbox_runner_queue_depth", "Executions waiting for a free sandbox slot."
)
IN_FLIGHT = Gauge("posttrain_sandbox_runner_in_flight", "Executions running now.")
REJECTED = Counter(
    "posttrain_sandbox_runner_rejected_total", "Requests refused with 429 (queue full)."
)

# Requests carry source files and workspace tars; far beyond any sane one, refuse instead of
# buffering it all.
MAX_BODY_BYTES = 64 << 20
ROUTE_METHODS = {"/v1/exec": "POST", "/health": "GET", "/metrics": "GET"}
# Trace propagation headers (W3C) read from a request; nothing else is decoded.
TRACE_HEADERS = (b"traceparent", b"tracestate", b"baggage")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def default_concurrency(cores: int | None = None) -> int:
    """Executions at once: the cores plus one, so a core that finishes a program has the next
    one to run while the reply and the next request are in flight.

    >>> default_concurrency(2), default_concurrency(16)
    (3, 17)
    """
    return (cores or os.cpu_count() or 1) + 1


class ExecutionGate:
    """At most ``concurrency`` executions run; at most ``max_queue`` wait; the rest are
    refused at once. Single event loop, so plain counters are race-free."""

    def __init__(self, concurrency: int, max_queue: int) -> None:
        if concurrency < 1 or max_queue < 0:
            raise ValueError(
                f"concurrency must be >= 1 and max_queue >= 0, got {concurrency}, {max_queue}"
            )
        self.concurrency = concurrency
        self.max_queue = max_queue
        self.semaphore = asyncio.Semaphore(concurrency)
        self.waiting = 0
        self.running = 0

    def admit(self) -> bool:
        """Whether a new request may wait for a slot (False = answer 429)."""
        return self.running < self.concurrency or self.waiting < self.max_queue


class BadRequest(ValueError):
    """The request cannot be served as sent; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class WorkspaceOptions:
    """The optional workspace fields of ``POST /v1/exec`` (multi-step agent episodes):
    ``workspace_tar`` (base64 of a tar) seeds /workspace before ``files``; with
    ``capture_workspace`` the final /workspace comes back as base64 ``workspace_tar`` in the
    answer. The state lives with the caller (see ``sandboxes/snapshot.py``), so snapshots,
    rollback and replay work the same through the runner as with a local executor."""

    workspace_tar: bytes | None = None
    capture_workspace: bool = False

    @property
    def used(self) -> bool:
        return self.workspace_tar is not None or self.capture_workspace


def parse_workspace_options(data: dict[str, Any]) -> WorkspaceOptions:
    """Pop and check the workspace fields of a request body (ValueError names the problem).

    >>> parse_workspace_options({"command": ["true"], "capture_workspace": True})
    WorkspaceOptions(workspace_tar=None, capture_workspace=True)
    """
    encoded = data.pop("workspace_tar", None)
    capture = data.pop("capture_workspace", False)
    if not isinstance(capture, bool):
        raise ValueError(f"capture_workspace must be a boolean, got {capture!r}")
    if encoded is None:
        return WorkspaceOptions(None, capture)
    if not isinstance(encoded, str):
        raise ValueError(f"workspace_tar must be a base64 string, got {type(encoded).__name__}")
    try:
        state = base64.b64decode(encoded, validate=True)
        with tarfile.open(fileobj=io.BytesIO(state)):
            pass
    except (binascii.Error, tarfile.TarError) as exc:
        raise ValueError(f"workspace_tar is not a base64-encoded tar: {exc}") from None
    return WorkspaceOptions(state, capture)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or :class:`BadRequest` (400): not JSON, not an object, or
    nested deeper than Python's parser goes (it raises RecursionError past ~1000 levels).

    >>> try:
    ...     parse_json_object(b"[" * 100_000 + b"]" * 100_000)
    ... except BadRequest as exc:
    ...     print(exc.status, str(exc)[:44])
    400 bad exec request: the body is not valid JSON
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(400, f"bad exec request: the body is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest(
            400, f"bad exec request: the body must be a JSON object, got {type(data).__name__}"
        )
    return data


def parse_exec_request(
    body: bytes, limits: ExecLimits | None = None
) -> tuple[ExecRequest, WorkspaceOptions]:
    """The JSON body of ``POST /v1/exec`` as a validated request and its workspace options,
    or :class:`BadRequest` naming what is wrong: 400 when the body is not a JSON object or
    asks for more than ``limits`` (this runner's policy) allow, 422 when a field is invalid
    for any runner (:func:`~.protocol.validate_request`)."""
    data = parse_json_object(body)
    try:
        options = parse_workspace_options(data)
        request = ExecRequest.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise BadRequest(422, f"bad exec request: {exc}") from exc
    over = (limits or ExecLimits()).violations(request)
    if over:
        raise BadRequest(400, "request over this runner's limits: " + "; ".join(over))
    return request, options


def parse_exec_body(body: bytes, limits: ExecLimits | None = None) -> ExecRequest:
    """The JSON body of ``POST /v1/exec`` (without workspace fields) as a validated request,
    or :class:`BadRequest` as :func:`parse_exec_request`.

    >>> parse_exec_body(b'{"command": ["true"], "timeout_s": 2}').timeout_s
    2
    >>> try:
    ...     parse_exec_body(b'{"command": "ls"}')
    ... except BadRequest as exc:
    ...     print(exc.status, exc)
    422 bad exec request: command must be a non-empty list of strings, got 'ls'
    >>> try:
    ...     parse_exec_body(b'{"command": ["true"], "max_processes": 1000000000}')
    ... except BadRequest as exc:
    ...     print(exc.status, str(exc)[:94])
    400 request over this runner's limits: max_processes=1000000000 is over this runner's limit of 256
    """
    request, options = parse_exec_request(body, limits)
    if options.used:
        raise BadRequest(422, "bad exec request: workspace fields need parse_exec_request")
    return request


class RunnerApp:
    """The runner as a plain ASGI application: ``POST /v1/exec``, ``GET /health``,
    ``GET /metrics``. Every answer is JSON except the Prometheus text."""

    def __init__(
        self,
        executor: Executor | None,
        concurrency: int,
        max_queue: int,
        exec_limits: ExecLimits | None = None,
        http: HttpLimits | None = None,
    ) -> None:
        self.executor = executor
        self.limits = (concurrency, max_queue)
        self.exec_limits = exec_limits or ExecLimits()
        self.http = http or runner_http_limits()
        self._gate: ExecutionGate | None = None

    @property
    def gate(self) -> ExecutionGate:
        # Created lazily inside the serving event loop (asyncio primitives bind to it).
        if self._gate is None:
            self._gate = ExecutionGate(*self.limits)
        return self._gate

    def get_executor(self) -> Executor:
        if self.executor is None:
            self.executor = default_executor()
        return self.executor

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # websockets: nothing served, uvicorn closes the connection
        route = (scope["method"], scope["path"])
        if route == ("POST", "/v1/exec"):
            status, payload, headers = await self.execute(scope, receive)
            await _send_json(send, status, payload, headers)
        elif route == ("GET", "/health"):
            gate = self.gate
            await _send_json(
                send,
                200,
                {
                    "status": "ok",
                    "running": gate.running,
                    "queued": gate.waiting,
                    "concurrency": gate.concurrency,
                    "max_queue": gate.max_queue,
                },
            )
        elif route == ("GET", "/metrics"):
            await _send(send, 200, generate_latest(), CONTENT_TYPE_LATEST.encode())
        elif scope["path"] in ROUTE_METHODS:
            allowed = ROUTE_METHODS[scope["path"]]
            await _send_json(
                send,
                405,
                {"error": f"{scope['method']} is not allowed on {scope['path']}; use {allowed}"},
                [(b"allow", allowed.encode())],
            )
        else:
            await _send_json(
                send,
                404,
                {
                    "error": f"no route {scope['path']!r}; the runner "
                    "serves POST /v1/exec, GET /health, "
                    "GET /metrics"
                },
            )

    async def execute(
        self, scope: Scope, receive: Receive
    ) -> tuple[int, dict[str, Any], list[tuple[bytes, bytes]]]:
        """Serve one ``POST /v1/exec``: (status, JSON payload, extra headers)."""
        try:
            body = await read_body(receive, self.http, scope)
        except BodyRefused as exc:
            # Close: the unread rest of the body must not be parsed as the next request.
            return exc.status, {"error": exc.message}, [(b"connection", b"close")]
        try:
            request, workspace = parse_exec_request(body, self.exec_limits)
        except BadRequest as exc:
            return exc.status, {"error": str(exc)}, []
        gate = self.gate
        if not gate.admit():
            REJECTED.inc()
            return (
                429,
                {
                    "error": f"queue full ({gate.waiting} waiting, {gate.running} "
                    "running); retry later"
                },
                [(b"retry-after", b"1")],
            )
        carrier = {
            name.decode(): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in TRACE_HEADERS
        }
        parent = extract_context(carrier) if carrier else None
        with tracer.start_as_current_span("sandbox.runner.exec", context=parent) as span:
            gate.waiting += 1
            QUEUE_DEPTH.set(gate.waiting)
            try:
                await gate.semaphore.acquire()
            finally:
                gate.waiting -= 1
                QUEUE_DEPTH.set(gate.waiting)
            gate.running += 1
            IN_FLIGHT.set(gate.running)
            try:
                if workspace.used:  # a workspace tar in or out: the executor's blocking path
                    executor = self.get_executor()
                    result = await asyncio.to_thread(  # copies the context: spans nest
                        executor.run,
                        request,
                        workspace_tar=workspace.workspace_tar,
                        capture_workspace=workspace.capture_workspace,
                    )
                else:
                    # In the event loop, not a thread: no hand-off per execution, and the
                    # executor's span is a child of this one without context copying.
                    result = await self.get_executor().run_async(request)
            except SandboxError as exc:
                log.error("sandbox failure: %s", exc)
                return 500, {"error": f"sandbox failure: {exc}"}, []
            finally:
                gate.running -= 1
                IN_FLIGHT.set(gate.running)
                gate.semaphore.release()
            span.set_attribute("sandbox.status", result.status)
        payload = result.to_dict()
        if workspace.capture_workspace and result.workspace_tar is not None:
            payload["workspace_tar"] = base64.b64encode(result.workspace_tar).decode("ascii")
        return 200, payload, []


async def _send(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_json(
    send: Send,
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await _send(send, status, body, b"application/json", headers)


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to set up or tear down here (the executor's owner closes it); answering the
    protocol keeps uvicorn from logging that lifespan is unsupported."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def runner_http_limits() -> HttpLimits:
    """The runner's HTTP bounds: bodies up to :data:`MAX_BODY_BYTES` (files and workspace
    tars), the other bounds as every posttrain server."""
    return HttpLimits(max_body_bytes=MAX_BODY_BYTES)


def create_app(
    executor: Executor | None = None,
    concurrency: int | None = None,
    max_queue: int | None = None,
    exec_limits: ExecLimits | None = None,
    http: HttpLimits | None = None,
) -> RunnerApp:
    """The runner application; ``concurrency`` defaults to :func:`default_concurrency`,
    ``max_queue`` to 8 requests per slot, ``exec_limits`` to :class:`ExecLimits`' defaults."""
    concurrency = concurrency or default_concurrency()
    max_queue = 8 * concurrency if max_queue is None else max_queue
    return RunnerApp(executor, concurrency, max_queue, exec_limits, http)


def fastest_available(module: str, fallback: str) -> str:
    """``module`` if it is installed, else ``fallback`` (uvicorn's loop / http choices).

    >>> fastest_available("json", "h11"), fastest_available("no_such_module_here", "h11")
    ('json', 'h11')
    """
    return module if importlib.util.find_spec(module) is not None else fallback


def serve(
    host: str,
    port: int,
    concurrency: int | None,
    max_queue: int | None,
    exec_limits: ExecLimits | None = None,
) -> None:
    """Run the runner until interrupted (uvicorn, one process, one event loop)."""
    import uvicorn

    concurrency = concurrency or default_concurrency()
    # Built before binding the port so a missing bwrap fails fast. Two pre-started sandboxes
    # per slot: while executions run the pool refills only below one per slot (its reserve,
    # see WarmPool), so sequential requests never share a core with a refill.
    warm = 2 * concurrency
    executor = Executor(warm_pool=warm)
    try:
        app = create_app(executor, concurrency, max_queue, exec_limits)
        loop = fastest_available("uvloop", "asyncio")
        http = fastest_available("httptools", "h11")
        log.info(
            "sandbox runner on %s:%d (concurrency %d, queue %d, warm pool %d; %s, %s; %s)",
            host,
            port,
            *app.limits,
            warm,
            loop,
            http,
            app.exec_limits,
        )
        # Keep-alive well above the 5 s default: a trainer's verifier calls come in bursts
        # per step, and a reconnect per burst is pure overhead.
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            loop=loop,
            timeout_keep_alive=75,
            **uvicorn_options(app.http, http),
        )
    finally:
        executor.close()
