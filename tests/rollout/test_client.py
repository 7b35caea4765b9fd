"""RolloutClient against real servers: balancing, retries across replicas, weights, tracing."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from posttrain.processes import free_port
from posttrain.rollout.client import RolloutClient, RolloutError
from posttrain.rollout.protocol import SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.telemetry import get_tracer, memory_exporter


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir: Path) -> Iterator[list[ServerThread]]:
    servers = [
        ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
        for _ in range(2)
    ]
    yield servers
    for server in servers:
        server.stop()


def served_requests(url: str) -> float:
    """posttrain_rollout_requests_total{endpoint="completions"} scraped from one server.

    In-process servers share one registry, so the tests that need per-replica counts use
    subprocess servers; this helper is for those.
    """
    text = httpx.get(f"{url}/metrics").text
    match = re.search(
        r'posttrain_rollout_requests_total\{endpoint="completions",status="200"\} (\S+)', text
    )
    return float(match.group(1)) if match else 0.0


def running_sequences(url: str) -> float:
    """posttrain_rollout_running_sequences scraped from one server (0 when unreachable)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    match = re.search(r"^posttrain_rollout_running_sequences (\S+)", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_generate_returns_n_completions_per_prompt_in_order(
    two_servers: list[ServerThread],
) -> None:
    token_prompts = [[1, 2, 3], [9906], [4, 5], [6, 7, 8, 9], [10]]
    with RolloutClient([s.url for s in two_servers]) as client:
        results = client.generate(token_prompts, SamplingParams(n=3, max_tokens=6, seed=2))
        again = client.generate(token_prompts, SamplingParams(n=3, max_tokens=6, seed=2))
    assert len(results) == len(token_prompts)
    for index, completions in enumerate(results):
        assert len(completions) == 3
        for completion in completions:
            assert completion.prompt_index == index
            assert len(completion.token_ids) == len(completion.logprobs) == 6
            assert completion.finish_reason == "length"
            assert completion.weight_version == 0
    # Seeded sampling is reproducible whichever replica served each prompt.
    assert [[c.token_ids for c in r] for r in results] == [[c.token_ids for c in r] for r in again]


def test_token_ids_round_trip_with_text(two_servers: list[ServerThread]) -> None:
    tokenizer = two_servers[0].state.engine.tokenizer
    with RolloutClient([two_servers[0].url]) as client:
        (completions,) = client.generate([[1, 2]], SamplingParams(max_tokens=8, temperature=0))
    assert tokenizer.decode(completions[0].token_ids, skip_special_tokens=True) == (
        completions[0].text
    )


@pytest.mark.slow
def test_balancing_and_failover_when_a_replica_dies(serve_process: type) -> None:
    replicas = [serve_process(), serve_process()]  # start both, then wait: parallel imports
    for replica in replicas:
        replica.wait_ready()
    retries_before = REGISTRY.get_sample_value("posttrain_rollout_client_retries_total") or 0
    prompts = [[i + 1, i + 2] for i in range(16)]
    params = SamplingParams(n=1, max_tokens=300, seed=0)
    results: list = []
    with RolloutClient([r.url for r in replicas], max_in_flight=4, max_retries=4) as client:
        warm = client.generate(prompts[:8], SamplingParams(max_tokens=2))
        assert len(warm) == 8
        counts = [served_requests(r.url) for r in replicas]
        assert all(c >= 2 for c in counts), f"load not balanced: {counts}"

        worker = threading.Thread(target=lambda: results.extend(client.generate(prompts, params)))
        worker.start()
        deadline = time.monotonic() + 60
        while running_sequences(replicas[0].url) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        replicas[0].kill()  # mid-batch: it holds in-flight requests right now
        worker.join(timeout=300)
        assert not worker.is_alive()
        assert client.health() == {replicas[0].url: False, replicas[1].url: True}
    retries = REGISTRY.get_sample_value("posttrain_rollout_client_retries_total") or 0
    assert retries > retries_before, "the killed replica's requests must have been retried"
    assert len(results) == len(prompts)
    for index, (completion,) in enumerate(results):
        assert completion.prompt_index == index
        assert len(completion.token_ids) == 300


def test_exhausted_retries_raise_with_endpoints_named() -> None:
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    with (
        RolloutClient([dead], max_retries=1, timeout_s=5) as client,
        pytest.raises(RolloutError, match=r"failed after 2 attempts.*127\.0\.0\.1:9"),
    ):
        client.generate([[1]], SamplingParams(max_tokens=1))


def test_back_pressure_bounds_in_flight(two_servers: list[ServerThread]) -> None:
    client = RolloutClient([two_servers[0].url], max_in_flight=2)
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, client._endpoints[0].in_flight)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        client.generate([[i + 1] for i in range(8)], SamplingParams(max_tokens=20))
    finally:
        stop.set()
        watcher.join()
        client.close()
    assert 1 <= peak <= 2


def test_load_weights_versions_and_failures(
    tiny_model_dir: Path, tmp_path: Path, publish_weights: Callable[[Path, int, float], Path]
) -> None:
    publish_weights(tmp_path, 1, 0.3)
    servers = [
        ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
        for _ in range(2)
    ]
    try:
        with RolloutClient([s.url for s in servers]) as client:
            before = client.generate([[1, 2]], SamplingParams(max_tokens=8, seed=1))
            started = time.monotonic()
            client.load_weights(str(tmp_path), 1)
            assert time.monotonic() - started < 60
            assert client.weight_versions() == {s.url: 1 for s in servers}
            after = client.generate([[1, 2]], SamplingParams(max_tokens=8, seed=1))
            assert after[0][0].weight_version == 1
            assert after[0][0].token_ids != before[0][0].token_ids
            with pytest.raises(RolloutError, match="v00000005"):
                client.load_weights(str(tmp_path), 5)
            assert client.weight_versions() == {s.url: 1 for s in servers}
    finally:
        for server in servers:
            server.stop()


def test_chat_and_trace_context_propagation(two_servers: list[ServerThread]) -> None:
    exporter = memory_exporter()
    exporter.clear()
    with RolloutClient([two_servers[0].url]) as client:
        with get_tracer("test").start_as_current_span("trainer.step") as parent:
            replies = client.chat(
                [{"role": "user", "content": "Say hi"}], SamplingParams(n=2, max_tokens=5, seed=0)
            )
            client.generate([[1, 2]], SamplingParams(max_tokens=2))
        trace_id = parent.get_span_context().trace_id
    assert len(replies) == 2
    assert all(len(r.token_ids) == len(r.logprobs) == 5 for r in replies)
    server_spans = [
        s for s in exporter.get_finished_spans()
        if s.name in {"rollout.chat_completions", "rollout.completions"}
    ]  # fmt: skip
    assert {s.name for s in server_spans} == {"rollout.chat_completions", "rollout.completions"}
    assert all(s.context.trace_id == trace_id for s in server_spans)


def test_weight_loads_reach_replicas_discovered_after_start(
    two_servers: list[ServerThread],
    tmp_path: Path,
    publish_weights: Callable[[Path, int, float], Path],
) -> None:
    """A client started on one replica publishes to every replica ``discover`` lists."""
    first, second = two_servers
    publish_weights(tmp_path, 7, 0.0)
    replicas = [first.url]
    with RolloutClient([first.url], discover=lambda: list(replicas)) as client:
        replicas.append(second.url)  # a replica became ready after the client started
        client.load_weights(str(tmp_path), 7)
        assert client.urls == [first.url, second.url]
        assert client.weight_versions() == {first.url: 7, second.url: 7}
        groups = client.generate([[1, 2]] * 4, SamplingParams(max_tokens=2, seed=3))
        assert {c.weight_version for g in groups for c in g} == {7}
        with pytest.raises(ValueError, match="at least one"):
            client.set_endpoints([])


def test_a_replica_leaving_during_a_load_does_not_fail_it_and_a_joiner_catches_up(
    two_servers: list[ServerThread],
    tmp_path: Path,
    publish_weights: Callable[[Path, int, float], Path],
) -> None:
    """Churn while publishing: a dead replica that left the ready set is skipped (it pulls
    on join), one still listed is waited for, and a joiner gets the last loaded version
    before it is sampled from."""
    first, second = two_servers
    publish_weights(tmp_path, 2, 0.0)
    publish_weights(tmp_path, 3, 0.0)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a replica that just crashed
    asked = {"n": 0}

    def discover() -> list[str]:
        asked["n"] += 1  # listed as ready at the load, gone from the pool after
        return [first.url, dead] if asked["n"] == 1 else [first.url]

    with RolloutClient([first.url], discover=discover, timeout_s=30) as client:
        client.load_weights(str(tmp_path), 2)
        assert client.urls == [first.url]
        assert client.loaded == (str(tmp_path), 2)
        # A replica still listed but refusing (the version is missing there) fails at once.
        with pytest.raises(RolloutError, match="v00000009"):
            client.load_weights(str(tmp_path), 9)
        assert client.weight_versions() == {first.url: 2}
        # The second replica joins while serving its start-up version (0): it is loaded to
        # v2 before it is used, so every sample reports v2.
        assert client.catch_up([first.url, second.url]) == [first.url, second.url]
        assert client.weight_versions() == {first.url: 2, second.url: 2}
        groups = client.generate([[1, 2]] * 4, SamplingParams(max_tokens=2, seed=3))
        assert {c.weight_version for g in groups for c in g} == {2}
        # A joiner that cannot load is left out until it can.
        assert client.catch_up([first.url, second.url, dead]) == [first.url, second.url]


def test_a_fixed_replica_that_restarts_during_a_load_is_waited_for(
    two_servers: list[ServerThread],
    tiny_model_dir: Path,
    tmp_path: Path,
    publish_weights: Callable[[Path, int, float], Path],
) -> None:
    """Fixed endpoints (a trainer pod's own sidecars, no pool to follow): a replica that is
    down when the load starts, as one its kubelet is restarting, is retried until it is
    back, and then serves the version; one that stays down fails the load naming it."""
    first, _ = two_servers
    publish_weights(tmp_path, 5, 0.0)
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    comes_back: list[ServerThread] = []

    def restart() -> None:
        time.sleep(3.0)
        config = ServerConfig(model=str(tiny_model_dir), num_threads=1)
        comes_back.append(ServerThread(config, port=port).start())

    restarter = threading.Thread(target=restart)
    with RolloutClient([first.url, late], timeout_s=30) as client:
        restarter.start()
        started = time.monotonic()
        client.load_weights(str(tmp_path), 5)
        assert time.monotonic() - started >= 3.0
        assert client.weight_versions() == {first.url: 5, late: 5}
    restarter.join()
    comes_back[0].stop()
    with RolloutClient([first.url, late], timeout_s=1) as client:
        client.rejoin_wait_s = 3.0
        with pytest.raises(RolloutError, match=rf"{late.replace('.', r'[.]')}.*ConnectError"):
            client.load_weights(str(tmp_path), 5)


def test_a_load_fails_when_a_listed_replica_stays_unreachable(
    two_servers: list[ServerThread],
    tmp_path: Path,
    publish_weights: Callable[[Path, int, float], Path],
) -> None:
    first, _ = two_servers
    publish_weights(tmp_path, 4, 0.0)
    dead = f"http://127.0.0.1:{free_port()}"
    with RolloutClient([first.url], discover=lambda: [first.url, dead], timeout_s=1) as client:
        client.rejoin_wait_s = 3.0  # how long the dead replica gets to answer or leave
        with pytest.raises(RolloutError, match=dead.replace(".", r"\.")):
            client.load_weights(str(tmp_path), 4)
