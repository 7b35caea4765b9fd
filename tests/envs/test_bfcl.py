"""BFCL single-turn tool calling: our decoding + BFCL's own AST checker, on every shipped item.

For every item of the four answer files, one accepted reply (built from ``possible_answer``)
must pass and four wrong replies must fail, through the same ``verify("bfcl_ast", ...)``
the trainer calls; the decoded calls must be exactly the arguments that were written.
"""

from __future__ import annotations

import ast
import copy
from typing import Any

import pytest

from posttrain.sandboxes import bfcl
from posttrain.sandboxes.verifiers import verify
from posttrain.trainer.data.datasets import builtin_tasks, is_held_out


def _task(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "functions": item["function"],
        "ground_truth": item["ground_truth"],
        "bfcl_category": item["category"],
    }


def _wrong_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 123457
    if isinstance(value, str):
        return value + "_not_this"
    if isinstance(value, list):
        return [*value, "extra_item_not_accepted"]
    return "not_a_dict"


@pytest.mark.parametrize("category", bfcl.ALL_CATEGORIES)
def test_every_shipped_answer_passes_and_every_perturbation_fails(category: str) -> None:
    items = bfcl.load_category(category)
    assert len(items) >= 16
    defective = []
    for item in items:
        task = _task(item)
        reply = bfcl.canonical_answer(item["ground_truth"], item["function"])
        # 1. the accepted reply passes, and decodes to exactly the written arguments
        result = verify("bfcl_ast", reply, task)
        if item["id"] in bfcl.BFCL_DATA_DEFECTS:
            assert not result.passed, f"{item['id']} passes now: remove it from BFCL_DATA_DEFECTS"
            defective.append(item["id"])
            continue
        assert result.passed, (item["id"], reply, result.details["error"])
        tree = ast.parse(reply, mode="eval").body
        assert isinstance(tree, ast.List)
        written = [
            {ast.unparse(c.func): {k.arg: ast.literal_eval(k.value) for k in c.keywords}}
            for c in tree.elts
            if isinstance(c, ast.Call)
        ]
        assert result.details["decoded"] == written
        decoded = result.details["decoded"]
        # 2. a wrong function name fails
        first_name = next(iter(decoded[0]))
        renamed = reply.replace(first_name + "(", first_name + "_x(", 1)
        assert not verify("bfcl_ast", renamed, task).passed, item["id"]
        # 3. a wrong value for an argument fails (the first argument of the first call)
        arguments = decoded[0][first_name]
        if arguments:
            changed = copy.deepcopy(decoded)
            key = next(iter(arguments))
            changed[0][first_name][key] = _wrong_value(arguments[key])
            text = (
                "["
                + ", ".join(
                    f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
                    for call in changed
                    for name, args in call.items()
                )
                + "]"
            )
            assert not verify("bfcl_ast", text, task).passed, (item["id"], text)
        # 4. one call too few (parallel / multi-call items) or too many (single-call) fails
        calls = [
            f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            for call in decoded
            for name, args in call.items()
        ]
        fewer_or_more = calls[:-1] if len(calls) > 1 else calls * 2
        assert not verify("bfcl_ast", "[" + ", ".join(fewer_or_more) + "]", task).passed
        # 5. prose instead of calls fails with a decoder error
        prose = verify("bfcl_ast", "I would call the function for you.", task)
        assert not prose.passed
        assert prose.details["error_type"].startswith("ast_decoder")
    expected = {i for i in bfcl.BFCL_DATA_DEFECTS if i.rsplit("_", 1)[0] == category}
    assert set(defective) == expected
    records = bfcl.task_records(category)
    assert len(records) == len(items) - len(expected)
    assert not {r["bfcl_id"] for r in records} & bfcl.BFCL_DATA_DEFECTS


def test_decoder_follows_bfcl_and_never_evaluates_code() -> None:
    assert bfcl.decode_calls("```\n[f(a=1), g.h(b='x')]\n```") == [
        {"f": {"a": 1}},
        {"g.h": {"b": "x"}},
    ]
    assert bfcl.decode_calls("f(x=2**10, y=-3.5, z=(1, 2))") == [
        {"f": {"x": 1024, "y": -3.5, "z": (1, 2)}}
    ]
    with pytest.raises(bfcl.ToolCallParseError, match="not python call syntax"):
        bfcl.decode_calls("[f(a=1]")
    with pytest.raises(bfcl.ToolCallParseError, match="unsupported argument value"):
        bfcl.decode_calls("f(a=lambda: __import__('os').system('true'))")
    with pytest.raises(bfcl.ToolCallParseError, match="expected a function call"):
        bfcl.decode_calls("[1, 2]")


def test_prompt_is_bfcl_default_system_prompt_plus_question() -> None:
    (record,) = [r for r in bfcl.task_records("simple_python") if r["bfcl_id"] == "simple_python_0"]
    prompt = record["prompt"]
    assert prompt.startswith("You are an expert in composing functions.")
    assert "[func_name1(params_name1=params_value1, params_name2=params_value2...)" in prompt
    assert '"name": "calculate_triangle_area"' in prompt
    assert "Note that the provided function is in Python 3 syntax." in prompt
    assert prompt.endswith(
        "Find the area of a triangle with a base of 10 units and height of 5 units."
    )


def test_builtin_bfcl_splits_by_content_hash_without_overlap() -> None:
    train = builtin_tasks("bfcl", "train", per_stratum=0)
    held = builtin_tasks("bfcl", "eval", per_stratum=0)
    assert len(train) + len(held) == 1000
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    assert all(is_held_out(t) for t in held) and not any(is_held_out(t) for t in train)
    assert 150 <= len(held) <= 250  # one hash bucket in five
    assert {t.difficulty for t in train} == {"easy", "medium", "hard"}
    one = builtin_tasks("bfcl_parallel", "eval", per_stratum=0)
    assert {t.extra["bfcl_category"] for t in one} == {"parallel"}


def test_live_categories_are_builtin_datasets_named_as_bfcl_names_them() -> None:
    from posttrain.trainer.data.datasets import BFCL_SINGLE_TURN
    from posttrain.trainer.data.stage_data import builtin_records

    assert BFCL_SINGLE_TURN == bfcl.ALL_CATEGORIES
    train = builtin_tasks("bfcl_live", "train", per_stratum=0)
    held = builtin_tasks("bfcl_live", "eval", per_stratum=0)
    assert {t.extra["bfcl_category"] for t in train} == set(bfcl.LIVE_CATEGORIES)
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    defects = len(bfcl.BFCL_DATA_DEFECTS)
    shipped = sum(len(bfcl.load_category(c)) for c in bfcl.LIVE_CATEGORIES)
    assert len(train) + len(held) == shipped - defects
    # SFT demonstrations come from the training side only, with the answer BFCL accepts
    demos = list(builtin_records("bfcl_live_simple", "sft"))
    simple_train = builtin_tasks("bfcl_live_simple", "train", per_stratum=0)
    assert len(demos) == len(simple_train) > 0
    first = simple_train[0]
    assert demos[0].record["completion"] == first.answer
    task = {k: first.extra[k] for k in ("functions", "ground_truth", "bfcl_category")}
    assert verify("bfcl_ast", first.answer or "", task).passed


def test_run_spec_accepts_the_benchmark_datasets() -> None:
    from posttrain.api import TrainingRunSpec
    from posttrain.errors import UsageError
    from posttrain.trainer.data.rundata import check_dataset_sources

    def spec(dataset: str) -> TrainingRunSpec:
        return TrainingRunSpec.model_validate(
            {
                "model": "m",
                "domains": [{"name": "d", "dataset": dataset, "verifier": {"kind": "bfcl_ast"}}],
            }
        )

    for name in ("bfcl", "bfcl_parallel_multiple", "bfcl_live", "bfcl_live_multiple", "humaneval"):
        check_dataset_sources(spec(f"builtin:{name}"))
    with pytest.raises(UsageError, match="builtin:bfcl_simple_python"):
        check_dataset_sources(spec("builtin:bfcl_nope"))
