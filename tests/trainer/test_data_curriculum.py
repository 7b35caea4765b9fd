"""Task files, built-in generators and the curriculum (pure Python, fast)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.errors import UsageError
from posttrain.rollout.protocol import Completion
from posttrain.trainer.algorithms.loss import LossConfig
from posttrain.trainer.data.curriculum import Curriculum, DomainPool, allocate_slots
from posttrain.trainer.data.datasets import Task, builtin_tasks, load_jsonl_tasks, load_tasks
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
from posttrain.trainer.data.rundata import balanced_subset, domain_tasks
from posttrain.trainer.rewards.scoring import ScoredSample
from posttrain.trainer.run.batch import prepare_batch


def test_builtin_splits_are_deterministic_and_disjoint() -> None:
    for name in ("arithmetic", "code"):
        train = builtin_tasks(name, "train", 100)
        held = builtin_tasks(name, "eval", 30)
        assert builtin_tasks(name, "train", 100) == train
        assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
        assert {t.prompt for t in train}.isdisjoint({t.prompt for t in held})
        assert len(held) >= 30


def test_builtin_answers_are_right() -> None:
    task = builtin_tasks("arithmetic", "train", 5)[0]
    expression = task.prompt.removeprefix("What is ").split("?")[0]
    assert str(eval(expression)) == task.answer
    code = builtin_tasks("code", "train", 5)[0]
    assert code.tests and code.tests.startswith("assert ")


def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"domain": "arithmetic", "prompt": "1+1?", "answer": "2"}\n{oops\n')
    with pytest.raises(UsageError, match=r"tasks.jsonl:2: not valid JSON"):
        load_jsonl_tasks(path)
    path.write_text('{"domain": "arithmetic", "prompt": "1+1?"}\n')
    with pytest.raises(UsageError, match=r"tasks.jsonl:1: needs \"answer\""):
        load_jsonl_tasks(path)
    path.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    with pytest.raises(UsageError, match=r"tasks.jsonl:1: missing \"domain\""):
        load_jsonl_tasks(path)
    with pytest.raises(UsageError, match="does not exist"):
        load_jsonl_tasks(tmp_path / "missing.jsonl")


def test_jsonl_domain_split_never_overlaps(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    lines = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(200)]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    train, held = domain_tasks("math", str(path), None)
    assert len(train) + len(held) == 200 and held
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    assert all(t.domain == "math" for t in train)


def test_unknown_builtin_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="builtin:arithmetic"):
        load_tasks("builtin:chess", "chess")


def test_balanced_subset_covers_strata() -> None:
    held = builtin_tasks("arithmetic", "eval", 20)
    subset = balanced_subset(held, 9)
    assert [t.difficulty for t in subset].count("hard") == 3


def test_slot_allocation_quota_and_weights() -> None:
    slots = allocate_slots(10, {"a": 1.0, "b": 0.0}, 0.2, random.Random(0))
    assert slots.count("b") == 2 and slots.count("a") == 8
    slots = allocate_slots(1000, {"a": 3.0, "b": 1.0}, 0.0, random.Random(0))
    assert 700 < slots.count("a") < 800


def test_quota_slots_beyond_the_batch_are_shared_out_by_weight() -> None:
    # 300 domains with a quota of 1 slot each cannot all fit in 64 slots. Over many
    # batches each domain's quota slots must follow its weight; the alphabetically first
    # domains must not take every quota slot of every batch.
    weights = {f"d{i:03d}": (3.0 if i % 2 else 1.0) for i in range(300)}
    rng = random.Random(0)
    counts = dict.fromkeys(weights, 0)
    for _ in range(400):
        slots = allocate_slots(64, weights, 1 / 64, rng)
        assert len(slots) == 64 and len(set(slots)) == 64  # one quota slot per drawn domain
        for name in slots:
            counts[name] += 1
    assert min(counts.values()) > 0  # every domain got slots
    heavy = sum(v for k, v in counts.items() if weights[k] == 3.0)
    light = sum(v for k, v in counts.items() if weights[k] == 1.0)
    # Sampling without replacement flattens the 3:1 a little (a heavy domain cannot take
    # two quota slots of one batch), but the share still clearly follows the weight.
    assert 2.0 < heavy / light < 3.2
    first, last = (
        sum(counts[f"d{i:03d}"] for i in range(64)),
        sum(counts[f"d{i:03d}"] for i in range(236, 300)),
    )
    assert abs(first - last) / last < 0.15  # name order no longer decides


def test_a_domain_weight_is_applied_once() -> None:
    # 3:1 weights give ~3:1 prompts, and prepare_batch gives a sample of either domain the
    # same loss coefficient, so the domains' gradient shares are ~3:1, not 9:1
    # (docs/trainer.md, "Domain weights").
    tasks = {d: [Task(d, f"{d} {i}", "1") for i in range(50)] for d in ("a", "b")}
    cur = Curriculum(
        [DomainPool.from_tasks("a", tasks["a"], 3.0), DomainPool.from_tasks("b", tasks["b"], 1.0)],
        seed=0,
    )
    share = {"a": 0.0, "b": 0.0}
    for step in range(1, 101):
        chosen = cur.next_prompts(16)
        groups = [
            [Completion(i, "x", [1] * 5, [-1.0] * 5, "stop", 0) for _ in range(2)]
            for i in range(len(chosen))
        ]
        batch = RolloutBatch(RolloutRequest(step, chosen, [[0]] * len(chosen), 0), groups, 0.0)
        scored = [[ScoredSample(r, r, 0.0, r > 0) for r in (1.0, 0.0)] for _ in chosen]
        prepared = prepare_batch(
            batch,
            scored,
            algorithm="grpo",
            dynamic_sampling=True,
            loss_config=LossConfig(),
            step=step,
        )
        for sample, (task, _) in zip(
            prepared.samples, [(t, j) for t in chosen for j in range(2)], strict=True
        ):
            share[task.domain] += sample.coefficient
    assert 2.6 < share["a"] / share["b"] < 3.4


def _pool() -> DomainPool:
    tasks = [Task("m", f"easy {i}", "1", difficulty="easy") for i in range(5)]
    tasks += [Task("m", f"hard {i}", "1", difficulty="hard") for i in range(5)]
    return DomainPool.from_tasks("m", tasks)


def test_curriculum_promotes_when_rolling_pass_rate_reaches_threshold() -> None:
    cur = Curriculum([_pool()], promote_at=0.75, window=4, replay_fraction=0.0, seed=1)
    assert all(t.difficulty == "easy" for t in cur.next_prompts(8))
    easy = Task("m", "easy 0", "1", difficulty="easy")
    for rate in (1.0, 1.0, 0.0):
        assert cur.observe(easy, rate, step=1) is None  # window not full yet
    assert cur.observe(easy, 1.0, step=2) == "hard"  # 3/4 = 0.75 >= promote_at
    assert cur.promotions == [{"step": 2, "domain": "m", "stratum": "hard"}]
    assert all(t.difficulty == "hard" for t in cur.next_prompts(8))


def test_curriculum_does_not_promote_below_threshold() -> None:
    cur = Curriculum([_pool()], promote_at=0.75, window=4, replay_fraction=0.0)
    easy = Task("m", "easy 0", "1", difficulty="easy")
    for rate in (1.0, 0.0, 1.0, 0.0, 0.5, 0.5):
        assert cur.observe(easy, rate, step=1) is None
    assert cur.current_stratum("m") == "easy"


def test_replay_draws_solved_tasks() -> None:
    cur = Curriculum([_pool()], promote_at=1.0, window=4, replay_fraction=0.99, seed=3)
    solved = Task("m", "easy 3", "1", difficulty="easy")
    cur.observe(solved, 0.5, step=1)
    drawn = cur.next_prompts(50)
    assert sum(t == solved for t in drawn) > 40  # ~99 % replays of the one solved task
    cur.observe(Task("m", "easy 4", "1", difficulty="easy"), 0.0, step=1)
    assert len(cur.replay["m"]) == 1  # unsolved tasks are not replayed


def test_curriculum_state_round_trip_continues_identically() -> None:
    cur = Curriculum([_pool()], window=4, seed=7)
    cur.next_prompts(3)
    cur.observe(Task("m", "easy 1", "1", difficulty="easy"), 1.0, step=1)
    state = json.loads(json.dumps(cur.state_dict()))  # must survive JSON
    other = Curriculum([_pool()], window=4, seed=999)
    other.load_state_dict(state)
    assert other.next_prompts(10) == cur.next_prompts(10)
