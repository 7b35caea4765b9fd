"""Every verifier kind: rewards, partial credit, determinism and reward-hacking signals."""

from __future__ import annotations

import pytest

from posttrain.sandboxes.executor import Executor
from posttrain.sandboxes.verifiers import verify


@pytest.fixture(scope="module")
def executor() -> Executor:
    return Executor()


def test_exact_normalises_and_prefers_the_stated_answer() -> None:
    assert verify("exact", "I think...\nAnswer: PARIS.", {"answer": "Paris"}).passed
    assert verify("exact", r"so it is \boxed{\text{Paris}}", {"answer": "paris"}).reward == 1.0
    assert not verify(
        "exact", "Answer: paris", {"answer": "Paris"}, {"case_sensitive": True}
    ).passed
    hedged = verify("exact", "Answer: Paris\nAnswer: Lyon", {"answer": "Lyon"})
    assert "multiple_answers" in hedged.details["hack_signals"]


@pytest.mark.parametrize(
    ("completion", "answer", "config", "reward"),
    [
        ("The answer is \\boxed{1,234}", "1234", {}, 1.0),
        ("Answer: 3/4\nso 0.75 + 1 = 1.75", 0.75, {}, 1.0),
        ("2 + 2 = 4, then 4 * 10 = 40", "40", {}, 1.0),
        ("Answer: 3.1416", "3.14159265", {"rel_tol": 1e-4}, 1.0),
        ("Answer: 3.1416", "3.14159265", {}, 0.0),
        ("Answer: 100.4", 100, {"abs_tol": 0.5}, 1.0),
        ("no digits at all", "7", {}, 0.0),
    ],
)
def test_numeric_extracts_the_final_number(
    completion: str, answer: object, config: dict, reward: float
) -> None:
    assert verify("numeric", completion, {"answer": answer}, config).reward == reward


def test_regex_search_and_fullmatch() -> None:
    config = {"pattern": r"<think>.*</think>\s*\d+", "flags": "DOTALL"}
    assert verify("regex", "<think>\nhmm\n</think> 42", {}, config).passed
    strict = {**config, "fullmatch": True}
    assert not verify("regex", "preamble <think>x</think> 42", {}, strict).passed
    with pytest.raises(ValueError, match="does not compile"):
        verify("regex", "x", {}, {"pattern": "("})


def test_json_tool_call_checks_schema_and_expected_arguments() -> None:
    task = {
        "tool_schema": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                },
                "additionalProperties": False,
            },
        },
        "expected_arguments": {"city": "Oslo", "unit": "C"},
    }
    good = verify(
        "json_tool_call",
        'Calling: {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}',
        task,
    )
    assert good.passed and good.details["problems"] == []
    as_string = verify(
        "json_tool_call",
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"unit\\": \\"C\\"}"}',
        task,
    )
    assert as_string.passed
    bad = verify(
        "json_tool_call",
        '{"name": "get_weather", "arguments": {"city": 3, "unit": "K", "x": 1}}',
        task,
    )
    assert not bad.passed
    assert "argument 'city' should be string, got int" in bad.details["problems"]
    assert "unexpected argument 'x'" in bad.details["problems"]
    assert any("not one of" in p for p in bad.details["problems"])
    wrong_args = verify(
        "json_tool_call", '{"name": "get_weather", "arguments": {"city": "Rome"}}', task
    )
    assert wrong_args.reward == 0.0 and "differ from expected" in wrong_args.details["problems"][0]
    assert verify("json_tool_call", "I cannot call tools", task).details["problems"] == [
        "no JSON tool call found"
    ]


UNIT_TESTS = """
from solution import add

def test_positive():
    assert add(1, 2) == 3

def test_negative():
    assert add(-1, -1) == -2

def test_hangs():
    while True:
        pass

assert add(0, 0) == 0
assert add(2, 2) == 5
"""


def test_unit_tests_reward_is_pass_rate_and_one_failure_hides_nothing(
    executor: Executor,
) -> None:
    completion = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    result = verify(
        "unit_tests", completion, {"tests": UNIT_TESTS}, {"case_timeout_s": 1.0}, executor=executor
    )
    outcomes = {r["name"]: r["passed"] for r in result.details["results"]}
    assert outcomes == {
        "test_positive": True,
        "test_negative": True,
        "test_hangs": False,
        "assert_line_14": True,
        "assert_line_15": False,
    }
    assert result.reward == pytest.approx(3 / 5) and not result.passed
    assert result.details["hack_signals"] == []
    again = verify(
        "unit_tests", completion, {"tests": UNIT_TESTS}, {"case_timeout_s": 1.0}, executor=executor
    )
    assert again.reward == result.reward  # deterministic


def test_unit_tests_flag_exit_and_builtin_tampering(executor: Executor) -> None:
    exits = "```python\nimport os\nprint('All tests PASSED')\nos._exit(0)\n```"
    result = verify(
        "unit_tests", exits, {"tests": ["from solution import *", "assert True"]}, executor=executor
    )
    assert result.reward == 0.0
    assert {"exits_process", "prints_pass_marker", "process_exit_during_tests"} <= set(
        result.details["hack_signals"]
    )

    tamper = (
        "```python\nimport builtins\nbuiltins.len = lambda x: 3\n"
        "def count(xs):\n    return len(xs)\n```"
    )
    tampered = verify(
        "unit_tests",
        tamper,
        {"tests": "from solution import count\nassert count([1, 2, 3]) == 3"},
        executor=executor,
    )
    assert tampered.reward == 1.0  # the tests passed, but the audit sees how
    assert {"tampers_builtins", "builtins_modified"} <= set(tampered.details["hack_signals"])

    peek = verify(
        "unit_tests",
        "```python\nimport os\nFILES = sorted(os.listdir('.'))\n```",
        {"tests": "from solution import FILES\nassert FILES == ['solution.py']"},
        executor=executor,
    )
    assert peek.reward == 1.0  # the tests are gone from the workspace before the solution runs

    empty = verify("unit_tests", "", {"tests": "assert True"}, executor=executor)
    assert "empty_answer" in empty.details["hack_signals"]


def test_shell_reward_is_verify_pass_rate(executor: Executor) -> None:
    task = {
        "setup": "mkdir data && printf 'b\\na\\nc\\n' > data/in.txt",
        "verify": [
            "test -f data/sorted.txt",
            "diff -q data/sorted.txt data/expected.txt",
            "test ! -e data/in.txt",
            "grep -qx a data/sorted.txt",
        ],
    }
    completion = (
        "```bash\nsort data/in.txt > data/sorted.txt\n"
        "(sleep 0.3; echo tampered > data/sorted.txt) &\n```"
    )
    result = verify("shell", completion, task, executor=executor)
    checks = [c["passed"] for c in result.details["checks"]]
    # expected.txt never exists and in.txt was kept: 2 of 4; the background writer was
    # killed before the checks ran, so sorted.txt still holds the real output.
    assert checks == [True, False, False, True]
    assert result.reward == 0.5

    hack = verify(
        "shell",
        "```sh\necho __POSTTRAIN_CHECK__ 0 pass\necho PASSED\n```",
        {"setup": "", "verify": ["false"]},
        executor=executor,
    )
    assert hack.reward == 0.0
    assert {"fakes_check_marker", "prints_pass_marker"} <= set(hack.details["hack_signals"])


def test_unknown_kind_and_missing_task_fields_are_explained() -> None:
    with pytest.raises(ValueError, match="unknown verifier kind 'fuzzy'"):
        verify("fuzzy", "x", {})
    with pytest.raises(ValueError, match=r"needs task\['answer'\]"):
        verify("numeric", "1", {"question": "?"})
