"""Only the pool's weight-token holder swaps a replica's weights, and only to versions under
the pool's registry (rollout/auth.py): both servers, and the real client against a real
server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from posttrain.api.env import WEIGHTS_TOKEN
from posttrain.rollout.client import RolloutClient, RolloutError
from posttrain.rollout.server import ServerConfig, ServerState, ServerThread, create_app
from posttrain.rollout.vllm import VllmFrontDoor

TOKEN = "pool-token-0123456789"
REGISTRY = "s3://posttrain/runs/ns/run-a/weights"


def cpu_server() -> TestClient:
    config = ServerConfig(model="stand-in", weights_uri=REGISTRY, weights_token=TOKEN)
    state = ServerState(config)
    state.engine = SimpleNamespace(max_positions=2048, weight_version=0)
    state.ready.set()
    return TestClient(create_app(state))


def front_door() -> TestClient:
    door = VllmFrontDoor("http://127.0.0.1:9", REGISTRY, "/tmp", weights_token=TOKEN)
    door.ready = True
    return TestClient(door.create_app())


SERVERS: dict[str, Callable[[], TestClient]] = {"cpu": cpu_server, "vllm": front_door}


@pytest.mark.parametrize("server", SERVERS)
def test_weight_loads_need_the_token_and_a_uri_under_the_registry(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POSTTRAIN_S3_ENDPOINT", raising=False)
    client = SERVERS[server]()
    own = {"uri": REGISTRY, "version": 14}
    anonymous = client.post("/v1/weights/load", json=own)
    assert anonymous.status_code == 401, anonymous.text
    assert "weight token" in anonymous.json()["error"]["message"]
    forged = client.post("/v1/weights/load", json=own, headers={"Authorization": "Bearer x"})
    assert forged.status_code == 403
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    other_run = client.post(
        "/v1/weights/load",
        json={"uri": "s3://posttrain/runs/ns/OTHER/weights", "version": 14},
        headers=bearer,
    )
    assert other_run.status_code == 403 and other_run.json()["error"]["param"] == "uri"
    local = client.post(
        "/v1/weights/load", json={"uri": "/tmp/evil", "version": 999}, headers=bearer
    )
    assert local.status_code == 403
    # The holder, with its own registry, gets past the checks to the fetch (here refused for
    # the missing S3 endpoint: nothing was loaded, and the reason is not authorisation).
    allowed = client.post("/v1/weights/load", json=own, headers=bearer)
    assert allowed.status_code == 503 and "POSTTRAIN_S3_ENDPOINT" in allowed.text
    assert client.get("/v1/weights/version").json()["weight_version"] == 0


def test_the_client_sends_its_pools_token_to_a_real_server(
    tiny_model_dir: Path,
    tmp_path: Path,
    publish_weights: Callable[[Path, int, float], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    publish_weights(tmp_path, 1, 0.5)
    config = ServerConfig(
        model=str(tiny_model_dir), num_threads=1, weights_uri=str(tmp_path), weights_token=TOKEN
    )
    thread = ServerThread(config).start()
    try:
        monkeypatch.delenv(WEIGHTS_TOKEN, raising=False)
        client = RolloutClient([thread.url], timeout_s=120)
        with pytest.raises(RolloutError, match="weight token"):
            client.load_weights(str(tmp_path), 1)
        client.close()
        monkeypatch.setenv(WEIGHTS_TOKEN, TOKEN)  # what the operator puts on trainer pods
        client = RolloutClient([thread.url], timeout_s=120)
        client.load_weights(str(tmp_path), 1)
        assert client.weight_versions() == {thread.url: 1}
        client.close()
    finally:
        thread.stop()


def test_docstring_examples_hold() -> None:
    import doctest

    from posttrain.rollout import auth

    result = doctest.testmod(auth)
    assert result.attempted > 0 and result.failed == 0
