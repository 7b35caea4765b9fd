"""Task files, built-in generators and the curriculum (pure Python, fast)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from posttrain.errors import UsageError
from posttrain.trainer.curriculum import Curriculum, DomainPool, allocate_slots
from posttrain.trainer.datasets import Task, builtin_tasks, load_jsonl_tasks, load_tasks
from posttrain.trainer.rundata import balanced_subset, domain_tasks


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
