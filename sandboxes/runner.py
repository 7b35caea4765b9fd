"""A warm HTTP server that runs many sandboxed executions: ``POST /v1/exec``.

Why a server: the trainer verifies thousands of completions per step; a long-lived process
keeps the executor (resolved binaries, host bind list) and Python warm, so the per-execution
cost is the sandbox itself, and one fleet of runner pods can serve many trainers.

Concurrency is a semaphore sized to the cores: a sandboxed program is CPU-bound, and running
more at once only stretches every wall clock toward its timeout. Requests beyond that wait
in a bounded queue; when the queue is full the server answers 429 with ``Retry-After``
(back-pressure the client honours) instead of letting latency grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest

from posttrain.telemetry import extract_context, get_tracer

from .executor import ExecRequest, Executor, SandboxError, default_executor

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

QUEUE_DEPTH = Gauge(
    "posttrain_sandbox_runner_queue_depth", "Executions waiting for a free sandbox slot."
)
IN_FLIGHT = Gauge("posttrain_sandbox_runner_in_flight", "Executions running now.")
REJECTED = Counter(
    "posttrain_sandbox_runner_rejected_total", "Requests refused with 429 (queue full)."
)


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


def create_app(
    executor: Executor | None = None,
    concurrency: int | None = None,
    max_queue: int | None = None,
) -> FastAPI:
    """The runner application; ``concurrency`` defaults to the CPU count and ``max_queue``
    to 8 requests per slot."""
    concurrency = concurrency or os.cpu_count() or 1
    max_queue = 8 * concurrency if max_queue is None else max_queue

    app = FastAPI(title="posttrain sandbox runner")
    app.state.executor = executor
    app.state.gate = None
    app.state.limits = (concurrency, max_queue)

    def gate() -> ExecutionGate:
        # Created lazily inside the serving event loop (asyncio primitives bind to it).
        if app.state.gate is None:
            app.state.gate = ExecutionGate(*app.state.limits)
        return app.state.gate

    def get_executor() -> Executor:
        if app.state.executor is None:
            app.state.executor = default_executor()
        return app.state.executor

    @app.get("/health")
    async def health() -> dict[str, Any]:
        current = gate()
        return {"status": "ok", "running": current.running, "queued": current.waiting,
                "concurrency": current.concurrency, "max_queue": current.max_queue}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/exec")
    async def execute(http_request: Request) -> JSONResponse:
        try:
            body = await http_request.json()
            if not isinstance(body, dict):
                raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
            request = ExecRequest.from_dict(body)
        except (ValueError, TypeError) as exc:
            return JSONResponse({"error": f"bad exec request: {exc}"}, status_code=422)
        current = gate()
        if not current.admit():
            REJECTED.inc()
            return JSONResponse(
                {"error": f"queue full ({current.waiting} waiting, {current.running} running); "
                          "retry later"},
                status_code=429, headers={"Retry-After": "1"},
            )
        parent = extract_context(http_request.headers)
        with tracer.start_as_current_span("sandbox.runner.exec", context=parent) as span:
            current.waiting += 1
            QUEUE_DEPTH.set(current.waiting)
            try:
                await current.semaphore.acquire()
            finally:
                current.waiting -= 1
                QUEUE_DEPTH.set(current.waiting)
            current.running += 1
            IN_FLIGHT.set(current.running)
            try:
                # In the event loop, not a thread: no hand-off per execution, and the
                # executor's span is a child of this one without context copying.
                result = await get_executor().run_async(request)
            except SandboxError as exc:
                log.error("sandbox failure: %s", exc)
                return JSONResponse({"error": f"sandbox failure: {exc}"}, status_code=500)
            finally:
                current.running -= 1
                IN_FLIGHT.set(current.running)
                current.semaphore.release()
            span.set_attribute("sandbox.status", result.status)
        return JSONResponse(result.to_dict())

    return app


def serve(host: str, port: int, concurrency: int | None, max_queue: int | None) -> None:
    """Run the runner until interrupted (uvicorn, one process, one event loop)."""
    import uvicorn

    concurrency = concurrency or os.cpu_count() or 1
    # Built before binding the port so a missing bwrap fails fast; one pre-started sandbox
    # per slot keeps namespace setup off the request path.
    executor = Executor(warm_pool=concurrency)
    try:
        app = create_app(executor, concurrency, max_queue)
        limits = app.state.limits
        log.info("sandbox runner on %s:%d (concurrency %d, queue %d, warm pool %d)",
                 host, port, *limits, concurrency)
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        executor.close()
