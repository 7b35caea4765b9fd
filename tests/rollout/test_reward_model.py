"""``POST /v1/rewards``: the sequence-classification scoring endpoint of ``posttrain serve
--reward-model``, over real HTTP on loopback with the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from posttrain.rollout.server import ServerConfig, ServerThread


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    thread = ServerThread(
        ServerConfig(model=str(tiny_model_dir), reward_model=str(tiny_model_dir), num_threads=1)
    ).start()
    yield thread
    thread.stop()


def conversation(answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": answer}]


def test_scores_are_one_logit_per_conversation_whatever_the_batch(server: ServerThread) -> None:
    answers = ["7", "It is seven, of course.", "9"]
    batch = httpx.post(
        f"{server.url}/v1/rewards",
        json={"model": "rm", "input": [conversation(a) for a in answers]},
        timeout=60,
    )
    assert batch.status_code == 200
    body = batch.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    alone = [
        httpx.post(
            f"{server.url}/v1/rewards", json={"input": [conversation(a)]}, timeout=60
        ).json()["data"][0]["score"]
        for a in answers
    ]
    assert [d["score"] for d in body["data"]] == pytest.approx(alone, abs=1e-5)
    assert len(set(alone)) == 3


def test_a_fresh_head_is_seeded_so_replicas_agree(
    server: ServerThread, tiny_model_dir: Path
) -> None:
    from posttrain.rollout.reward_model import RewardModel

    here = RewardModel(tiny_model_dir).score([conversation("7")])
    served = httpx.post(
        f"{server.url}/v1/rewards", json={"input": [conversation("7")]}, timeout=60
    ).json()["data"][0]["score"]
    assert here == pytest.approx([served], abs=1e-5)


def test_bad_requests(server: ServerThread, tiny_model_dir: Path) -> None:
    empty = httpx.post(f"{server.url}/v1/rewards", json={"input": []}, timeout=60)
    assert empty.status_code == 400
    plain = ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
    try:
        missing = httpx.post(f"{plain.url}/v1/rewards", json={"input": [conversation("7")]})
        assert missing.status_code == 404
        assert "--reward-model" in missing.json()["error"]["message"]
    finally:
        plain.stop()
