"""OpenTelemetry tracing and Prometheus metrics, set up once per process.

Spans are exported over OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (and the
``otlp`` extra is installed); otherwise they stay in process, where tests read
them through :func:`memory_exporter`. Trace context crosses HTTP hops with the
W3C ``traceparent`` header via :func:`inject_headers` / :func:`extract_context`.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry.sdk.trace import ReadableSpan

log = logging.getLogger(__name__)
_lock = threading.Lock()

# Long-running processes (the operator) finish a span per reconcile: keep only the newest.
MEMORY_SPAN_LIMIT = 10_000


class InMemorySpanExporter:
    """Keeps the newest ``limit`` finished spans in process (tests and debugging read them).

    Duck-typed to the SDK's ``SpanExporter`` so this module imports no SDK (and no psutil)
    until a span is actually recorded: ``posttrain --help`` and ``sandbox exec`` stay fast.
    """

    def __init__(self, limit: int = MEMORY_SPAN_LIMIT) -> None:
        self._spans: collections.deque[ReadableSpan] = collections.deque(maxlen=limit)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            self._spans.extend(spans)
        return SpanExportResult.SUCCESS

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        with self._lock:
            return tuple(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def shutdown(self) -> None:
        self.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_memory: InMemorySpanExporter | None = None
_short_lived = False


def setup_tracing(service_name: str = "posttrain") -> InMemorySpanExporter:
    """Install the global tracer provider once; returns the in-memory exporter."""
    global _memory
    with _lock:
        if _memory is not None:
            return _memory
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        _memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(_memory))  # type: ignore[arg-type]
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
                from opentelemetry.sdk.trace.export import BatchSpanProcessor

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
                log.info("exporting traces over OTLP to %s", endpoint)
            except ImportError:
                log.warning(
                    "OTEL_EXPORTER_OTLP_ENDPOINT=%s is set but the exporter is not installed; "
                    "install posttrain[otlp]",
                    endpoint,
                )
        trace.set_tracer_provider(provider)
        return _memory


def short_lived_process() -> None:
    """Mark this process as a one-shot command (``sandbox exec``): its spans are recorded
    only when they can leave the process (OTLP endpoint set), so it never loads the SDK
    for spans nobody could read."""
    global _short_lived
    _short_lived = True


@contextmanager
def timed(phases: MutableMapping[str, float], name: str) -> Iterator[None]:
    """Add the block's wall seconds to ``phases[name]`` (raised or not): the per-phase
    breakdowns of a weight publish and of a replica's load (docs/rollout.md, "Where a
    publish's time goes").

    >>> phases: dict[str, float] = {}
    >>> with timed(phases, "write"):
    ...     pass
    >>> list(phases), phases["write"] >= 0
    (['write'], True)
    """
    mark = time.monotonic()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.monotonic() - mark


class LazyTracer(trace.Tracer):
    """A tracer that installs the SDK on its first span, not at import time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tracer: trace.Tracer | None = None

    def _real(self) -> trace.Tracer:
        if self._tracer is None:
            if not _short_lived or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
                setup_tracing()
            self._tracer = trace.get_tracer(self._name)
        return self._tracer

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        return self._real().start_span(*args, **kwargs)

    def start_as_current_span(  # type: ignore[override]
        self, *args: Any, **kwargs: Any
    ) -> AbstractContextManager[trace.Span]:
        return self._real().start_as_current_span(*args, **kwargs)


def memory_exporter() -> InMemorySpanExporter:
    """The in-process exporter (tests read finished spans from it)."""
    return setup_tracing()


def get_tracer(name: str) -> trace.Tracer:
    """A tracer for ``name``; the SDK is set up when its first span starts."""
    return LazyTracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``headers`` plus the current trace context (``traceparent``)."""
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = dict(headers or {})
    inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, Any]) -> otel_context.Context:
    """The trace context carried by incoming HTTP headers."""
    from opentelemetry.propagate import extract

    return extract(dict(headers))


def start_metrics_server(port: int) -> None:
    """Expose this process's Prometheus metrics on ``:port/metrics`` (0 = disabled)."""
    if port:
        from prometheus_client import start_http_server

        try:
            start_http_server(port)
        except OSError as exc:
            # Metrics are not worth failing a run for: on a shared host (the dev node agent
            # runs pods as host processes) the port may be taken.
            # INFO: on the dev node agent every pod shares the host's ports, so the second
            # pod that asks for the same port always gets EADDRINUSE; nothing to act on.
            log.info("cannot serve Prometheus metrics on :%d (%s); continuing without", port, exc)
            return
        log.info("Prometheus metrics on :%d/metrics", port)
