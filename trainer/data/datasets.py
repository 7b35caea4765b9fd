"""Task records: loading task files (JSONL, Parquet, Arrow; local or s3://, see
task_sources.py) and the built-in generated domains.

A task is one prompt with what its verifier needs (``answer`` or ``tests``) and a
difficulty stratum the curriculum uses. Built-in generators (``builtin:arithmetic``,
``builtin:code``) are deterministic; their held-out split is decided by a hash of the
task's *content*, so a held-out item can never appear in training, whatever the seed.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from posttrain.envs.task import Task
from posttrain.errors import UsageError

# Which verifier a domain gets when neither the task nor the spec names one.
DEFAULT_VERIFIER_BY_DOMAIN: dict[str, str] = {"arithmetic": "numeric", "code": "unit_tests"}
# Strata are ordered easiest first; unknown names sort after these, alphabetically.
STRATUM_ORDER: tuple[str, ...] = ("easy", "medium", "hard")
HELD_OUT_MODULUS = 5  # one content-hash bucket in five is held out (20 %)
BUILTIN_POOL_PER_STRATUM = 400  # training items generated per stratum (cheap, deterministic)
BUILTIN_EVAL_PER_STRATUM = 64
KNOWN_VERIFIERS = ("exact", "numeric", "regex", "json_tool_call", "bfcl_ast", "unit_tests", "shell")
# Record verifiers that name an environment's own judge (the domain sets ``environment``).
ENVIRONMENT_VERIFIERS = ("bfcl_multi_turn",)


def is_held_out(task: Task) -> bool:
    """True for the content-hash bucket reserved for evaluation (about 20 % of items)."""
    return int(task.task_id, 16) % HELD_OUT_MODULUS == 0


def stratum_sort_key(name: str) -> tuple[int, str]:
    """Order strata easiest first: easy < medium < hard < anything else (alphabetical)."""
    return (STRATUM_ORDER.index(name) if name in STRATUM_ORDER else len(STRATUM_ORDER), name)


# --------------------------------------------------------------------------- JSONL files


def parse_task_record(record: dict[str, Any], where: str, default_domain: str | None) -> Task:
    """Check one task record (a JSONL line's object, a Parquet or Arrow row) into a Task."""
    if "domain" not in record:
        if default_domain is None:
            raise UsageError(f'{where}: missing "domain" (e.g. "arithmetic" or "code")')
        record["domain"] = default_domain
    if not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
        raise UsageError(f'{where}: missing or empty "prompt" string')
    has_answer = any(record.get(key) for key in ("tests", "verify", "ground_truth"))
    if record.get("answer") is None and not has_answer:
        raise UsageError(
            f'{where}: needs "answer" (e.g. numeric), "tests" (Python asserts), '
            '"verify" (shell checks of a terminal task) or "ground_truth" (BFCL multi-turn '
            "state and responses)"
        )
    verifier = record.get("verifier")
    if verifier is not None and verifier not in (*KNOWN_VERIFIERS, *ENVIRONMENT_VERIFIERS):
        raise UsageError(
            f"{where}: unknown verifier {verifier!r}; use one of {KNOWN_VERIFIERS} "
            f"(or {ENVIRONMENT_VERIFIERS} in a domain with that environment)"
        )
    return Task.from_dict(record)


def load_jsonl_tasks(path: str | Path, default_domain: str | None = None) -> list[Task]:
    """Read a task file: JSONL, Parquet or Arrow, local or ``s3://`` (see task_sources.py);
    blank JSONL lines and ``#`` comments are skipped."""
    from posttrain.trainer.data.task_sources import iter_records

    tasks = [
        parse_task_record(record, where, default_domain)
        for where, record in iter_records(str(path))
    ]
    if not tasks:
        raise UsageError(f"task file {str(path)!r} holds no tasks")
    return tasks


# --------------------------------------------------------------------------- built-ins

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
ANSWER_FORMAT = "Give only the final result on the last line as 'Answer: <number>'."


def arithmetic_task(rng: random.Random, stratum: str) -> Task:
    """One generated arithmetic question; the stratum sets operand sizes and operators."""
    if stratum == "easy":  # one-digit additions
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        text, value = f"{a} + {b}", a + b
    elif stratum == "medium":  # one-digit plus two-digit additions
        a, b = rng.randint(1, 9), rng.randint(10, 49)
        text, value = f"{a} + {b}", a + b
    else:  # two-digit +/-, or a two-digit times a one-digit number
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice(["+", "-", "*"])
        if op == "*":
            b = rng.randint(2, 9)
        text, value = f"{a} {op} {b}", OPS[op](a, b)
    prompt = f"What is {text}? {ANSWER_FORMAT}"
    return Task(domain="arithmetic", prompt=prompt, answer=str(value), difficulty=stratum)


# (function name, description template, body, parameter range) for generated code tasks.
CODE_FAMILIES: dict[str, list[tuple[str, str, str]]] = {
    "easy": [
        ("add_k", "returns its integer argument x plus {k}", "return x + {k}"),
        ("times_k", "returns its integer argument x multiplied by {k}", "return x * {k}"),
        ("minus_k", "returns its integer argument x minus {k}", "return x - {k}"),
        ("is_multiple", "returns True if x is divisible by {k}, else False", "return x % {k} == 0"),
    ],
    "hard": [
        (
            "count_big",
            "returns how many items of the list xs are greater than {k}",
            "return sum(1 for v in xs if v > {k})",
        ),
        (
            "keep_small",
            "returns a list of the items of xs that are less than {k}, in order",
            "return [v for v in xs if v < {k}]",
        ),
        ("sum_plus", "returns the sum of the list xs plus {k}", "return sum(xs) + {k}"),
        ("repeat_str", "returns the string s repeated {k} times", "return s * {k}"),
    ],
}
CODE_FORMAT = "Reply with only the function in a ```python code block."


def code_task(rng: random.Random, stratum: str) -> Task:
    """One generated 'write a small function' task with asserts computed from a reference."""
    name, description, body = rng.choice(CODE_FAMILIES[stratum])
    k = rng.randint(2, 49)
    inputs: list[list[int]] | list[str] | list[int]
    if name in {"count_big", "keep_small", "sum_plus"}:
        arg, inputs = (
            "xs",
            [[rng.randint(0, 30) for _ in range(rng.randint(0, 6))] for _ in range(4)],
        )
    elif name == "repeat_str":
        k = rng.randint(2, 4)
        arg, inputs = "s", [rng.choice(["ab", "x", "", "hi!"]) for _ in range(3)]
    else:
        arg, inputs = "x", [rng.randint(-20, 60) for _ in range(4)]
    reference: dict[str, Any] = {}
    source = f"def {name}({arg}):\n    {body.format(k=k)}\n"
    exec(source, reference)  # our own reference implementation, never model output
    tests = "\n".join(f"assert {name}({v!r}) == {reference[name](v)!r}" for v in inputs)
    prompt = (
        f"Write a Python function `{name}({arg})` that {description.format(k=k)}. {CODE_FORMAT}"
    )
    return Task(domain="code", prompt=prompt, tests=tests + "\n", difficulty=stratum)


BUILTIN_GENERATORS = {
    "arithmetic": (arithmetic_task, ("easy", "medium", "hard")),
    "code": (code_task, ("easy", "hard")),
}


def benchmark_records(name: str) -> list[dict[str, Any]] | None:
    """Task records of a real benchmark shipped on PyPI, or None if ``name`` is not one:
    ``bfcl`` (BFCL's four single-turn python categories), ``bfcl_live`` (their four ``live_``
    counterparts), ``bfcl_<category>`` (one of the eight), ``bfcl_multi_turn_base`` (played
    by the ``bfcl_multi_turn`` environment), ``humaneval``. Loaded lazily so the generated
    domains need neither package."""
    if name == "humaneval":
        from posttrain.envs.humaneval import task_records

        return task_records()
    if name == "bfcl_multi_turn_base":
        from posttrain.envs import bfcl_multi_turn

        return bfcl_multi_turn.task_records()
    if name == "bfcl" or name.startswith("bfcl_"):
        from posttrain.sandboxes import bfcl

        categories = {"bfcl": bfcl.CATEGORIES, "bfcl_live": bfcl.LIVE_CATEGORIES}.get(
            name, (name.removeprefix("bfcl_"),)
        )
        return [r for category in categories for r in bfcl.task_records(category)]
    return None


# BFCL's single-turn categories as ``sandboxes.bfcl.ALL_CATEGORIES`` names them (written out so
# that naming a dataset imports no benchmark package; tests/envs/test_bfcl.py checks they agree).
BFCL_SINGLE_TURN = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
BFCL_SINGLE_TURN_NAMES = ("bfcl", "bfcl_live", *(f"bfcl_{c}" for c in BFCL_SINGLE_TURN))
BENCHMARK_NAMES = (*BFCL_SINGLE_TURN_NAMES, "bfcl_multi_turn_base", "humaneval")


def builtin_tasks(name: str, split: str, per_stratum: int, seed: int = 1234) -> list[Task]:
    """Deterministic items of a built-in domain; ``split`` is ``train`` or ``eval``.

    Items are drawn from one fixed stream per stratum and routed to a split by content
    hash, so the two splits are disjoint and the eval split does not depend on how many
    training items were asked for. Duplicates are dropped.
    """
    records = benchmark_records(name)
    if records is not None:  # a fixed benchmark: every item, routed by the same hash
        tasks = [Task.from_dict({"domain": name, **record}) for record in records]
        return split_tasks(tasks, "eval" if split == "eval" else "train")
    if name not in BUILTIN_GENERATORS:
        raise UsageError(
            f"unknown built-in dataset 'builtin:{name}'; use one of "
            + ", ".join(f"builtin:{n}" for n in (*BUILTIN_GENERATORS, *BENCHMARK_NAMES))
        )
    generate, strata = BUILTIN_GENERATORS[name]
    want_held_out = split == "eval"
    out: list[Task] = []
    for stratum in strata:
        rng = random.Random(f"{name}/{stratum}/{seed}")
        seen: set[str] = set()
        for _ in range(per_stratum * 200):  # bounded: small strata run out of unique items
            task = generate(rng, stratum)
            if task.task_id in seen or is_held_out(task) != want_held_out:
                continue
            seen.add(task.task_id)
            out.append(task)
            if len(seen) == per_stratum:
                break
    return out


def load_tasks(source: str, domain: str, split: str = "train") -> list[Task]:
    """Tasks for one domain from ``builtin:NAME`` or a task file (JSONL, Parquet, Arrow; a
    path or ``s3://`` URI).

    For a training file the held-out rule still applies when the spec gives no
    separate eval file: ``split="eval"`` returns the hash-held-out items and ``train``
    the rest, so the two never overlap.
    """
    if source.startswith("builtin:"):
        per = BUILTIN_POOL_PER_STRATUM if split == "train" else BUILTIN_EVAL_PER_STRATUM
        tasks = builtin_tasks(source.removeprefix("builtin:"), split, per)
        return [Task(**{**asdict(t), "domain": domain}) for t in tasks]
    tasks = load_jsonl_tasks(source, default_domain=domain)
    return tasks


def split_tasks(tasks: Iterable[Task], split: str) -> list[Task]:
    """Filter tasks of one file into the train or eval side of the content-hash split."""
    want = split == "eval"
    return [t for t in tasks if is_held_out(t) == want]


def group_by_stratum(tasks: Iterable[Task]) -> dict[str, list[Task]]:
    """{stratum: tasks}, strata ordered easiest first."""
    groups: dict[str, list[Task]] = {}
    for task in tasks:
        groups.setdefault(task.difficulty, []).append(task)
    return {k: groups[k] for k in sorted(groups, key=stratum_sort_key)}
