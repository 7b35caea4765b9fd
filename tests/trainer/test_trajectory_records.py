"""Trajectory records carry token ids, behaviour log-probs and verifier details end to end.

Real path: completions sampled by a real rollout server process (tiny model, real SmolLM2
tokenizer), scored by the real numeric verifier, turned into records by the trainer's
prepare_batch/trajectory_record, written by storage's TrajectoryWriter (JSONL + zstd) and
read back by its reader, the spot-check export and the `posttrain storage spot-check` CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.api import TrainingRunSpec
from posttrain.cli import main
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.protocol import SamplingParams
from posttrain.storage.store import open_store
from posttrain.storage.trajectories import TrajectoryWriter, read_trajectories
from posttrain.trainer.algorithms.loss import loss_config
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
from posttrain.trainer.model.policy import chat_prompt_ids
from posttrain.trainer.observe.audit import (
    LOGPROB_DECIMALS,
    Auditor,
    trajectory_from_record,
    trajectory_record,
)
from posttrain.trainer.run.batch import prepare_batch, score_batch
from posttrain.trainer.run.server_process import LocalRolloutServer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_records_round_trip_with_tokens_logprobs_and_verifier(
    tiny_model: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    spec = TrainingRunSpec.model_validate(
        {
            "model": str(tiny_model),
            "algorithm": {
                "groupSize": 3,
                "promptsPerStep": 2,
                "maxNewTokens": 12,
                "dynamicSampling": False,
                "temperature": 1.0,
            },
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "numeric"},
                }
            ],
        }
    )
    algo = spec.algorithm
    tasks = [
        Task("arithmetic", "What is 2 + 2?", answer="4"),
        Task("arithmetic", "What is 3 + 5?", answer="8"),
    ]
    prompt_ids = [chat_prompt_ids(tokenizer, t.prompt) for t in tasks]
    with LocalRolloutServer(str(tiny_model), tmp_path / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=120, max_in_flight=2)
        try:
            completions = client.generate(
                prompt_ids,
                SamplingParams(
                    n=algo.group_size, max_tokens=algo.max_new_tokens, temperature=1.0, seed=7
                ),
            )
        finally:
            client.close()
    batch = RolloutBatch(RolloutRequest(1, tasks, prompt_ids, seed=7), completions, 0.0)
    scored = score_batch(batch, {"arithmetic": ("numeric", {})}, algo, max_concurrency=2)
    prepared = prepare_batch(
        batch,
        scored,
        algorithm="grpo",
        dynamic_sampling=False,
        loss_config=loss_config(algo),
        step=1,
    )

    store = open_store(str(tmp_path / "run"))
    with TrajectoryWriter(store, "trajectories", tmp_path / "spool", writer_id="rank0") as writer:
        for trajectory in prepared.trajectories:
            writer.append(trajectory_record(trajectory))
    records = list(read_trajectories(store, "trajectories"))

    assert len(records) == len(tasks) * algo.group_size
    flat = [c for group in completions for c in group]
    for record, sampled, task_index in zip(records, flat, [0, 0, 0, 1, 1, 1], strict=True):
        ids, logprobs = record["completion_token_ids"], record["completion_logprobs"]
        assert ids == sampled.token_ids and len(ids) >= 1
        assert len(logprobs) == len(ids)
        # exactly what the server sampled, rounded to LOGPROB_DECIMALS places
        for ours, theirs in zip(logprobs, sampled.logprobs, strict=True):
            assert ours <= 0.0 and abs(ours - theirs) <= 0.5 * 10**-LOGPROB_DECIMALS + 1e-12
        assert record["prompt_token_ids"] == prompt_ids[task_index]
        assert tokenizer.decode(ids, skip_special_tokens=True) == record["completion"]
        assert tokenizer.decode(record["prompt_token_ids"]).endswith("assistant\n")
        assert record["weight_version"] == 0 and record["domain"] == "arithmetic"
        assert record["finish_reason"] in {"stop", "length"}
        verifier = record["verifier"]
        assert verifier["kind"] == "numeric" and "hack_signals" not in verifier["details"]
        assert record["reward"] == pytest.approx(verifier["reward"] + verifier["overlong_penalty"])
        assert isinstance(record["advantage"], float)  # dynamic sampling off: every group kept
        # the auditor's view survives the round trip (what checkpoints store)
        assert trajectory_from_record(record) == prepared.trajectories[records.index(record)]
    # group-relative advantages: each group sums to ~0
    for g in range(len(tasks)):
        group = records[g * algo.group_size : (g + 1) * algo.group_size]
        assert sum(r["advantage"] for r in group) == pytest.approx(0.0, abs=1e-6)

    # spot-check readers: the trainer's own export and storage's CLI over the stored log
    auditor = Auditor(tmp_path / "out", spot_check_samples=2, seed=0)
    auditor.observe_batch(1, prepared.trajectories)
    markdown, jsonl = auditor.write_spot_checks()
    assert "**Verifier:** numeric, score" in markdown.read_text()
    exported = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert all(len(r["completion_logprobs"]) == len(r["completion_token_ids"]) for r in exported)
    assert (
        main(
            [
                "storage",
                "spot-check",
                str(tmp_path / "run"),
                "--n",
                "3",
                "--out",
                str(tmp_path / "spot.jsonl"),
            ]
        )
        == 0
    )
    spot = [json.loads(line) for line in (tmp_path / "spot.jsonl").read_text().splitlines()]
    assert len(spot) == 3 and all(r in records for r in spot)
    assert (
        main(
            [
                "storage",
                "spot-check",
                str(tmp_path / "run"),
                "--n",
                "2",
                "--out",
                str(tmp_path / "spot.md"),
            ]
        )
        == 0
    )
    assert "# Trajectory spot check" in (tmp_path / "spot.md").read_text()


def test_old_records_without_new_fields_still_load() -> None:
    """Checkpoints written before the token fields existed must still resume."""
    old = {
        "step": 1,
        "domain": "m",
        "task_id": "t",
        "prompt": "p",
        "completion": "c",
        "reward": 1.0,
        "passed": True,
        "weight_version": 0,
        "hack_signals": ["x"],
    }
    trajectory = trajectory_from_record(old)
    assert trajectory.hack_signals == ("x",) and trajectory.completion_token_ids == ()
    assert trajectory.advantage is None and trajectory.verifier == {}
