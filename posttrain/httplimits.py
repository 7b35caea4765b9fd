"""Bounds every posttrain HTTP server puts on its clients: body size, header and body read
time, open connections (#31).

Why more than uvicorn's settings: uvicorn 0.54 bounds the size of a header block (h11's
``h11_max_incomplete_event_size``, 16 KiB by default), idle keep-alive connections
(``timeout_keep_alive``) and connections plus running requests (``limit_concurrency``: 503
beyond), but it has no time limit on a request's headers or body. A client that sends its
headers a byte a minute, or a ``Content-Length`` and then nothing, holds its connection, and
for the body an application task, forever; a few hundred such clients starve a server. So
the header deadline is a subclass of uvicorn's protocol (:func:`bounded_protocol`), and the
body's size and deadline are enforced where the application reads it (:func:`read_body`, or
:class:`BoundedBody` in front of a framework that reads bodies itself).

Components import this leaf; it imports nothing of ours.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Written on the socket when a client's headers miss their deadline: there is no request to
# answer through the application yet, so the protocol writes the answer itself.
HEADER_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 44\r\n\r\n"
    b"request headers did not arrive in time; retry"
)


@dataclass(frozen=True)
class HttpLimits:
    """What one server accepts from a client, with the status a client gets beyond it."""

    max_body_bytes: int = 8 << 20
    """Largest request body, in bytes (413 beyond). 8 MiB: a completion request is a prompt of
    token ids and a few numbers (a 32k-token prompt is ~200 KiB of JSON), so this only stops a
    client that sends far more than any request needs."""
    body_timeout_s: float = 30.0
    """Seconds a client may take to send the whole body once its headers arrived (408
    beyond). A body of a few MiB takes milliseconds inside a cluster."""
    header_timeout_s: float = 10.0
    """Seconds from a connection's opening, or a request's first byte, to the end of that
    request's headers; beyond it the connection is closed after a 408. An idle keep-alive
    connection is governed by uvicorn's ``timeout_keep_alive`` instead."""
    max_connections: int = 1024
    """uvicorn's ``limit_concurrency``: open connections plus running requests beyond which
    new requests get 503, so a flood of sockets cannot exhaust file descriptors."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "body_timeout_s", "header_timeout_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


class BodyRefused(Exception):
    """The body cannot be read within the limits; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, or None when absent or not a number (chunked).

    >>> declared_length({"headers": [(b"content-length", b"12")]})
    12
    """
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def too_large(limits: HttpLimits, size: int) -> BodyRefused:
    return BodyRefused(
        413,
        f"a request body of at least {size} bytes is over this server's limit of "
        f"{limits.max_body_bytes} bytes (max_body_bytes); send a smaller request",
    )


async def read_body(receive: Receive, limits: HttpLimits, scope: Scope | None = None) -> bytes:
    """The whole request body, or :class:`BodyRefused`: 413 as soon as it (or its declared
    ``Content-Length``) passes ``max_body_bytes``, 408 when it has not all arrived within
    ``body_timeout_s``, 400 when the client went away first."""
    if scope is not None:
        declared = declared_length(scope)
        if declared is not None and declared > limits.max_body_bytes:
            raise too_large(limits, declared)
    chunks: list[bytes] = []
    size = 0
    try:
        # One deadline for the whole body (a timeout per receive would let a client trickle
        # a byte per interval forever); asyncio.timeout costs no task per call.
        async with asyncio.timeout(limits.body_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise BodyRefused(400, "the client disconnected before sending the whole body")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limits.max_body_bytes:
                    raise too_large(limits, size)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise BodyRefused(
            408,
            f"the request body did not arrive within {limits.body_timeout_s:g} s "
            f"(body_timeout_s; {size} bytes came); send the body with the headers",
        ) from None


def replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands over ``body`` (already read) once, then defers to ``receive``
    (which then reports the client's disconnect, as frameworks poll for)."""
    delivered = False

    async def receive_again() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive_again


async def send_json(
    send: Send, status: int, payload: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> None:
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BoundedBody:
    """ASGI middleware: reads each request's body under ``limits`` before the application
    sees it, and answers a refused one with ``render(status, message)`` as JSON (and closes
    the connection: the rest of an unread body must not be parsed as the next request).

    For frameworks that read the body themselves (FastAPI), where a timeout around their own
    reads cannot be placed; bodies are bounded, so reading them up front costs nothing."""

    def __init__(
        self,
        app: ASGIApp,
        limits: HttpLimits,
        render: Callable[[int, str], dict[str, Any]],
    ) -> None:
        self.app = app
        self.limits = limits
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(receive, self.limits, scope)
        except BodyRefused as exc:
            close = [(b"connection", b"close")]
            await send_json(send, exc.status, self.render(exc.status, exc.message), close)
            return
        await self.app(scope, replay(body, receive), send)


class HeaderDeadline(asyncio.Protocol):
    """Mixin for a uvicorn HTTP protocol: a request's headers must be complete within
    ``header_timeout_s`` of the connection opening or of the request's first byte, else the
    client gets a 408 and the connection closes. Relies on what uvicorn's h11 and httptools
    protocols share: ``cycle`` (the request being served, None before the first one),
    ``transport`` and ``loop``."""

    header_timeout_s: float = HttpLimits.header_timeout_s
    _header_timer: asyncio.TimerHandle | None = None
    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm_header_deadline()  # the first byte of a kept-alive connection's next request
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_response_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or bool(self.cycle.response_complete)

    def _arm_header_deadline(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.write(HEADER_TIMEOUT_RESPONSE)
            self.transport.close()


def bounded_protocol(http: str, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol ``http`` ("auto", "h11" or "httptools", as uvicorn's ``http``
    setting) with a :class:`HeaderDeadline`; pass the class as uvicorn's ``http``."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if http not in ("auto", "h11", "httptools"):
        raise ValueError(f"http must be 'auto', 'h11' or 'httptools', got {http!r}")
    base = import_from_string(HTTP_PROTOCOLS[http])
    name = f"{base.__name__}WithHeaderDeadline"
    return type(name, (HeaderDeadline, base), {"header_timeout_s": header_timeout_s})


def uvicorn_options(limits: HttpLimits, http: str = "auto") -> dict[str, Any]:
    """The ``uvicorn.Config`` keywords that apply ``limits`` (the body's are the app's job)."""
    return {
        "http": bounded_protocol(http, limits.header_timeout_s),
        "limit_concurrency": limits.max_connections,
    }
