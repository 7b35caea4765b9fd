"""What a rollout server refuses (#31): requests over its limits, loosely typed or non-finite
fields, oversized or unparseable bodies, weight loads it cannot serve, slow clients; on
``posttrain serve`` and on the vLLM front door, which share one contract.

Refusals happen before any generation, so most tests drive the apps in process against a
stand-in engine; the slow-client test runs the real server on loopback."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from posttrain.cli import main
from posttrain.httplimits import HttpLimits
from posttrain.rollout.limits import RequestLimits
from posttrain.rollout.server import ServerConfig, ServerState, ServerThread, create_app
from posttrain.rollout.vllm import VllmFrontDoor

CONTEXT = 2048  # the stand-in engine's context length
JSON = {"content-type": "application/json"}
SMALL_BODY = HttpLimits(max_body_bytes=4096)


def cpu_server(limits: RequestLimits | None = None) -> TestClient:
    """``posttrain serve``'s app, ready, over an engine that only knows its context length:
    every request below is refused before it would reach the engine."""
    state = ServerState(ServerConfig(model="stand-in", limits=limits or RequestLimits()))
    state.engine = SimpleNamespace(max_positions=CONTEXT, weight_version=0)
    state.ready.set()
    return TestClient(create_app(state))


def front_door(limits: RequestLimits | None = None) -> TestClient:
    """The vLLM front door, ready, in front of no vLLM at all (nothing refused gets there)."""
    door = VllmFrontDoor("http://127.0.0.1:9", None, "/tmp", limits, context_length=CONTEXT)
    door.ready = True
    return TestClient(door.create_app())


SERVERS = {"cpu": cpu_server, "vllm": front_door}

# (path, body as raw JSON, the refused field, words the message must contain)
REFUSED = [
    ("/v1/completions", b'{"prompt": [1], "n": 513}', "n", "at most 512 per request (max_n)"),
    ("/v1/completions", b'{"prompt": [[1], [2]], "n": 300}', "n", "for 2 prompt(s) asks for 600"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": 4096}', "max_tokens", "limit of 2048"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": "9"}', "max_tokens", "valid integer"),
    ("/v1/completions", b'{"prompt": [1], "n": true}', "n", "valid integer"),
    ("/v1/completions", b'{"prompt": [1], "n": 2.0}', "n", "valid integer"),
    ("/v1/completions", b'{"prompt": [1], "temperature": NaN}', "temperature", "finite"),
    ("/v1/completions", b'{"prompt": [1], "top_p": Infinity}', "top_p", "finite"),
    ("/v1/completions", b'{"prompt": [1], "temperature": -1}', "temperature", ">= 0"),
    ("/v1/completions", b'{"prompt": [1], "logprobs": 50}', "logprobs", "limit of 20"),
    ("/v1/completions", b'{"prompt": [1], "logprobs": -1}', "logprobs", "greater than or equal"),
    ("/v1/completions", b'{"prompt": []}', "prompt", "empty"),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9999}',
        "max_completion_tokens",
        "limit of 2048",
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}',
        "top_logprobs",
        "limit of 20",
    ),
]


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize(("path", "body", "field", "words"), REFUSED)
def test_client_mistakes_are_400_naming_field_and_limit(
    server: str, path: str, body: bytes, field: str, words: str
) -> None:
    response = SERVERS[server]().post(path, content=body, headers=JSON)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and words in error["message"], error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("server", SERVERS)
def test_the_limits_are_the_servers_configuration(server: str) -> None:
    client = SERVERS[server](RequestLimits(max_n=4, max_tokens=8, max_logprobs=2))
    for body, words in (
        ({"prompt": [1], "n": 5}, "at most 4"),
        ({"prompt": [1], "max_tokens": 9}, "limit of 8 tokens"),
        ({"prompt": [1], "logprobs": 3}, "limit of 2 top logprobs"),
    ):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400 and words in response.json()["error"]["message"]


@pytest.mark.parametrize("server", SERVERS)
def test_oversized_and_unparseable_bodies_are_4xx(server: str) -> None:
    client = SERVERS[server](RequestLimits(http=SMALL_BODY))
    huge = client.post("/v1/completions", json={"prompt": [1] * 5000})
    assert huge.status_code == 413
    assert "limit of 4096 bytes (max_body_bytes)" in huge.json()["error"]["message"]
    deep = cpu_server() if server == "cpu" else front_door()
    nested = deep.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=JSON)
    assert nested.status_code == 400 and "JSON" in nested.json()["error"]["message"]


@pytest.mark.parametrize("server", SERVERS)
def test_weight_loads_from_s3_without_an_endpoint_name_the_missing_setting(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POSTTRAIN_S3_ENDPOINT", raising=False)
    client = SERVERS[server]()
    load = client.post("/v1/weights/load", json={"uri": "s3://bucket/runs/a/weights", "version": 1})
    assert load.status_code == 503, load.text
    assert "POSTTRAIN_S3_ENDPOINT" in load.json()["error"]["message"]
    no_bucket = client.post("/v1/weights/load", json={"uri": "s3:///weights", "version": 1})
    assert no_bucket.status_code == 400 and no_bucket.json()["error"]["param"] == "uri"
    loose = client.post("/v1/weights/load", json={"uri": "/tmp/w", "version": "1"})
    assert loose.status_code == 400 and loose.json()["error"]["param"] == "version"


def test_front_door_load_refusal_says_what_it_still_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POSTTRAIN_S3_ENDPOINT", raising=False)
    load = front_door().post("/v1/weights/load", json={"uri": "s3://b/w", "version": 3})
    assert load.json()["weight_version"] == 0 and load.headers["x-weight-version"] == "0"


def test_serve_refuses_a_limit_that_is_not_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "unused", "--max-n", "0"]) == 2
    assert "max_n must be >= 1" in capsys.readouterr().err


def read_until_closed(port: int, request: bytes) -> tuple[bytes, float]:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


def test_slow_clients_are_cut_off(tiny_model_dir: Path) -> None:
    limits = RequestLimits(http=HttpLimits(body_timeout_s=0.5, header_timeout_s=0.5))
    config = ServerConfig(model=str(tiny_model_dir), num_threads=1, limits=limits)
    server = ServerThread(config).start()
    try:
        headers_only = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 50\r\n\r\n"
        answer, took = read_until_closed(server.port, headers_only + b'{"prompt"')
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and took < 3, answer
        error: dict[str, Any] = json.loads(body)["error"]
        assert "body_timeout_s" in error["message"] and error["code"] == 408
        answer, took = read_until_closed(server.port, b"POST /v1/completions HTTP/1.1\r\n")
        assert answer.startswith(b"HTTP/1.1 408") and took < 3, answer
    finally:
        server.stop()
