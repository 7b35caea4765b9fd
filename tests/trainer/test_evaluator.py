"""Evaluation off the training path: a separate evaluator scores committed checkpoints
while training goes on, and its numbers equal what inline evaluation measures."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from posttrain.api import TrainingRunSpec
from posttrain.rollout.client import RolloutClient
from posttrain.storage.store import open_store
from posttrain.trainer.data.rundata import build_run_data
from posttrain.trainer.evaluation.checkpoint_eval import CheckpointEvaluator, result_key
from posttrain.trainer.model.policy import chat_prompt_ids
from posttrain.trainer.run.loop import train as train_run
from posttrain.trainer.run.server_process import LocalRolloutServer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _spec(model: Path, storage: Path | None, inline: bool) -> TrainingRunSpec:
    checkpoint: dict[str, Any] = {"everySteps": 1, "keepLast": 3}
    if storage is not None:
        checkpoint["storageUri"] = str(storage)
    return TrainingRunSpec.model_validate(
        {
            "model": str(model),
            "algorithm": {
                "groupSize": 4,
                "promptsPerStep": 3,
                "maxSteps": 2,
                "learningRate": 1e-3,
                "maxNewTokens": 6,
                "microBatchSize": 4,
                "dynamicSampling": False,
                "seed": 3,
            },
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "numeric"},
                }
            ],
            "evaluation": {"everySteps": 1, "maxItemsPerDomain": 4, "inline": inline},
            "checkpoint": checkpoint,
        }
    )


def run_with_server(spec: TrainingRunSpec, out: Path) -> Any:
    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            return train_run(spec, out, client)
        finally:
            client.close()


def _evaluate_beside(spec: TrainingRunSpec, out: Path, train: Any) -> tuple[Any, list[int]]:
    """Run ``train()`` in this thread and the evaluator (own server) in another, at once."""
    store = open_store(spec.checkpoint.storage_uri)
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    trained = threading.Event()
    scored: list[int] = []
    errors: list[BaseException] = []

    def evaluate() -> None:
        try:
            with LocalRolloutServer(spec.model, out / "eval-server.log") as server:
                client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
                try:
                    evaluator = CheckpointEvaluator(
                        spec,
                        store,
                        build_run_data(spec),
                        client,
                        lambda p: chat_prompt_ids(tokenizer, p),
                        out / "evaluator",
                    )
                    scored.extend(evaluator.run(watch=True, poll_seconds=0.2, stop=trained.is_set))
                finally:
                    client.close()
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    thread = threading.Thread(target=evaluate, name="evaluator")
    thread.start()
    try:
        result = train()
    finally:
        trained.set()
        thread.join()
    if errors:
        raise errors[0]
    return result, scored


@pytest.mark.slow  # three rollout servers and two tiny runs
def test_separate_evaluator_scores_every_checkpoint_like_inline_eval(
    tiny_model: Path, tmp_path: Path
) -> None:
    inline = run_with_server(_spec(tiny_model, None, inline=True), tmp_path / "inline")
    assert inline.steps_done == 2

    spec = _spec(tiny_model, tmp_path / "store", inline=False)
    out = tmp_path / "separate"
    result, scored = _evaluate_beside(spec, out, lambda: run_with_server(spec, out))
    assert result.steps_done == 2 and result.base_eval is None  # the trainer did not evaluate
    assert not (out / "eval").exists()
    assert scored == [0, 1, 2]  # the base model, then every committed checkpoint

    store = open_store(str(tmp_path / "store"))
    for step in (0, 1, 2):
        separate = json.loads(store.get_bytes(result_key("heldout", step)))
        local = json.loads((out / "evaluator/eval" / f"heldout_step{step:04d}.json").read_text())
        assert local["accuracy"] == separate["accuracy"]
        # Same weights (seeded run), same greedy decoding, same verifiers: same answers.
        reference = json.loads(
            (tmp_path / "inline/eval" / f"heldout_step{step:04d}.json").read_text()
        )
        assert [i["completion"] for i in separate["items"]] == [
            i["completion"] for i in reference["items"]
        ], step
        assert separate["accuracy"] == reference["accuracy"], step


def test_a_restarted_evaluator_does_not_score_a_step_twice(tmp_path: Path) -> None:
    """Steps whose result is in the store are done; pending = base + the rest, ascending."""
    from posttrain.storage.checkpoints import CheckpointManager

    store = open_store(str(tmp_path / "store"))
    manager = CheckpointManager(store, "checkpoints", keep_last=5)
    for step in (1, 2, 3):
        local = tmp_path / f"ckpt{step}"
        local.mkdir()
        (local / "model.safetensors").write_bytes(b"x" * step)
        manager.save(step, local)
    store.put_bytes(result_key("heldout", 0), b"{}")
    store.put_bytes(result_key("heldout", 2), b"{}")
    spec = _spec(Path("unused"), tmp_path / "store", inline=False)
    evaluator = CheckpointEvaluator(spec, store, None, None, lambda p: [], tmp_path)  # type: ignore[arg-type]
    assert evaluator.done_steps() == {0, 2}
    assert evaluator.pending_steps() == [1, 3]
