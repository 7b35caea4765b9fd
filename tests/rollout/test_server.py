"""The OpenAI-compatible HTTP contract, over real HTTP on loopback (uvicorn in a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from posttrain.rollout.server import ServerConfig, ServerState, ServerThread, create_app


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    thread = ServerThread(
        ServerConfig(model=str(tiny_model_dir), served_model_name="tiny", num_threads=1)
    ).start()
    yield thread
    thread.stop()


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_health_is_503_until_loaded(tiny_model_dir: Path) -> None:
    state = ServerState(ServerConfig(model=str(tiny_model_dir)))
    client = TestClient(create_app(state))
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json()["status"] == "loading"
    completion = client.post("/v1/completions", json={"prompt": "hi"})
    assert completion.status_code == 503
    assert "loading" in completion.json()["error"]["message"]


def test_health_models_and_version(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    version = http.get("/v1/weights/version")
    assert version.json() == {"weight_version": 0}
    assert version.headers["x-weight-version"] == "0"


@pytest.mark.parametrize(
    "prompt",
    ["Hello there", ["Hello there", "General"], [9906, 1476], [[9906, 1476], [3, 4, 5]]],
    ids=["string", "strings", "token-ids", "token-id-lists"],
)
def test_completion_prompt_forms(http: httpx.Client, prompt: object) -> None:
    response = http.post(
        "/v1/completions",
        json={"prompt": prompt, "n": 2, "max_tokens": 4, "seed": 1, "logprobs": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    expected_prompts = 2 if isinstance(prompt, list) and isinstance(prompt[0], str | list) else 1
    assert [c["index"] for c in body["choices"]] == list(range(2 * expected_prompts))
    assert body["weight_version"] == 0
    assert response.headers["x-weight-version"] == "0"
    assert body["usage"]["completion_tokens"] == 4 * 2 * expected_prompts
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 4
        assert choice["finish_reason"] == "length"


def test_tokens_as_ids_and_top_logprobs(http: httpx.Client) -> None:
    body = http.post(
        "/v1/completions",
        json={
            "prompt": [1, 2, 3],
            "max_tokens": 5,
            "logprobs": 3,
            "return_tokens_as_token_ids": True,
            "seed": 4,
        },
    ).json()
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert len(logprobs["top_logprobs"]) == 5
    for step, sampled in zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True):
        assert len(step) == 3
        assert all(key.startswith("token_id:") for key in step)
        assert max(step.values()) >= sampled - 1e-6  # the top-1 is at least the sampled one


def test_seeded_requests_are_reproducible_over_http(http: httpx.Client) -> None:
    body = {"prompt": "Once upon", "max_tokens": 8, "n": 2, "seed": 11, "temperature": 0.8}
    first = http.post("/v1/completions", json=body).json()
    second = http.post("/v1/completions", json=body).json()
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in second["choices"]]


def test_stop_string_over_http(http: httpx.Client) -> None:
    free = http.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 16, "temperature": 0}
    ).json()["choices"][0]
    stop = free["text"][6:9]
    stopped = http.post(
        "/v1/completions",
        json={"prompt": "abc", "max_tokens": 16, "temperature": 0, "stop": stop},
    ).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == free["text"][: free["text"].index(stop)]


def test_chat_completion(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi!"},
            ],
            "max_tokens": 6,
            "logprobs": True,
            "n": 2,
            "seed": 3,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 2
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) == 6
    # The prompt went through the SmolLM2 chat template (ChatML markers).
    assert body["prompt_token_ids"][0] == 1  # <|im_start|>
    assert body["weight_version"] == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "n": 0}, "n must be"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": [999999999]}, "out of range"),
        ({"prompt": "x", "stream": True}, "stream"),
        ({"n": 1}, "prompt"),
    ],
)
def test_bad_requests_are_400_with_reason(http: httpx.Client, body: dict, message: str) -> None:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_weight_load_over_http_with_inflight_request(
    tiny_model_dir: Path, tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    publish_weights(tmp_path, 1, 0.5)
    publish_weights(tmp_path, 2, 0.0)  # the original weights again
    thread = ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
    try:
        with httpx.Client(base_url=thread.url, timeout=120) as http:
            request = {"prompt": "Hello", "max_tokens": 10, "seed": 5}
            base = http.post("/v1/completions", json=request).json()["choices"][0]["token_ids"]
            long_result: dict = {}

            def long_request() -> None:
                long_result.update(
                    http.post(
                        "/v1/completions", json={"prompt": "x", "max_tokens": 200, "seed": 1}
                    ).json()
                )

            worker = threading.Thread(target=long_request)
            worker.start()
            deadline = time.monotonic() + 30
            while thread.state.engine.active_sequences == 0 and time.monotonic() < deadline:
                time.sleep(0.005)  # wait until the long request is decoding
            loaded = http.post("/v1/weights/load", json={"uri": str(tmp_path), "version": 1})
            worker.join()
            assert loaded.status_code == 200, loaded.text
            assert loaded.headers["x-weight-version"] == "1"
            assert long_result["weight_version"] == 0  # in-flight finished on the old weights
            assert len(long_result["choices"][0]["token_ids"]) == 200
            after = http.post("/v1/completions", json=request)
            assert after.json()["weight_version"] == 1
            assert after.headers["x-weight-version"] == "1"
            assert after.json()["choices"][0]["token_ids"] != base
            assert http.get("/v1/weights/version").json()["weight_version"] == 1
            # A version directory can also be given directly.
            direct = http.post(
                "/v1/weights/load", json={"uri": f"file://{tmp_path}/v00000002", "version": 2}
            )
            assert direct.status_code == 200
            restored = http.post("/v1/completions", json=request).json()
            assert restored["choices"][0]["token_ids"] == base
            missing = http.post("/v1/weights/load", json={"uri": str(tmp_path), "version": 9})
            assert missing.status_code == 400
            assert "v00000009" in missing.json()["error"]["message"]
    finally:
        thread.stop()


def test_new_replica_starts_at_latest_published_version(
    tiny_model_dir: Path, tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    publish_weights(tmp_path, 1, 0.1)
    publish_weights(tmp_path, 3, 0.2)
    (tmp_path / "v00000004").mkdir()  # an unfinished upload (no weights yet) is ignored
    thread = ServerThread(
        ServerConfig(model=str(tiny_model_dir), weights_uri=str(tmp_path), num_threads=1)
    ).start()
    try:
        health = httpx.get(f"{thread.url}/health").json()
        assert health["weight_version"] == 3
    finally:
        thread.stop()


def test_client_disconnect_cancels_the_request(server: ServerThread) -> None:
    engine = server.state.engine
    # Seeded: unseeded, the random tiny model sometimes samples EOS early and the request
    # finishes inside the timeout (a CI flake); with seed 0 it runs all 1500 tokens (~2.5 s
    # on one thread here), well past the client's 1 s.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 1500, "seed": 0},
            timeout=1.0,
        )
    deadline = time.monotonic() + 20
    while engine.active_sequences and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.active_sequences == 0, "abandoned request still decoding"
    # The server keeps serving normally afterwards.
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert ok.status_code == 200
