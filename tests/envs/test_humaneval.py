"""HumanEval through the sandboxed unit-test verifier: all 164 canonical solutions pass,
stubs and wrong solutions fail (each problem's own ``check`` runs in bubblewrap)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from posttrain.envs import humaneval
from posttrain.sandboxes.verifiers import verify
from posttrain.trainer.data.datasets import builtin_tasks


@pytest.mark.slow
def test_canonical_solutions_pass_and_stubs_fail_in_the_sandbox() -> None:
    problems = humaneval.load_problems()
    records = humaneval.task_records()
    assert len(problems) == len(records) == 164

    def judge(pair: tuple[dict, dict]) -> tuple[str, bool, bool, bool]:
        problem, record = pair
        canonical = verify("unit_tests", humaneval.reference_completion(problem), record)
        stub = verify("unit_tests", f"```python\n{problem['prompt']}    pass\n```", record)
        # A solution that returns a constant of the wrong kind: still a real function.
        wrong = verify(
            "unit_tests", f"```python\n{problem['prompt']}    return object()\n```", record
        )
        return problem["task_id"], canonical.passed, stub.passed, wrong.passed

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(judge, zip(problems, records, strict=True)))
    assert [o[0] for o in outcomes if not o[1]] == []  # every canonical solution passes
    assert [o[0] for o in outcomes if o[2]] == []  # no stub passes
    assert [o[0] for o in outcomes if o[3]] == []


def test_builtin_humaneval_is_split_by_content_hash() -> None:
    train = builtin_tasks("humaneval", "train", per_stratum=0)
    held = builtin_tasks("humaneval", "eval", per_stratum=0)
    assert len(train) + len(held) == 164 and held
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    assert all(t.verifier == "unit_tests" and "def test_" in (t.tests or "") for t in held)
