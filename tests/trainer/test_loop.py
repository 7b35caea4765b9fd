"""The RL loop end to end on a tiny model, over real HTTP to a real rollout server process."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from posttrain.api import TrainingRunSpec
from posttrain.rollout.client import RolloutClient
from posttrain.trainer.observe.step_metrics import load_metrics
from posttrain.trainer.run.distributed import DistContext
from posttrain.trainer.run.loop import train
from posttrain.trainer.run.server_process import LocalRolloutServer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def tiny_spec(model: Path, **algorithm: Any) -> TrainingRunSpec:
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
                **algorithm,
            },
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "numeric"},
                },
                {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}},
            ],
            "curriculum": {"window": 4, "minDomainFraction": 0.3},
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 3},
            "checkpoint": {"everySteps": 1, "keepLast": 2},
            "audit": {"spotCheckSamples": 5},
        }
    )


def run_with_server(spec: TrainingRunSpec, out: Path, **kwargs: Any) -> Any:
    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            return train(spec, out, client, **kwargs)
        finally:
            client.close()


@pytest.mark.slow  # three server starts; ~2 min on an idle machine
def test_interrupted_run_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    """Stop after step 1, restart (new server process too): step 2 equals an unbroken run."""
    spec = tiny_spec(tiny_model)
    straight = run_with_server(spec, tmp_path / "straight")
    assert straight.steps_done == 2

    broken = tmp_path / "broken"
    first = run_with_server(spec, broken, stop_after_step=1)
    assert first.steps_done == 1
    resumed = run_with_server(spec, broken)
    assert resumed.steps_done == 2 and resumed.base_eval is None  # base eval not redone

    a, b = load_metrics(tmp_path / "straight"), load_metrics(broken)
    assert [m["step"] for m in b] == [1, 2]
    for key in ("reward_mean", "loss", "grad_norm", "response_length", "weight_version"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    assert b[1]["domain_rewards"] == a[1]["domain_rewards"]
    weights_a = load_file(tmp_path / "straight/checkpoints/latest/model.safetensors")
    weights_b = load_file(broken / "checkpoints/latest/model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=1e-6, atol=1e-7)

    # the outputs a person looks at are all there
    for rel in (
        "metrics.jsonl",
        "report.md",
        "status.json",
        "plots/reward_accuracy.png",
        "eval/heldout_step0000.json",
        "eval/heldout_step0002.json",
        "audit/spot_checks.md",
        "checkpoints/latest/config.json",
    ):
        assert (tmp_path / "straight" / rel).is_file(), rel
    status = json.loads((tmp_path / "straight/status.json").read_text())
    assert status["phase"] == "Succeeded" and status["step"] == 2
    assert set(status["evalAccuracy"]) == {"arithmetic", "code"}


@dataclass(frozen=True)
class RecordingDist(DistContext):
    """Rank 0 of a job, recording where it waits for the other ranks."""

    events: list[str] = field(default_factory=list)

    def barrier(self) -> None:
        self.events.append("barrier")


class RecordingClient:
    """The real client, recording weight publishes and sampling calls in order."""

    def __init__(self, inner: RolloutClient, events: list[str]) -> None:
        self.inner, self.events = inner, events

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.events.append("generate")
        return self.inner.generate(*args, **kwargs)

    def load_weights(self, uri: str, version: int) -> None:
        self.events.append(f"publish v{version}")
        self.inner.load_weights(uri, version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.slow
def test_resumed_run_waits_for_the_republished_weights_before_sampling(
    tiny_model: Path, tmp_path: Path
) -> None:
    """After a resume the rollout server serves the base model until rank 0 republishes;
    every rank must wait at a barrier after that publish, before any rank samples."""
    spec = tiny_spec(tiny_model)
    assert run_with_server(spec, tmp_path, stop_after_step=1).steps_done == 1
    dist = RecordingDist()
    with LocalRolloutServer(spec.model, tmp_path / "server2.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            result = train(spec, tmp_path, RecordingClient(client, dist.events), dist=dist)
        finally:
            client.close()
    assert result.steps_done == 2
    events = dist.events
    assert events[:3] == ["publish v1", "barrier", "generate"], events[:6]


@pytest.mark.slow
def test_bounded_staleness_prefetches_and_stays_within_lag(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = tiny_spec(tiny_model, maxPolicyLag=1, maxSteps=3)
    result = run_with_server(spec, tmp_path / "async")
    metrics = load_metrics(tmp_path / "async")
    assert result.steps_done == 3
    assert all(0 <= m["staleness"] <= 1 for m in metrics)
    # every applied step published a new version the server then sampled from
    assert metrics[-1]["weight_version"] == sum(m["applied"] for m in metrics)
    # the demand signal a pool autoscales on: time blocked on each batch (or on the replicas
    # finishing the next one before they take the weights), within the step; the first step
    # (a cold start: nothing sampled ahead) stays out of the window
    assert all(0 <= m["rollout_wait_seconds"] <= m["step_seconds"] for m in metrics)
    wait = json.loads((tmp_path / "async" / "status.json").read_text())["rolloutWait"]
    assert wait["steps"] == 2 and 0 <= wait["fraction"] <= 1
    assert wait["waitSeconds"] == pytest.approx(
        sum(m["rollout_wait_seconds"] for m in metrics[1:]), abs=0.01
    )
    assert wait["stepSeconds"] == pytest.approx(
        sum(m["step_seconds"] for m in metrics[1:]), abs=0.01
    )


@pytest.mark.slow  # two server starts on the tiny model
def test_ctrl_c_checkpoints_and_a_rerun_resumes_without_duplicate_records(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The first Ctrl-C (the `stop` event) lets the step in progress finish, checkpoints it
    (though no checkpoint was due) and marks status.json Interrupted; running again resumes
    from there, and records an earlier attempt wrote past that step are dropped."""
    import threading

    from posttrain.trainer.observe.status import (
        FanOutStatusReporter,
        LocalStatusReporter,
        RunStatus,
    )
    from posttrain.trainer.run.interrupt import INTERRUPTED, last_checkpoint

    spec = tiny_spec(tiny_model, maxSteps=3)
    spec.checkpoint.every_steps = 10  # none due before the end: only the interrupt saves one
    stop = threading.Event()

    class PressCtrlC:
        def report(self, status: RunStatus) -> None:
            if status.step >= 1:
                stop.set()

        def event(self, type_: str, reason: str, message: str) -> None:
            """Stage events go to the LocalStatusReporter beside it."""

    reporter = FanOutStatusReporter([LocalStatusReporter(tmp_path), PressCtrlC()])
    first = run_with_server(spec, tmp_path, reporter=reporter, stop=stop)
    assert first.interrupted and first.steps_done == 1  # pressed while step 1 reported
    assert last_checkpoint(spec, tmp_path) == (1, first.last_checkpoint)
    assert json.loads((tmp_path / "status.json").read_text())["phase"] == INTERRUPTED

    # An attempt that got further before it was killed left step 3 behind, uncheckpointed.
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps({**load_metrics(tmp_path)[-1], "step": 3}) + "\n")
    (tmp_path / "eval" / "heldout_step0003.json").write_text("{}")

    second = run_with_server(spec, tmp_path)
    assert not second.interrupted and second.steps_done == 3
    raw_steps = [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert raw_steps == [1, 2, 3]
    history = [
        json.loads(line)["step"]
        for line in (tmp_path / "eval" / "history.jsonl").read_text().splitlines()
    ]
    assert len(history) == len(set(history)), history
    assert json.loads((tmp_path / "eval" / "heldout_step0003.json").read_text())["step"] == 3
    assert json.loads((tmp_path / "status.json").read_text())["phase"] == "Succeeded"


@pytest.mark.slow  # two runs with a server each
def test_a_step_sampled_again_after_a_checkpoint_fallback_is_logged_once(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Step 2's trajectories were flushed but its checkpoint is damaged (as if the trainer died
    before the commit): the rerun falls back to step 1, samples step 2 again, and the log
    returns each step once, step 2 from the attempt the surviving weights were trained on."""
    from posttrain.storage.store import LocalStore
    from posttrain.storage.trajectories import ATTEMPT_FIELD, read_trajectories

    spec = tiny_spec(tiny_model)
    assert run_with_server(spec, tmp_path).steps_done == 2
    shard = tmp_path / "checkpoints/step-00000002/dcp/__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run_with_server(spec, tmp_path).steps_done == 2

    per_step = 3 * 4  # promptsPerStep x groupSize
    store = LocalStore(tmp_path)
    every = list(read_trajectories(store, "trajectories", superseded=True))
    assert sorted(r["step"] for r in every) == [1] * per_step + [2] * 2 * per_step
    records = list(read_trajectories(store, "trajectories"))
    assert sorted(r["step"] for r in records) == [1] * per_step + [2] * per_step
    first_attempt = min(r[ATTEMPT_FIELD] for r in every)
    assert all(r[ATTEMPT_FIELD] > first_attempt for r in records if r["step"] == 2)
