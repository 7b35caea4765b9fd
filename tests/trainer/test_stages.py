"""SFT and DPO stages: losses against independent references, data checks, stage plans."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.api import TrainingRunSpec
from posttrain.errors import UsageError
from posttrain.trainer.algorithms.dpo import dpo_loss, sequence_logps
from posttrain.trainer.algorithms.sft import packed_batch, sft_loss_sum
from posttrain.trainer.data.stage_data import (
    EMPTY_COMPLETION,
    IDENTICAL_PAIR,
    PROMPT_TOO_LONG,
    PreferencePair,
    SftExample,
    builtin_records,
    load_stage_data,
)
from posttrain.trainer.run.pipeline import plan_stages, stage_batch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def random_examples(lengths: list[tuple[int, int]], seed: int = 0) -> list[SftExample]:
    g = torch.Generator().manual_seed(seed)
    return [
        SftExample(
            torch.randint(3, 1000, (p,), generator=g).tolist(),
            torch.randint(3, 1000, (c,), generator=g).tolist(),
            f"x:{i}",
        )
        for i, (p, c) in enumerate(lengths)
    ]


def independent_sft_loss(model: Any, examples: list[SftExample]) -> torch.Tensor:
    """Token-mean cross-entropy over completion tokens, one plain forward per example."""
    losses, tokens = [], 0
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        logits = model(input_ids=ids).logits[0]  # (T, V)
        start = len(e.prompt_ids) - 1  # position t predicts token t + 1
        losses.append(
            torch.nn.functional.cross_entropy(
                logits[start : start + len(e.completion_ids)],
                torch.tensor(e.completion_ids),
                reduction="sum",
            )
        )
        tokens += len(e.completion_ids)
    return torch.stack(losses).sum() / tokens


def grads(model: Any) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_sft_loss_equals_completion_only_cross_entropy(model: Any, packing: bool) -> None:
    examples = random_examples([(5, 3), (7, 4), (3, 6), (4, 2), (9, 5)])
    expected = independent_sft_loss(model, examples)
    expected.backward()
    expected_grads = grads(model)

    loss_sum, tokens = sft_loss_sum(model, examples, max_length=24, pad_id=2, packing=packing)
    assert tokens == 20
    loss = loss_sum / tokens
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    got = grads(model)
    assert got.keys() == expected_grads.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected_grads[name], rtol=1e-4, atol=1e-6)


def test_packing_really_packs_and_keeps_examples_apart(model: Any) -> None:
    examples = random_examples([(5, 3), (7, 4), (3, 6), (4, 2), (9, 5)])
    batch = packed_batch(examples, max_length=24, pad_id=2, packing=True)
    assert batch.input_ids.shape[0] == 3  # 8 + 11 | 9 + 6 | 14: five examples in three rows
    # positions restart per example: that is what keeps them apart
    assert batch.position_ids[0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    # The same rows with running positions (one long sequence) do see each other: the
    # comparison above is not vacuous.
    running = packed_batch(examples, max_length=24, pad_id=2, packing=True)
    running.position_ids = torch.arange(running.input_ids.shape[1]).expand_as(running.input_ids)
    from posttrain.trainer.algorithms.sft import completion_token_logprobs

    with torch.no_grad():
        apart = completion_token_logprobs(model, batch)
        mixed = completion_token_logprobs(model, running)
    first = len(examples[0].completion_ids)
    torch.testing.assert_close(apart[:first], mixed[:first])  # the first example sees only itself
    assert not torch.allclose(apart[first:], mixed[first:], atol=1e-4)


def random_pairs(n: int, seed: int = 0) -> list[PreferencePair]:
    g = torch.Generator().manual_seed(seed)

    def ids(k: int) -> list[int]:
        return torch.randint(3, 1000, (k,), generator=g).tolist()

    return [PreferencePair(ids(4 + i), ids(3 + i % 2), ids(5 - i % 3), f"p:{i}") for i in range(n)]


def test_sequence_logps_sum_completion_token_logprobs(model: Any) -> None:
    pairs = random_pairs(3)
    with torch.no_grad():
        chosen, rejected = sequence_logps(model, pairs, pad_id=2)
        for i, pair in enumerate(pairs):
            for answer, got in ((pair.chosen_ids, chosen[i]), (pair.rejected_ids, rejected[i])):
                ids = torch.tensor([pair.prompt_ids + answer])
                logp = torch.log_softmax(model(input_ids=ids).logits[0], -1)  # (T, V)
                start = len(pair.prompt_ids) - 1
                want = sum(float(logp[start + j, t]) for j, t in enumerate(answer))
                assert float(got) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_dpo_loss_reference_values() -> None:
    """Hand-computed: logits = (-1 + 3) - (-2 + 2) = 2, loss = -log sigmoid(0.5 * 2)."""
    terms = dpo_loss(
        torch.tensor([-1.0]),
        torch.tensor([-3.0]),
        torch.tensor([-2.0]),
        torch.tensor([-2.0]),
        beta=0.5,
    )
    assert float(terms.losses[0]) == pytest.approx(
        -torch.nn.functional.logsigmoid(torch.tensor(1.0)).item()
    )
    assert float(terms.chosen_rewards[0]) == pytest.approx(0.5)
    assert float(terms.rejected_rewards[0]) == pytest.approx(-0.5)


# --------------------------------------------------------------------------- data


def identity_prompt(text: str) -> list[int]:
    return [ord(c) for c in text]


def identity_completion(text: str) -> list[int]:
    return [ord(c) for c in text] + [2]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_bad_examples_are_skipped_counted_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_jsonl(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": "ok", "chosen": "yes", "rejected": "no"},
            {"prompt": "same", "chosen": "a", "rejected": "a"},
            {"prompt": "empty", "chosen": "  ", "rejected": "no"},
            {"prompt": "x" * 40, "chosen": "yes", "rejected": "no"},
            "# a comment",
            {"prompt": "long answer", "chosen": "y" * 50, "rejected": "n"},
        ],
    )
    caplog.set_level(logging.WARNING)
    data = load_stage_data("dpo", [str(path)], identity_prompt, identity_completion, 32, "prefs")
    assert len(data.examples) == 2
    assert data.skipped == {IDENTICAL_PAIR: 1, EMPTY_COMPLETION: 1, PROMPT_TOO_LONG: 1}
    assert data.truncated == 1 and len(data.examples[1].chosen_ids) == 32 - len("long answer")
    for line, reason in ((2, IDENTICAL_PAIR), (3, EMPTY_COMPLETION), (4, PROMPT_TOO_LONG)):
        assert f"{path}:{line}: skipped dpo example ({reason})" in caplog.text


def test_sft_empty_completion_is_skipped(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "sft.jsonl",
        [{"prompt": "a", "completion": ""}, {"prompt": "b", "completion": "c"}],
    )
    data = load_stage_data("sft", [str(path)], identity_prompt, identity_completion, 32, "s")
    assert data.skipped == {EMPTY_COMPLETION: 1}
    assert [e.completion_ids for e in data.examples] == [[ord("c"), 2]]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (["{not json"], "sft.jsonl:1: not valid JSON"),
        (
            [{"prompt": "a"}],
            "sft.jsonl:1: sft lines need string keys prompt, completion; 'completion' is missing",
        ),
        ([{"prompt": "a", "completion": ""}], "no usable sft examples"),
    ],
)
def test_broken_files_fail_naming_the_line(tmp_path: Path, rows: list[Any], message: str) -> None:
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with pytest.raises(UsageError, match=message):
        load_stage_data("sft", [str(path)], identity_prompt, identity_completion, 32, "s")


def pipeline_spec(model: str, stages: list[dict[str, Any]], **extra: Any) -> TrainingRunSpec:
    return TrainingRunSpec.model_validate(
        {
            "model": model,
            "algorithm": {
                "groupSize": 2,
                "promptsPerStep": 2,
                "maxSteps": 1,
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
            "evaluation": {"everySteps": 100, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 1, "keepLast": 2},
            "stages": stages,
            **extra,
        }
    )


def test_missing_data_file_fails_before_any_training(tiny_model: Path, tmp_path: Path) -> None:
    from posttrain.trainer.run.loop import train

    missing = tmp_path / "nowhere" / "sft.jsonl"
    spec = pipeline_spec(
        str(tiny_model),
        [
            {"name": "sft", "type": "sft", "datasets": ["builtin:arithmetic"], "maxSteps": 1},
            {"name": "dpo", "type": "dpo", "datasets": [str(missing)], "maxSteps": 1},
        ],
    )
    out = tmp_path / "out"
    with pytest.raises(UsageError, match=str(missing)):
        train(spec, out, client=None)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_builtin_answers_are_right_and_rejected_ones_wrong() -> None:
    from posttrain.sandboxes.verifiers import verify
    from posttrain.trainer.data.datasets import builtin_tasks

    # code answers run in the sandbox (seconds each on a loaded machine): a few of each
    for name, kind, n in (("arithmetic", "numeric", 12), ("code", "unit_tests", 3)):
        tasks = {t.prompt: t for t in builtin_tasks(name, "train", 400)}
        held_out = {t.prompt for t in builtin_tasks(name, "eval", 64)}
        pairs = list(builtin_records(name, "dpo"))
        demos = list(builtin_records(name, "sft"))
        # a pair whose shifted answer still passes the tests is dropped (not a wrong answer)
        assert len(demos) == len(tasks) and len(pairs) > len(tasks) // 2
        pairs, demos = pairs[:: len(pairs) // n][:n], demos[:: len(demos) // n][:n]
        for raw in pairs:
            task = tasks[raw.record["prompt"]].to_dict()
            assert raw.record["prompt"] not in held_out
            chosen = verify(kind, raw.record["chosen"], task)
            rejected = verify(kind, raw.record["rejected"], task)
            assert chosen.reward == 1.0 and rejected.reward < 1.0, raw
        for raw in demos:
            task = tasks[raw.record["prompt"]].to_dict()
            assert verify(kind, raw.record["completion"], task).reward == 1.0


def test_stage_batches_are_a_function_of_the_step() -> None:
    spec = pipeline_spec(
        "m",
        [
            {
                "name": "sft",
                "type": "sft",
                "datasets": ["builtin:arithmetic"],
                "maxSteps": 3,
                "batchSize": 4,
            },
            {"name": "rl", "type": "rl", "maxSteps": 2},
        ],
    )
    sft, rl = plan_stages(spec)
    assert (sft.first_step, sft.last_step, rl.first_step, rl.last_step) == (1, 3, 4, 5)
    assert spec.total_steps() == 5

    class Data:
        examples = list(range(6))

    batches = [stage_batch(sft, Data(), step, 0, 0, 1) for step in (1, 2, 3)]  # type: ignore[arg-type]
    assert sorted(batches[0] + batches[1][:2]) == list(range(6))  # one pass, then reshuffled
    assert batches == [stage_batch(sft, Data(), s, 0, 0, 1) for s in (1, 2, 3)]  # type: ignore[arg-type]
    # two ranks split the step's batch
    halves = [stage_batch(sft, Data(), 1, 0, r, 2) for r in (0, 1)]  # type: ignore[arg-type]
    assert sorted(halves[0] + halves[1]) == sorted(batches[0])


# --------------------------------------------------------------------------- whole pipeline

PIPELINE = [
    {
        "name": "warmup",
        "type": "sft",
        "datasets": ["builtin:arithmetic"],
        "maxSteps": 2,
        "batchSize": 4,
        "microBatchSize": 2,
        "maxLength": 96,
        "learningRate": 1e-3,
    },
    {
        "name": "prefs",
        "type": "dpo",
        "datasets": ["builtin:arithmetic"],
        "maxSteps": 2,
        "batchSize": 4,
        "microBatchSize": 4,
        "maxLength": 96,
        "learningRate": 1e-3,
        "beta": 0.5,
        "lrSchedule": "cosine",  # each stage its own curve: 5e-4 at step 3, 0 at step 4
    },
    {"name": "rl", "type": "rl", "maxSteps": 1},
]


def run_with_server(spec: TrainingRunSpec, out: Path, **kwargs: Any) -> Any:
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.run.loop import train
    from posttrain.trainer.run.server_process import LocalRolloutServer

    with LocalRolloutServer(spec.model, out / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            return train(spec, out, client, **kwargs)
        finally:
            client.close()


@pytest.mark.slow  # four server starts of the tiny model; ~2-4 min on a loaded machine
def test_pipeline_resumes_inside_the_right_stage_at_the_right_step(
    tiny_model: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from posttrain.trainer.observe.step_metrics import load_metrics

    # every checkpoint kept: the DPO stage's start (step 2) is read below
    spec = pipeline_spec(str(tiny_model), PIPELINE, checkpoint={"everySteps": 1, "keepLast": 5})
    straight = run_with_server(spec, tmp_path / "straight")
    assert straight.steps_done == 5

    broken = tmp_path / "broken"
    assert run_with_server(spec, broken, stop_after_step=1).steps_done == 1  # inside sft
    assert run_with_server(spec, broken, stop_after_step=3).steps_done == 3  # inside dpo
    assert run_with_server(spec, broken).steps_done == 5

    # every step ran exactly once, in its stage (no step redone or skipped by a resume)
    lines = [json.loads(line) for line in (broken / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["stage"]) for m in lines] == [
        (1, "warmup"),
        (2, "warmup"),
        (3, "prefs"),
        (4, "prefs"),
        (5, "rl"),
    ]
    assert [m.get("stage_step") for m in lines[:4]] == [1, 2, 1, 2]
    a, b = load_metrics(tmp_path / "straight"), load_metrics(broken)
    for x, y in zip(a, b, strict=True):
        keys = ("loss", "grad_norm", "reward_margin", "reward_accuracy", "reward_mean")
        for key in (*keys, "learning_rate"):
            if x.get(key) is not None:
                assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (x["step"], key)
    assert a[2]["reward_accuracy"] is not None and a[0]["reward_accuracy"] is None
    # the DPO stage's cosine runs over its own two steps (not algorithm.maxSteps); the
    # others are constant at their own rates
    # (cosine without warm-up: half-way down at its first step, 0 at its last)
    assert [m["learning_rate"] for m in b] == pytest.approx([1e-3, 1e-3, 5e-4, 0.0, 1e-3])
    weights_a = load_file(tmp_path / "straight/checkpoints/latest/model.safetensors")
    weights_b = load_file(broken / "checkpoints/latest/model.safetensors")
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=1e-5, atol=1e-6)

    for out in (tmp_path / "straight", broken):
        status = json.loads((out / "status.json").read_text())
        assert status["phase"] == "Succeeded" and status["step"] == 5 == status["maxSteps"]
        assert status["stage"] == "rl"
        stages = status["stages"]
        assert [(s["name"], s["phase"], s["firstStep"], s["lastStep"]) for s in stages] == [
            ("warmup", "Succeeded", 1, 2),
            ("prefs", "Succeeded", 3, 4),
            ("rl", "Succeeded", 5, 5),
        ]
        assert all(set(s["evalAccuracy"]) == {"arithmetic"} for s in stages)
        # held-out evaluation at step 0 and at every stage boundary
        for step in (0, 2, 4, 5):
            assert (out / f"eval/heldout_step{step:04d}.json").is_file(), step
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        assert [(e["reason"], e["message"].split()[1]) for e in events] == [
            ("StageStarted", "warmup"),
            ("StageSucceeded", "warmup"),
            ("StageStarted", "prefs"),
            ("StageSucceeded", "prefs"),
            ("StageStarted", "rl"),
            ("StageSucceeded", "rl"),
        ]
        report = (out / "report.md").read_text()
        assert "## Held-out accuracy by stage" in report and "| prefs | dpo | 3-4 |" in report
        assert "pairs ranked right" in report and "| warmup | sft | 1-2 |" in report

    # DPO's reference is the frozen stage-start model: the log-probs the stage stored are
    # those of the SFT stage's last checkpoint (step 2), not of the base model
    assert_dpo_reference_is_the_stage_start(spec, tiny_model, tmp_path / "straight")


def assert_dpo_reference_is_the_stage_start(spec: Any, base: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.trainer.run.pipeline import load_pipeline_data

    state = json.loads((out / "checkpoints/step-00000004/trainer_state.json").read_text())
    stored = state["stage_state"]["reference_logps"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    pairs = load_pipeline_data(plan_stages(spec), tokenizer)["prefs"].examples
    chosen_pairs = [pairs[int(i)] for i in stored]
    want = torch.tensor(list(stored.values()))  # (B, 2)

    def logps(model_dir: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            chosen, rejected = sequence_logps(model, chosen_pairs, tokenizer.pad_token_id)
        return torch.stack([chosen, rejected], dim=1)  # (B, 2)

    torch.testing.assert_close(logps(out / "checkpoints/step-00000002"), want, rtol=1e-4, atol=1e-4)
    assert (logps(base) - want).abs().max() > 1e-2  # SFT moved them: the check can fail


def test_dpo_loss_and_gradient_equal_trl(tiny_model: Path, tmp_path: Path) -> None:
    """Our DPO step and TRL's DPOTrainer (sigmoid loss) on the same batch, beta and models."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)

    policy, reference = load(), load()
    with torch.no_grad():  # the policy has moved away from its reference, as mid-stage
        g = torch.Generator().manual_seed(1)
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rows = [
        {"prompt": f"What is {a} + {b}?", "chosen": f"{a + b}", "rejected": f"{a + b + d}"}
        for a, b, d in ((3, 4, 1), (12, 9, -2), (7, 7, 5), (40, 2, 3))
    ]
    beta = 0.3
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=beta,
        loss_type=["sigmoid"],
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        precompute_ref_log_probs=False,
        max_length=None,
        bf16=False,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    batch = trainer.data_collator(examples)
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = grads(policy)
    mode = "train" if trainer.model.training else "eval"  # TRL files its metrics by mode
    trl_metrics = {k: v[-1] for k, v in trainer._metrics[mode].items()}

    pairs = [
        PreferencePair(e["prompt_ids"], e["chosen_ids"], e["rejected_ids"], str(i))
        for i, e in enumerate(examples)
    ]
    assert all(p.chosen_ids[-1] == tokenizer.eos_token_id for p in pairs)  # same batch as TRL's
    with torch.no_grad():
        ref_chosen, ref_rejected = sequence_logps(reference, pairs, tokenizer.pad_token_id)
    chosen, rejected = sequence_logps(policy, pairs, tokenizer.pad_token_id)
    terms = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta)
    loss = terms.losses.mean()
    loss.backward()
    ours = grads(policy)

    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=1e-5, atol=1e-6)
    assert ours.keys() == trl_grads.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], trl_grads[name], rtol=1e-4, atol=1e-6)
    margins = terms.chosen_rewards - terms.rejected_rewards
    assert float(terms.chosen_rewards.mean()) == pytest.approx(
        trl_metrics["rewards/chosen"], rel=1e-4, abs=1e-6
    )
    assert float(margins.mean()) == pytest.approx(
        trl_metrics["rewards/margins"], rel=1e-4, abs=1e-6
    )
    assert float((margins > 0).float().mean()) == trl_metrics["rewards/accuracies"]


@pytest.mark.slow  # two server starts of the tiny model; ~1-2 min on a loaded machine
def test_rl_stage_kl_anchor_is_the_stage_start_also_after_a_resume(
    tiny_model: Path, tmp_path: Path
) -> None:
    """SFT moves the weights, then RL with a KL penalty: at the RL stage's first step the
    policy *is* its reference (KL exactly 0, where the base model would give KL > 0); a run
    resumed inside the RL stage reloads that anchor from the stage-start checkpoint, which
    retention keeps although keepLast is 1 (its KL at the next step is the straight run's,
    not 0 as an anchor at the resumed weights would give)."""
    import zlib
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from posttrain.trainer.observe.step_metrics import load_metrics

    def coin_verify(kind: str, text: str, task: Any, config: Any) -> Any:
        """A deterministic reward that differs within groups (the tiny model never solves
        arithmetic), so every RL step has advantages and moves the policy: graded, not a
        coin, since a 0/1 coin left both groups of 2 without signal in both steps."""
        reward = (zlib.crc32(text.encode()) % 1000) / 1000
        return SimpleNamespace(reward=reward, passed=reward >= 0.5, details={})

    stages = [PIPELINE[0], {"name": "rl", "type": "rl", "maxSteps": 2}]
    spec = pipeline_spec(str(tiny_model), stages, checkpoint={"everySteps": 1, "keepLast": 1})
    spec.algorithm.kl_coef = 0.5
    spec.algorithm.learning_rate = 1e-2  # a visible RL step: step 4's KL is ~0.02
    straight = run_with_server(spec, tmp_path / "straight", verify=coin_verify)
    broken = tmp_path / "broken"
    run_with_server(spec, broken, stop_after_step=3, verify=coin_verify)
    assert sorted(p.name for p in (broken / "checkpoints").glob("step-*")) == [
        "step-00000002",  # the RL stage's anchor, pinned
        "step-00000003",
    ]
    resumed = run_with_server(spec, broken, verify=coin_verify)
    assert straight.steps_done == resumed.steps_done == 4
    a, b = load_metrics(tmp_path / "straight"), load_metrics(broken)
    assert [m["stage"] for m in a] == ["warmup", "warmup", "rl", "rl"]
    anchor = load_file(broken / "checkpoints/step-00000002/model.safetensors")
    base = load_file(tiny_model / "model.safetensors")
    assert max(float((anchor[k] - base[k]).abs().max()) for k in anchor) > 1e-3  # SFT moved
    assert a[2]["kl"] == 0.0 and b[2]["kl"] == 0.0
    # step 3 moved the policy away from the anchor, so step 4's KL is > 0 -- and the
    # resumed run's equals the straight run's: it reloaded the stage-start anchor (one at
    # the resumed weights would give exactly 0 here)
    assert a[2]["grad_norm"] > 0 and a[2]["applied"]
    # Same up to sampling: both runs' step-4 completions can differ by a token where float
    # summation order moved a logit (seen: 0.0210 vs 0.0208), so compare within 25 %.
    assert a[3]["kl"] > 1e-4
    assert b[3]["kl"] == pytest.approx(a[3]["kl"], rel=0.25)
