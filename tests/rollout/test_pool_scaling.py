"""A pool that scales under a running trainer, on real ``posttrain serve`` processes: a
replica that joins is brought to the trainer's version before it is sampled from, and used;
a replica removed by a scale-down (SIGTERM, as the kubelet sends it) loses no rollout: it
finishes what it is generating and refuses new connections, and the trainer's client takes
every remaining request elsewhere."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from posttrain.processes import wait_for
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.discovery import follow_pool
from posttrain.rollout.protocol import SamplingParams

from .test_client import running_sequences, served_requests

TOKENS = 300


def wait_generating(url: str, timeout_s: float = 120.0) -> None:
    """Until ``url`` is decoding at least one sequence (its request is in flight)."""
    deadline = time.monotonic() + timeout_s
    while running_sequences(url) == 0:
        assert time.monotonic() < deadline, f"{url} never started generating"
        time.sleep(0.01)


def test_sigterm_finishes_the_in_flight_request_then_refuses_new_ones(
    serve_process: type,
) -> None:
    replica = serve_process().wait_ready()
    answer: dict[str, Any] = {}

    def ask() -> None:
        body = {"prompt": [[1, 2, 3]], "max_tokens": TOKENS, "seed": 0, "logprobs": 0}
        answer["response"] = httpx.post(f"{replica.url}/v1/completions", json=body, timeout=300)

    worker = threading.Thread(target=ask)
    worker.start()
    wait_generating(replica.url)
    replica.process.send_signal(signal.SIGTERM)  # the kubelet, on a scale-down
    worker.join(timeout=300)
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == TOKENS  # finished, not cut short
    replica.process.wait(timeout=60)  # then it exits (uvicorn re-raises SIGTERM)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{replica.url}/health", timeout=5)


def test_scale_down_mid_rollout_loses_nothing(serve_process: type) -> None:
    replicas = [serve_process(), serve_process()]  # start both, then wait: parallel imports
    for replica in replicas:
        replica.wait_ready()
    prompts = [[i + 1, i + 2] for i in range(12)]
    results: list[Any] = []
    with RolloutClient([r.url for r in replicas], max_in_flight=4, max_retries=4) as client:
        worker = threading.Thread(
            target=lambda: results.extend(
                client.generate(prompts, SamplingParams(max_tokens=TOKENS, seed=1))
            )
        )
        worker.start()
        wait_generating(replicas[0].url)
        replicas[0].process.send_signal(signal.SIGTERM)  # removed while holding rollouts
        worker.join(timeout=600)
        assert not worker.is_alive()
    assert replicas[0].process.wait(timeout=60) is not None
    assert len(results) == len(prompts)
    for index, (completion,) in enumerate(results):
        assert completion.prompt_index == index
        assert len(completion.token_ids) == TOKENS


def test_a_joining_replica_is_caught_up_and_used_and_a_leaving_one_dropped(
    serve_process: type, tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    """The trainer's pool follower (``follow_pool``, fed here by a list standing in for the
    pool's status.replicaEndpoints) over real replicas: scale up, then down."""
    first, second = serve_process(), serve_process()
    first.wait_ready()
    second.wait_ready()
    publish_weights(tmp_path, 2, 0.0)
    ready = [first.url]  # status.replicaEndpoints as the operator writes it
    with RolloutClient([first.url], discover=lambda: list(ready), timeout_s=60) as client:
        client.load_weights(str(tmp_path), 2)
        stop = follow_pool(client, lambda: list(ready), interval_s=0.2)
        try:
            ready.append(second.url)  # scaled up: the new replica turned ready (at v0)
            wait_for(lambda: second.url in client.urls, timeout_s=60, what="joiner followed")
            assert client.weight_versions() == {first.url: 2, second.url: 2}
            groups = client.generate([[i + 1] for i in range(8)], SamplingParams(max_tokens=4))
            assert {c.weight_version for g in groups for c in g} == {2}
            assert served_requests(second.url) > 0  # the new replica takes a share at once
            ready.remove(second.url)  # scaled down: the pod is deleting, no longer listed
            wait_for(lambda: client.urls == [first.url], timeout_s=60, what="leaver dropped")
        finally:
            stop.set()
