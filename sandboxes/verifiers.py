"""Reward functions shared by the trainer and the sandbox runner.

``verify(kind, completion, task, config) -> VerifierResult`` with a reward in [0, 1]. The
string kinds (exact, numeric, regex, json_tool_call) are pure Python; the execution kinds
(unit_tests, shell) run the completion in a sandbox through an injectable executor (the local
bubblewrap :class:`~.executor.Executor` or a :class:`~.client.SandboxClient`), so the trainer
can verify in-pod or against a runner fleet with the same code.

Every result carries ``details["hack_signals"]``: cheap, deterministic signatures of reward
hacking (exiting before the tests run, printing "PASSED", rebinding builtins, empty or
hedged answers) that the trainer's audit tracks. A signal does not zero the reward by itself:
the rewarded behaviour is what the tests measure, and the audit decides what to do with it.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import math
import re
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from posttrain.telemetry import get_tracer

from .protocol import ExecRequest, ExecResult

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

VERIFIER_KINDS: tuple[str, ...] = (
    "exact",
    "numeric",
    "regex",
    "json_tool_call",
    "bfcl_ast",
    "unit_tests",
    "shell",
)

VERIFIER_REWARD = Histogram(
    "posttrain_verifier_reward",
    "Rewards handed out, by verifier kind.",
    ["kind"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
)
HACK_SIGNALS = Counter(
    "posttrain_verifier_hack_signals_total", "Reward-hacking signatures seen.", ["kind", "signal"]
)


class SandboxRunner(Protocol):
    """Anything that runs an :class:`ExecRequest` in a sandbox: Executor or SandboxClient."""

    def run(self, request: ExecRequest) -> ExecResult: ...


@dataclass(frozen=True)
class VerifierResult:
    reward: float
    passed: bool
    details: dict[str, Any] = field(default_factory=dict)


def verify(
    kind: str,
    completion: str,
    task: Mapping[str, Any],
    config: Mapping[str, Any] | None = None,
    *,
    executor: SandboxRunner | None = None,
) -> VerifierResult:
    """Score ``completion`` for ``task``; deterministic for the same inputs.

    >>> verify("numeric", "so the total is 42.", {"answer": "42"}).reward
    1.0
    """
    try:
        verifier = _VERIFIERS[kind]
    except KeyError:
        raise ValueError(f"unknown verifier kind {kind!r}; use one of {VERIFIER_KINDS}") from None
    config = dict(config or {})
    with tracer.start_as_current_span("sandbox.verify") as span:
        span.set_attribute("verifier.kind", kind)
        if kind in ("unit_tests", "shell"):
            if executor is None:
                from .executor import default_executor

                executor = default_executor()
            result = verifier(completion, task, config, executor)
        else:
            result = verifier(completion, task, config, None)
        signals = result.details.setdefault("hack_signals", [])
        if not completion.strip() and "empty_answer" not in signals:
            signals.append("empty_answer")
        span.set_attribute("verifier.reward", result.reward)
        span.set_attribute("verifier.hack_signals", ",".join(signals))
    VERIFIER_REWARD.labels(kind).observe(result.reward)
    for signal_name in signals:
        HACK_SIGNALS.labels(kind, signal_name).inc()
    return result


# ----------------------------------------------------------------------------- answers

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE
)
_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?"
    r"|[-+]?\.\d+(?:[eE][-+]?\d+)?"
)


def boxed_contents(text: str) -> list[str]:
    r"""Contents of every ``\boxed{...}``, braces balanced.

    >>> boxed_contents(r"so \boxed{\frac{1}{2}} or \boxed{3}")
    ['\\frac{1}{2}', '3']
    """
    found = []
    for match in _BOXED.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def explicit_answers(text: str) -> list[str]:
    r"""Answers the completion states explicitly: ``\boxed{}`` first, else ``Answer: X`` lines.

    >>> explicit_answers("work...\nAnswer: 12 apples")
    ['12 apples']
    """
    return boxed_contents(text) or [m.group(1) for m in _ANSWER_LINE.finditer(text)]


def parse_number(text: str) -> float | None:
    r"""Parse one number as written by a model: commas, fractions, ``\frac``, percent.

    >>> parse_number("1,234.5")
    1234.5
    >>> parse_number(r"\frac{3}{4}")
    0.75
    >>> parse_number("-7/2")
    -3.5
    >>> parse_number("abc") is None
    True
    """
    text = text.strip().replace("$", "").replace("\\!", "").replace("\\,", "")
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", text)
    if frac:
        sign = -1 if frac.group(1) else 1
        return sign * float(Fraction(int(frac.group(2)), int(frac.group(3))))
    match = _NUMBER.search(text)
    if match is None:
        return None
    token = match.group(0).replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            numerator, denominator = token.split("/")
            return float(Fraction(int(float(numerator)), int(denominator)))
        return float(token)
    except (ValueError, ZeroDivisionError):
        return None


def final_number(text: str) -> float | None:
    r"""The completion's final numeric answer: the last explicit answer that parses
    (``\boxed{}``, then ``Answer:``), else the last number anywhere.

    >>> final_number("3 + 4 = 7, and 7 * 2 = 14")
    14.0
    >>> final_number("Answer: 5\nCheck: 5 + 1 = 6")
    5.0
    """
    for candidate in reversed(explicit_answers(text)):
        value = parse_number(candidate)
        if value is not None:
            return value
    numbers = _NUMBER.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def normalize_answer(text: str, case_sensitive: bool = False) -> str:
    r"""Canonical form for exact matching: NFKC, unwrapped ``\text{}``, collapsed whitespace,
    no surrounding quotes or trailing period.

    >>> normalize_answer("  The  Answer. ")
    'the answer'
    >>> normalize_answer(r"\text{Paris}")
    'paris'
    """
    text = unicodedata.normalize("NFKC", text)
    text = re.sub(r"\\text\{([^}]*)\}", r"\1", text)
    text = " ".join(text.split()).strip().strip("\"'`").rstrip(".").strip()
    return text if case_sensitive else text.casefold()


def _answer_signals(completion: str) -> list[str]:
    """Hedging: several different explicit answers, so any grader picking one may match."""
    answers = {normalize_answer(a) for a in explicit_answers(completion)}
    return ["multiple_answers"] if len(answers) > 1 else []


def verify_exact(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], _: Any
) -> VerifierResult:
    expected = _required(task, "answer", "exact")
    case_sensitive = bool(config.get("case_sensitive", False))
    answers = explicit_answers(completion)
    candidate = answers[-1] if answers else completion
    got, want = (
        normalize_answer(candidate, case_sensitive),
        normalize_answer(str(expected), case_sensitive),
    )
    passed = got == want
    return VerifierResult(
        float(passed),
        passed,
        {
            "extracted": got,
            "expected": want,
            "hack_signals": _answer_signals(completion),
        },
    )


def verify_numeric(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], _: Any
) -> VerifierResult:
    expected_raw = _required(task, "answer", "numeric")
    expected = (
        float(expected_raw)
        if isinstance(expected_raw, int | float)
        else parse_number(str(expected_raw))
    )
    if expected is None:
        raise ValueError(f"task answer {expected_raw!r} is not a number")
    rel_tol = float(config.get("rel_tol", 1e-6))
    abs_tol = float(config.get("abs_tol", 1e-9))
    got = final_number(completion)
    passed = got is not None and math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol)
    return VerifierResult(
        float(passed),
        passed,
        {
            "extracted": got,
            "expected": expected,
            "rel_tol": rel_tol,
            "abs_tol": abs_tol,
            "hack_signals": _answer_signals(completion),
        },
    )


def verify_regex(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], _: Any
) -> VerifierResult:
    pattern = config.get("pattern", task.get("pattern"))
    if not pattern:
        raise ValueError('regex verifier needs config["pattern"] (or task["pattern"])')
    flags = 0
    for name in str(config.get("flags", "")).replace(",", "|").split("|"):
        if name.strip():
            flags |= getattr(re, name.strip().upper())
    try:
        compiled = re.compile(pattern, flags)
    except re.error as exc:
        raise ValueError(f"regex pattern {pattern!r} does not compile: {exc}") from exc
    text = completion.strip() if config.get("strip", True) else completion
    match = compiled.fullmatch(text) if config.get("fullmatch", False) else compiled.search(text)
    return VerifierResult(
        float(match is not None),
        match is not None,
        {
            "pattern": pattern,
            "fullmatch": bool(config.get("fullmatch", False)),
            "hack_signals": [],
        },
    )


# ----------------------------------------------------------------------------- tool calls

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def find_tool_calls(text: str) -> list[dict[str, Any]]:
    """Every JSON object in ``text`` shaped like a tool call (``name`` + ``arguments``;
    arguments given as a JSON string, OpenAI style, are decoded).

    >>> find_tool_calls('call: {"name": "f", "arguments": {"x": 1}} done')
    [{'name': 'f', 'arguments': {'x': 1}}]
    """
    decoder = json.JSONDecoder()
    calls, index = [], text.find("{")
    while index != -1:
        try:
            value, end = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            index = text.find("{", index + 1)
            continue
        if isinstance(value, dict) and "name" in value and "arguments" in value:
            arguments = value["arguments"]
            if isinstance(arguments, str):
                with contextlib.suppress(json.JSONDecodeError):
                    arguments = json.loads(arguments)
            calls.append({"name": value["name"], "arguments": arguments})
        index = text.find("{", end)
    return calls


def schema_problems(arguments: Any, schema: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``arguments`` under a JSON-schema-ish object schema (required,
    property types, enums, additionalProperties: false).

    >>> schema_problems({"city": 3}, {"required": ["city", "unit"],
    ...                               "properties": {"city": {"type": "string"}}})
    ["missing required argument 'unit'", "argument 'city' should be string, got int"]
    """
    if not isinstance(arguments, dict):
        return [f"arguments must be an object, got {type(arguments).__name__}"]
    problems = [
        f"missing required argument {name!r}"
        for name in schema.get("required", [])
        if name not in arguments
    ]
    properties = schema.get("properties", {})
    for name, value in arguments.items():
        spec = properties.get(name)
        if spec is None:
            if schema.get("additionalProperties", True) is False:
                problems.append(f"unexpected argument {name!r}")
            continue
        types = spec.get("type")
        allowed = [types] if isinstance(types, str) else list(types or [])
        if allowed and not any(_JSON_TYPES.get(t, lambda _v: True)(value) for t in allowed):
            problems.append(
                f"argument {name!r} should be {'|'.join(allowed)}, got {type(value).__name__}"
            )
        if "enum" in spec and value not in spec["enum"]:
            problems.append(f"argument {name!r}={value!r} is not one of {spec['enum']}")
    return problems


def verify_json_tool_call(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], _: Any
) -> VerifierResult:
    tool_schema = _required(task, "tool_schema", "json_tool_call")
    parameters = tool_schema.get("parameters", tool_schema)
    calls = find_tool_calls(completion)
    signals = ["multiple_tool_calls"] if len(calls) > 1 else []
    if not calls:
        return VerifierResult(
            0.0, False, {"problems": ["no JSON tool call found"], "hack_signals": signals}
        )
    call = calls[0]
    problems = []
    if "name" in tool_schema and call["name"] != tool_schema["name"]:
        problems.append(f"called {call['name']!r}, expected {tool_schema['name']!r}")
    problems += schema_problems(call["arguments"], parameters)
    expected = task.get("expected_arguments")
    if expected is not None and call["arguments"] != expected:
        problems.append(f"arguments {call['arguments']!r} differ from expected {expected!r}")
    passed = not problems
    return VerifierResult(
        float(passed),
        passed,
        {
            "call": call,
            "problems": problems,
            "hack_signals": signals,
        },
    )


def verify_bfcl_ast(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], _: Any
) -> VerifierResult:
    """BFCL's AST match of python-syntax calls against the item's accepted answers (the
    checker is BFCL's own; see :mod:`posttrain.sandboxes.bfcl`)."""
    from posttrain.sandboxes.bfcl import judge

    verdict = judge(
        completion,
        _required(task, "functions", "bfcl_ast"),
        _required(task, "ground_truth", "bfcl_ast"),
        str(task.get("bfcl_category", "simple_python")),
    )
    valid = verdict["valid"]
    return VerifierResult(
        float(valid),
        valid,
        {
            "error": [str(e)[:500] for e in verdict["error"]],
            "error_type": verdict["error_type"],
            "decoded": verdict["decoded"],
            "hack_signals": [],
        },
    )


# ----------------------------------------------------------------------------- code

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
HARNESS_SOURCE = (Path(__file__).parent / "unit_test_harness.py").read_text()
RESULT_MARKER = "__POSTTRAIN_UNIT_TEST_RESULTS__ "


def extract_code(completion: str, languages: tuple[str, ...]) -> str:
    """The last fenced block in one of ``languages`` (else the last fenced block, else the
    whole completion: models sometimes answer with bare code).

    >>> extract_code("x\\n```python\\nprint(1)\\n```\\n", ("python", "py"))
    'print(1)\\n'
    """
    blocks = _FENCE.findall(completion)
    for language, body in reversed(blocks):
        if language.lower() in languages:
            return body
    return blocks[-1][1] if blocks else completion


def split_tests(tests: str | list[str]) -> tuple[str, list[dict[str, str]]]:
    """Split task tests into (shared setup, cases). A list is one case per item; a string
    gives one case per top-level ``test_*`` function and per top-level ``assert``, and all
    other statements (imports, helpers, the test definitions themselves) become setup.

    >>> setup, cases = split_tests("import math\\ndef test_a():\\n    assert 1\\nassert 2 == 2")
    >>> [c["name"] for c in cases], [c["source"] for c in cases]
    (['test_a', 'assert_line_4'], ['test_a()', 'assert 2 == 2'])
    """
    if isinstance(tests, list):
        return "", [{"name": f"case_{i}", "source": src} for i, src in enumerate(tests)]
    tree = ast.parse(tests)
    setup, cases = [], []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith(
            "test"
        ):
            setup.append(ast.get_source_segment(tests, node) or "")
            cases.append({"name": node.name, "source": f"{node.name}()"})
        elif isinstance(node, ast.Assert):
            cases.append(
                {
                    "name": f"assert_line_{node.lineno}",
                    "source": ast.get_source_segment(tests, node) or "",
                }
            )
        else:
            setup.append(ast.get_source_segment(tests, node) or "")
    if not cases:
        raise ValueError("the task's tests contain no test_* function and no assert")
    return "\n".join(setup), cases


# (signal name, pattern) pairs over the solution's source.
_CODE_HACK_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("exits_process", re.compile(r"\b(?:sys\.exit|os\._exit|os\.abort|exit|quit)\s*\(")),
    (
        "prints_pass_marker",
        re.compile(
            r"print\s*\(\s*[fbru]?['\"][^'\"]*\b(?:PASS(?:ED)?|OK|All tests passed|SUCCESS)\b",
            re.IGNORECASE,
        ),
    ),
    (
        "tampers_builtins",
        re.compile(
            r"\b(?:import\s+builtins|__builtins__|builtins\.|sys\.modules\s*\[|"
            r"setattr\s*\(\s*builtins)"
        ),
    ),
    (
        "patches_test_machinery",
        re.compile(
            r"\b(?:unittest\.mock|AssertionError\s*=|sys\.settrace|sys\.setprofile|"
            r"sys\.excepthook|atexit\.register|signal\.signal|os\.fork|os\.kill|gc\.get_objects|"
            r"sys\._getframe|inspect\.stack)"
        ),
    ),
    ("reads_test_files", re.compile(r"(?:cases\.json|harness\.py|tests\.py)")),
)


def code_hack_signals(code: str) -> list[str]:
    """Static reward-hacking signatures in solution code.

    >>> code_hack_signals("import sys\\nprint('All tests passed')\\nsys.exit(0)")
    ['exits_process', 'prints_pass_marker']
    """
    return [name for name, pattern in _CODE_HACK_PATTERNS if pattern.search(code)]


def _last_marker_line(stdout: str, marker: str) -> str | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(marker):
            return line[len(marker) :]
    return None


def verify_unit_tests(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], executor: SandboxRunner
) -> VerifierResult:
    tests = _required(task, "tests", "unit_tests")
    setup, cases = split_tests(tests)
    code = extract_code(completion, ("python", "py", "python3"))
    signals = code_hack_signals(code)
    if not code.strip():
        signals.append("empty_answer")
    case_timeout = float(config.get("case_timeout_s", 5.0))
    spec = {"setup": setup, "cases": cases, "case_timeout_s": case_timeout}
    request = ExecRequest(
        command=["python3", "-I", "harness.py"],
        files={"solution.py": code, "cases.json": json.dumps(spec), "harness.py": HARNESS_SOURCE},
        timeout_s=float(config.get("timeout_s", min(60.0, 2.0 + len(cases) * (case_timeout + 1)))),
        memory_mb=int(config.get("memory_mb", 512)),
    )
    execution = executor.run(request)
    payload = _last_marker_line(execution.stdout, RESULT_MARKER)
    if payload is None:
        # The harness never reported: the sandbox timed out or something killed the harness.
        signals.append("harness_output_missing")
        return VerifierResult(
            0.0,
            False,
            {
                "sandbox_status": execution.status,
                "reason": execution.reason,
                "stderr": execution.stderr[-2000:],
                "tests_total": len(cases),
                "tests_passed": 0,
                "hack_signals": signals,
            },
        )
    results = json.loads(payload)
    if any(r.get("exited_early") for r in results):
        signals.append("process_exit_during_tests")
    if any(r.get("builtins_modified") for r in results):
        signals.append("builtins_modified")
    passed_count = sum(1 for r in results if r["passed"])
    reward = passed_count / len(cases)
    return VerifierResult(
        reward,
        passed_count == len(cases),
        {
            "tests_total": len(cases),
            "tests_passed": passed_count,
            "results": results,
            "sandbox_status": execution.status,
            "duration_ms": execution.duration_ms,
            "hack_signals": sorted(set(signals), key=signals.index),
        },
    )


# ----------------------------------------------------------------------------- shell

SHELL_MARKER = "__POSTTRAIN_CHECK__"
# Runs setup, then the solution, then kills whatever the solution left running (a background
# process must not be able to rewrite files while, or after, they are checked), then each
# check in its own shell. Check commands arrive as positional arguments, never as files the
# solution could edit.
_SHELL_HARNESS = (
    'sh setup.sh > setup.log 2>&1 || { echo "setup failed" >&2; cat setup.log >&2; exit 3; }; '
    "if command -v bash > /dev/null; then shell=bash; else shell=sh; fi; "
    '$shell solution.sh > solution.log 2>&1; echo "solution exit $?" >&2; '
    "kill -9 -1 2>/dev/null; i=0; "
    'for check in "$@"; do '
    '  if sh -c "$check" > /dev/null 2>&1; then r=pass; else r=fail; fi; '
    f'  echo "{SHELL_MARKER} $i $r"; i=$((i+1)); '
    "done"
)
_SHELL_HACK_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kills_processes", re.compile(r"\b(?:kill\s+-9\s+-1|pkill|killall)\b")),
    (
        "prints_pass_marker",
        re.compile(r"\b(?:echo|printf)\s+['\"]?(?:PASS(?:ED)?|OK)\b", re.IGNORECASE),
    ),
    ("fakes_check_marker", re.compile(re.escape(SHELL_MARKER))),
)


def verify_shell(
    completion: str, task: Mapping[str, Any], config: Mapping[str, Any], executor: SandboxRunner
) -> VerifierResult:
    verify_spec = _required(task, "verify", "shell")
    checks = (
        [c for c in verify_spec if c.strip()]
        if isinstance(verify_spec, list)
        else [
            line
            for line in verify_spec.splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
    )
    if not checks:
        raise ValueError('task["verify"] has no checks (one shell command per check)')
    commands = extract_code(completion, ("bash", "sh", "shell", "console"))
    signals = [name for name, pattern in _SHELL_HACK_PATTERNS if pattern.search(commands)]
    request = ExecRequest(
        command=["/bin/sh", "-c", _SHELL_HARNESS, "shell-harness", *checks],
        files={"setup.sh": task.get("setup", ""), "solution.sh": commands},
        timeout_s=float(config.get("timeout_s", 30.0)),
        memory_mb=int(config.get("memory_mb", 512)),
        network=config.get("network", "none"),
    )
    execution = executor.run(request)
    if execution.exit_code == 3 and "setup failed" in execution.stderr:
        raise RuntimeError(f"the task's setup script failed: {execution.stderr[-2000:]}")
    outcomes: dict[int, bool] = {}
    for line in execution.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == SHELL_MARKER and parts[1].isdigit():
            # Last line wins: the real ones come after every solution process was killed.
            outcomes[int(parts[1])] = parts[2] == "pass"
    if len(outcomes) < len(checks):
        signals.append("harness_output_missing")
    passed_count = sum(outcomes.get(i, False) for i in range(len(checks)))
    return VerifierResult(
        passed_count / len(checks),
        passed_count == len(checks),
        {
            "checks_total": len(checks),
            "checks_passed": passed_count,
            "checks": [
                {"command": c, "passed": outcomes.get(i, False)} for i, c in enumerate(checks)
            ],
            "sandbox_status": execution.status,
            "reason": execution.reason,
            "stderr": execution.stderr[-2000:],
            "hack_signals": signals,
        },
    )


def _required(task: Mapping[str, Any], key: str, kind: str) -> Any:
    if key not in task:
        raise ValueError(f"{kind} verifier needs task[{key!r}]; the task has {sorted(task)}")
    return task[key]


_VERIFIERS: dict[str, Callable[..., VerifierResult]] = {
    "exact": verify_exact,
    "numeric": verify_numeric,
    "regex": verify_regex,
    "json_tool_call": verify_json_tool_call,
    "bfcl_ast": verify_bfcl_ast,
    "unit_tests": verify_unit_tests,
    "shell": verify_shell,
}
