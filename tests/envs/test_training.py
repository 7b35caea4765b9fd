"""Episodes in the trainer: rewards, group advantages, loss inputs, checkpoints, the loop."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.envs.training import EpisodeCompletion
from posttrain.trainer.algorithms.loss import LossConfig
from posttrain.trainer.checkpointing.checkpoint import batch_from_json, batch_to_json
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
from posttrain.trainer.run.batch import prepare_batch, score_batch

TASK = Task("shell", "make a.txt", "", extra={"verify": ["test -f a.txt"]})


def episode(reward: float, status: str = "done") -> EpisodeCompletion:
    # model 2 tokens, tool output 3 tokens, model 1 token
    return EpisodeCompletion(
        prompt_index=0,
        text="[model turn 1] ...",
        token_ids=[5, 6, 70, 71, 72, 7],
        logprobs=[-0.1, -0.2, 0.0, 0.0, 0.0, -0.3],
        finish_reason=status,
        weight_version=4,
        prompt_ids=[1, 2, 3],
        loss_mask=[1, 1, 0, 0, 0, 1],
        environment="terminal",
        status=status,
        reward=reward,
        passed=reward == 1.0,
        error="sandbox down" if status == "errored" else "",
        stats={"turns": 2, "tool_calls": 1, "valid_tool_calls": 1},
    )


def batch(completions: list[EpisodeCompletion]) -> RolloutBatch:
    return RolloutBatch(RolloutRequest(1, [TASK], [[9, 9]], seed=0), [completions], 1.0)


def test_group_advantages_mask_and_errored_episodes() -> None:
    sampled = batch([episode(1.0), episode(0.0), episode(0.0), episode(0.0, "errored")])
    algorithm = SimpleNamespace(max_new_tokens=8, overlong_buffer_tokens=0, overlong_penalty=0.0)
    scored = score_batch(
        sampled,
        {},
        algorithm,
        max_concurrency=1,
        verify=lambda *a: pytest.fail("episodes need no verifier"),
    )
    assert [s.verifier for s in scored[0]] == ["env:terminal"] * 4
    prepared = prepare_batch(
        sampled,
        scored,
        algorithm="dr_grpo",
        dynamic_sampling=True,
        loss_config=LossConfig(),
        step=1,
    )
    # The errored episode takes no part: 3 samples, advantages relative to the other three.
    assert [s.advantage for s in prepared.samples] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert all(s.loss_mask == [1, 1, 0, 0, 0, 1] for s in prepared.samples)
    assert all(s.prompt_ids == [1, 2, 3] for s in prepared.samples)  # the episode's prompt
    # token_mean over the policy's tokens only: 3 per episode
    assert prepared.samples[0].coefficient == pytest.approx(1 / 9)
    assert prepared.group_pass_rates == [pytest.approx(1 / 3)]
    assert prepared.domain_pass_rates == {"shell": pytest.approx(1 / 3)}
    assert [t.advantage is None for t in prepared.trajectories] == [False, False, False, True]
    all_errored = batch([episode(0.0, "errored"), episode(0.0, "errored")])
    nothing = prepare_batch(
        all_errored,
        score_batch(all_errored, {}, algorithm, max_concurrency=1),
        algorithm="grpo",
        dynamic_sampling=False,
        loss_config=LossConfig(),
        step=1,
    )
    assert nothing.samples == [] and nothing.group_pass_rates == [None]


def test_sampled_episodes_survive_a_checkpoint() -> None:
    sampled = batch([episode(1.0), episode(0.0, "truncated")])
    back = batch_from_json(json.loads(json.dumps(batch_to_json(sampled))))
    assert back.completions == sampled.completions
    assert isinstance(back.completions[0][0], EpisodeCompletion)


def train_locally(spec: Any, out: Path) -> int:
    """Run ``train`` against a local CPU rollout server of ``spec.model``; steps done."""
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.run.loop import train
    from posttrain.trainer.run.server_process import LocalRolloutServer

    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=600, max_in_flight=4)
        try:
            return train(spec, out, client).steps_done
        finally:
            client.close()


@pytest.mark.slow  # a real server process and two training steps on the tiny model
def test_training_loop_plays_bfcl_episodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    from posttrain.api import TrainingRunSpec
    from posttrain.trainer.observe.step_metrics import load_metrics

    spec = TrainingRunSpec.model_validate(
        {
            "model": str(tiny_model_dir),
            "algorithm": {
                "groupSize": 2,
                "promptsPerStep": 2,
                "maxSteps": 2,
                "learningRate": 1e-3,
                "maxNewTokens": 6,
                "microBatchSize": 2,
                "dynamicSampling": False,
                "seed": 1,
            },
            "domains": [
                {
                    "name": "tools",
                    "dataset": "builtin:bfcl_simple_python",
                    "verifier": {"kind": "bfcl_ast"},
                    "environment": {"kind": "function_calling", "maxTurns": 2},
                }
            ],
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 2, "keepLast": 1},
        }
    )
    out = tmp_path / "run"
    assert train_locally(spec, out) == 2
    metrics = load_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    # the policy's turns only: a random tiny model samples from a near-flat distribution
    assert all(m["entropy"] > 1.0 for m in metrics), [m["entropy"] for m in metrics]
    final = json.loads((out / "eval" / "heldout_step0002.json").read_text())
    agent: dict[str, Any] = final["agent"]["tools"]
    assert agent["episodes"] == 2 and 1 <= agent["mean_turns"] <= 2
    assert final["counts"] == {"tools": 2}
    assert set(agent) >= {"success_rate", "valid_tool_call_rate", "recovery_rate", "errored"}
    # A random tiny model writes no accepted call; a reply that did not decode got the
    # parse error back and a second turn (visible in the transcript).
    assert all(item["reward"] == 0.0 for item in final["items"])
    for item in final["items"]:
        if "could not be parsed" in item["completion"]:
            assert "[model turn 2]" in item["completion"]


@pytest.mark.slow  # a real server process and two training steps on the tiny model
def test_training_loop_plays_bfcl_multi_turn_episodes(tmp_path: Path) -> None:
    """BFCL multi-turn items through the loop: episodes on BFCL's executable backends are
    sampled, judged by BFCL's multi-turn checks, recorded and evaluated per environment.

    BFCL's multi-turn prompts (system prompt + the involved classes' function docs) are
    4.4k-9.6k tokens, so the run takes the three shortest items as JSONL task files (two to train, one held out) and a tiny
    model with 8k positions."""
    from posttrain.api import TrainingRunSpec
    from posttrain.envs import bfcl_multi_turn
    from posttrain.models import make_tiny_model
    from posttrain.storage.store import LocalStore
    from posttrain.storage.trajectories import read_trajectories
    from posttrain.trainer.observe.step_metrics import load_metrics

    model = make_tiny_model(tmp_path / "model", seed=0, max_positions=8192)
    shortest = sorted(
        bfcl_multi_turn.task_records(),
        key=lambda r: (len(r["involved_classes"]), len(json.dumps(r))),
    )[:3]
    tasks, held_out = tmp_path / "bfcl-mt.jsonl", tmp_path / "bfcl-mt-eval.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in shortest[:2]))
    held_out.write_text(json.dumps(shortest[2]) + "\n")
    spec = TrainingRunSpec.model_validate(
        {
            "model": str(model),
            "algorithm": {
                "groupSize": 2,
                "promptsPerStep": 2,
                "maxSteps": 2,
                "learningRate": 1e-3,
                "maxNewTokens": 6,
                "microBatchSize": 2,
                "dynamicSampling": False,
                "seed": 1,
            },
            "domains": [
                {  # no verifier: an environment domain is judged by its environment
                    "name": "bfcl-mt",
                    "dataset": str(tasks),
                    "evalDataset": str(held_out),
                    "environment": {
                        "kind": "bfcl_multi_turn",
                        "maxTurns": 2,
                        "maxContextTokens": 8000,
                    },
                }
            ],
            "curriculum": {"enabled": False},
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 2, "keepLast": 1},
        }
    )
    out = tmp_path / "run"
    assert train_locally(spec, out) == 2
    assert [m["step"] for m in load_metrics(out)] == [1, 2]
    records = list(read_trajectories(LocalStore(out), "trajectories"))
    assert len(records) == 2 * 2 * 2  # steps x prompts x group
    for record in records:
        assert record["verifier"]["kind"] == "env:bfcl_multi_turn", record["verifier"]
        assert record["verifier"]["details"]["status"] in {"done", "truncated"}, record
    final = json.loads((out / "eval" / "heldout_step0002.json").read_text())
    assert final["counts"] == {"bfcl-mt": 1}
    agent: dict[str, Any] = final["agent"]["bfcl-mt"]
    assert agent["episodes"] == 1 and agent["errored"] == 0 and 1 <= agent["mean_turns"] <= 2
    # A random tiny model makes no call BFCL accepts: its turns are judged and fail.
    assert all(item["reward"] == 0.0 for item in final["items"])


def test_terminal_environments_stay_within_the_runs_sandbox_ceilings() -> None:
    # A runner refuses requests over the run's policy, the setup command's included.
    from posttrain.envs.training import make_environment

    spec = SimpleNamespace(kind="terminal", max_turns=3, command_timeout_seconds=120.0)
    policy = SimpleNamespace(timeout_seconds=30.0, memory_mb=256)
    env = make_environment(spec, executor=object(), sandbox=policy)
    assert (env.command_timeout_s, env.setup_timeout_s, env.memory_mb) == (30.0, 30.0, 256)
    unbounded = make_environment(spec, executor=object())
    assert (unbounded.command_timeout_s, unbounded.setup_timeout_s) == (120.0, 60.0)
