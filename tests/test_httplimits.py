"""The HTTP bounds every posttrain server shares (posttrain/httplimits.py), over real uvicorn
on loopback with raw sockets playing slow and oversized clients, on both HTTP stacks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from posttrain.httplimits import (
    BodyRefused,
    BoundedBody,
    HttpLimits,
    Receive,
    Scope,
    Send,
    read_body,
    uvicorn_options,
)

FAST = HttpLimits(max_body_bytes=1000, body_timeout_s=0.5, header_timeout_s=0.5)
STACKS = ["h11"] + (["httptools"] if importlib.util.find_spec("httptools") else [])


async def echo_length(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers {"bytes": N} for the body it read (through BoundedBody's replay)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    payload = json.dumps({"bytes": len(body)}).encode()
    length = str(len(payload)).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", length)]}
    )
    await send({"type": "http.response.body", "body": payload})


def render(status: int, message: str) -> dict[str, object]:
    return {"error": message, "status": status}


@contextlib.contextmanager
def serving(limits: HttpLimits, http: str, keep_alive_s: int = 5) -> Iterator[int]:
    """``echo_length`` behind BoundedBody on uvicorn with ``limits``; yields the port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = BoundedBody(echo_length, limits, render)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=keep_alive_s,
        **uvicorn_options(limits, http),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def send_and_read(port: int, data: bytes, limit_s: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` and read until the server closes; (what came back, seconds taken).
    Bounded: a server that never closes fails the test after ``limit_s``."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received, time.monotonic() - started


@pytest.mark.parametrize("http", STACKS)
def test_headers_that_never_finish_get_408_and_a_closed_connection(http: str) -> None:
    with serving(FAST, http) as port:
        answer, took = send_and_read(port, b"POST / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        silent, took_silent = send_and_read(port, b"")  # connects and says nothing
    assert answer.startswith(b"HTTP/1.1 408") and silent.startswith(b"HTTP/1.1 408")
    assert 0.4 < took < 3 and 0.4 < took_silent < 3


@pytest.mark.parametrize("http", STACKS)
def test_a_body_that_never_arrives_gets_408(http: str) -> None:
    request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789"
    with serving(FAST, http) as port:
        answer, took = send_and_read(port, request)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower()
    assert "body_timeout_s" in json.loads(body)["error"] and "10 bytes came" in body.decode()
    assert 0.4 < took < 3


@pytest.mark.parametrize("http", STACKS)
def test_bodies_over_the_limit_get_413_declared_or_streamed(http: str) -> None:
    declared = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
    chunked = (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"7d0\r\n" + b"x" * 2000 + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    with serving(FAST, http) as port:
        for request in (declared, chunked):
            answer, took = send_and_read(port, request)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), answer
            assert "limit of 1000 bytes (max_body_bytes)" in json.loads(body)["error"]
            assert took < 3  # refused at once, not after the body deadline


@pytest.mark.parametrize("http", STACKS)
def test_deadlines_leave_prompt_clients_and_idle_keep_alive_alone(http: str) -> None:
    request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    with serving(FAST, http) as port, socket.create_connection(("127.0.0.1", port), 5) as sock:
        for _ in range(2):
            sock.sendall(request)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"bytes": 3}')
            time.sleep(1.0)  # idle past the header deadline: keep-alive (5 s) governs it


def test_read_body_reports_a_client_that_left() -> None:
    async def gone() -> dict[str, object]:
        return {"type": "http.disconnect"}

    with pytest.raises(BodyRefused, match="disconnected") as refused:
        asyncio.run(read_body(gone, FAST))
    assert refused.value.status == 400


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        HttpLimits(body_timeout_s=0)
