"""Tool calling from the Berkeley Function Calling Leaderboard (BFCL v4), judged by BFCL.

In ``sandboxes/`` beside the other verifiers (``bfcl_ast`` in verifiers.py is this judge);
the environments (``envs/function_calling.py``) and the trainer's datasets read its data
from here, the layers above.

The data and the judge come from the PyPI wheel ``bfcl-eval==2026.3.23`` (installed with
``--no-deps`` by ``make venv``: its declared dependencies pin numpy 1.26 and pull in every
API vendor's SDK, none of which the data or the AST checker need). Nothing here is our
reimplementation of the benchmark's semantics where BFCL's own code can be used:

* the prompt is BFCL's default system prompt (python call format, JSON function docs, the
  "classic" style) built from ``bfcl_eval.constants.default_prompts``;
* the judge is ``bfcl_eval.eval_checker.ast_eval.ast_checker`` itself, loaded with one shim
  (see :func:`bfcl_ast_checker`);
* decoding a reply into calls follows BFCL's ``default_decode_ast_prompting`` line by line,
  except that it never ``eval``s model output (BFCL does, for arithmetic and lambdas).

Single-turn categories: ``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``
(BFCL's expert-written items) and their ``live_`` counterparts (user-contributed functions
and questions, same call format and checker).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import operator
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.errors import UsageError

CATEGORIES: tuple[str, ...] = ("simple_python", "multiple", "parallel", "parallel_multiple")
LIVE_CATEGORIES: tuple[str, ...] = (
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
ALL_CATEGORIES: tuple[str, ...] = CATEGORIES + LIVE_CATEGORIES
# Curriculum strata, easiest first: one function; one of several; several calls of one;
# several calls of several.
CATEGORY_STRATUM: dict[str, str] = {
    "simple_python": "easy",
    "multiple": "medium",
    "parallel": "hard",
    "parallel_multiple": "hard",
    "live_simple": "easy",
    "live_multiple": "medium",
    "live_parallel": "hard",
    "live_parallel_multiple": "hard",
}
# Items whose shipped ``possible_answer`` BFCL's own checker rejects, so no reply can pass:
# a required parameter with no accepted value (live_simple_106-63-0, live_simple_112-68-0,
# live_multiple_507-149-4, live_multiple_964-207-0: the answer names ``question`` where the
# function requires ``statement``) or an answer parameter the function does not declare
# (live_multiple_862-181-3). Left out of the task records; tests/envs/test_bfcl.py checks
# that exactly these fail, so a fixed BFCL release shows up there.
BFCL_DATA_DEFECTS: frozenset[str] = frozenset(
    {
        "live_simple_106-63-0",
        "live_simple_112-68-0",
        "live_multiple_507-149-4",
        "live_multiple_862-181-3",
        "live_multiple_964-207-0",
    }
)
INSTALL_HINT = (
    "install the BFCL data with `uv pip install --no-deps bfcl-eval==2026.3.23` (`make venv` does)"
)
CHECKER_MODEL_NAME = "posttrain"
PYTHON_HINT = " Note that the provided function is in Python 3 syntax."


class ToolCallParseError(ValueError):
    """The reply is not a list of python calls; the message says where parsing stopped."""


def bfcl_package_dir() -> Path:
    """Where ``bfcl_eval`` is installed (found without importing it)."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"BFCL data is not installed: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_category(category: str) -> list[dict[str, Any]]:
    """BFCL items of one category, each with its ``ground_truth`` (the accepted answers)."""
    if category not in ALL_CATEGORIES:
        raise UsageError(f"unknown BFCL category {category!r}; use one of {ALL_CATEGORIES}")
    data = bfcl_package_dir() / "data"
    items = _read_jsonl(data / f"BFCL_v4_{category}.json")
    answers = {
        a["id"]: a["ground_truth"]
        for a in _read_jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")
    }
    missing = [item["id"] for item in items if item["id"] not in answers]
    if missing:
        raise UsageError(f"BFCL {category}: no possible_answer for {missing[:5]}")
    return [{**item, "category": category, "ground_truth": answers[item["id"]]} for item in items]


# --------------------------------------------------------------------------- prompt


def functions_for_prompt(functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL's python pre-processing of function docs: the language hint on descriptions."""
    return [{**f, "description": f["description"] + PYTHON_HINT} for f in functions]


def system_prompt(functions: list[dict[str, Any]]) -> str:
    """BFCL's default system prompt (``ret_fmt=python&tool_call_tag=False&func_doc_fmt=json
    &prompt_fmt=plaintext&style=classic``), from BFCL's own template strings."""
    bfcl_package_dir()
    from bfcl_eval.constants import default_prompts as p

    style = p.PROMPT_STYLE_TEMPLATES["classic"]
    tool_call_format = style["tool_call_no_tag"].format(
        output_format=p.OUTPUT_FORMAT_MAPPING["python"], param_types=p.PARAM_TYPE_MAPPING["python"]
    )
    available = style["available_tools"].format(
        format="json", functions=json.dumps(functions_for_prompt(functions), indent=4)
    )
    return p.PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=style["persona"],
        task=style["task"],
        tool_call_format=tool_call_format,
        multiturn_behavior=style["multiturn_behavior"],
        available_tools=available,
    )


def item_messages(item: dict[str, Any]) -> list[dict[str, str]]:
    """The chat BFCL sends: its system prompt, then the item's (single-turn) messages. A
    system message of the item's own is appended to BFCL's, as BFCL does."""
    messages = [dict(m) for m in item["question"][0]]
    system = system_prompt(item["function"])
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = system + "\n\n" + messages[0]["content"]
        return messages
    return [{"role": "system", "content": system}, *messages]


def canonical_answer(
    ground_truth: list[dict[str, Any]], functions: list[dict[str, Any]] | None = None
) -> str:
    """One reply BFCL accepts: each call with the first accepted value of every argument;
    arguments that may be omitted (options include "") are left out unless ``functions``
    marks them required (a few BFCL items accept "" for a required argument, which the
    checker then rejects as missing). Nested dicts hold options per key and resolve alike.

    >>> canonical_answer([{"math.hypot": {"x": [4], "y": [5], "z": ["", 0]}}])
    '[math.hypot(x=4, y=5)]'
    >>> canonical_answer([{"f": {"d": [{"k": ["a", "A"], "o": ["", 1]}]}}])
    "[f(d={'k': 'a'})]"
    """
    required = {
        f["name"]: set(f.get("parameters", {}).get("required", [])) for f in functions or []
    }
    calls = []
    for call in ground_truth:
        ((name, arguments),) = call.items()
        parts = []
        for key, options in arguments.items():
            given = [o for o in options if o != ""]
            if given and ("" not in options or key in required.get(name, ())):
                parts.append(f"{key}={_accepted_value(given[0])!r}")
        calls.append(f"{name}({', '.join(parts)})")
    return "[" + ", ".join(calls) + "]"


def _accepted_value(option: Any) -> Any:
    """The first accepted value of one option. A dict whose values are all lists holds
    options per key (resolved recursively); any other dict is itself the accepted literal
    (BFCL's ``live_multiple_121-46-0`` accepts ``{'lateral': 10.5, 'longitudinal': 50}``).

    >>> _accepted_value({"k": ["a"], "o": ["", 1]})
    {'k': 'a'}
    >>> _accepted_value({"lateral": 10.5, "longitudinal": 50})
    {'lateral': 10.5, 'longitudinal': 50}
    """
    if isinstance(option, dict):
        if not all(isinstance(v, list) for v in option.values()):
            return option
        return {
            key: _accepted_value(options[0])
            for key, options in option.items()
            if options and "" not in options
        }
    if isinstance(option, list):
        return [_accepted_value(v) if isinstance(v, dict) else v for v in option]
    return option


# --------------------------------------------------------------------------- decoding

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def decode_calls(reply: str) -> list[dict[str, dict[str, Any]]]:
    """BFCL's ``default_decode_ast_prompting`` for python: ``[f(a=1), g.h(b='x')]`` ->
    ``[{"f": {"a": 1}}, {"g.h": {"b": "x"}}]``; raises :class:`ToolCallParseError`.

    >>> decode_calls("[math.hypot(x=4, y=5)]")
    [{'math.hypot': {'x': 4, 'y': 5}}]
    >>> decode_calls("```\\nf(a=[1, -2], b={'k': 2 * 3})\\n```")
    [{'f': {'a': [1, -2], 'b': {'k': 6}}}]
    """
    text = reply.strip("`\n ")
    if not text.startswith("["):
        text = "[" + text
    if not text.endswith("]"):
        text = text + "]"
    try:
        parsed = ast.parse(text.strip().strip("'"), mode="eval")
    except SyntaxError as exc:
        raise ToolCallParseError(
            f"not python call syntax: {exc.msg} (line {exc.lineno}, column {exc.offset})"
        ) from None
    body = parsed.body
    if isinstance(body, ast.Call):
        return [_resolve_call(body)]
    if not isinstance(body, ast.List | ast.Tuple):
        raise ToolCallParseError(f"expected a list of calls, got {type(body).__name__}")
    calls = []
    for element in body.elts:
        if not isinstance(element, ast.Call):
            raise ToolCallParseError(f"expected a function call, got {ast.unparse(element)[:80]!r}")
        calls.append(_resolve_call(element))
    return calls


def _resolve_call(node: ast.Call) -> dict[str, dict[str, Any]]:
    parts: list[str] = []
    func: ast.expr = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    name = ".".join(reversed(parts))
    return {name: {kw.arg: _resolve_value(kw.value) for kw in node.keywords if kw.arg is not None}}


def _resolve_value(node: ast.expr) -> Any:
    """BFCL's ``resolve_ast_by_type``, arithmetic folded without ``eval``."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        value = node.operand.value
        if isinstance(node.op, ast.USub) and isinstance(value, int | float):
            return -value
        if isinstance(node.op, ast.UAdd) and isinstance(value, int | float):
            return value
    if isinstance(node, ast.List):
        return [_resolve_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_resolve_value(v) for v in node.elts)
    if isinstance(node, ast.Dict):
        return {
            _resolve_value(k): _resolve_value(v)
            for k, v in zip(node.keys, node.values, strict=True)
            if k is not None
        }
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _resolve_value(node.left), _resolve_value(node.right)
        if isinstance(left, int | float) and isinstance(right, int | float):
            try:
                return _BINARY[type(node.op)](left, right)
            except (ArithmeticError, ValueError) as exc:
                raise ToolCallParseError(f"{ast.unparse(node)}: {exc}") from None
        raise ToolCallParseError(f"arithmetic on non-numbers: {ast.unparse(node)[:80]!r}")
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return ast.unparse(node) if not node.keywords else _resolve_call(node)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node.value) + "[" + ast.unparse(node.slice) + "]"
    raise ToolCallParseError(f"unsupported argument value {ast.unparse(node)[:80]!r}")


def is_call_list(decoded: Any) -> bool:
    """BFCL's ``is_function_calling_format_output``: ``[{name: {arg: value}}, ...]``."""
    return isinstance(decoded, list) and all(
        isinstance(item, dict) and len(item) == 1 and isinstance(next(iter(item.values())), dict)
        for item in decoded
    )


# --------------------------------------------------------------------------- judging


class _AnyModelConfig(dict[str, Any]):
    """Stands in for BFCL's model registry: every model name keeps dots in function names."""

    def __missing__(self, key: str) -> Any:
        return types.SimpleNamespace(underscore_to_dot=False)


@functools.cache
def bfcl_ast_checker() -> Callable[..., dict[str, Any]]:
    """BFCL's ``ast_checker``, loaded with one shim.

    ``ast_checker.py`` imports ``bfcl_eval.constants.model_config`` only to look up whether a
    model's API replaced dots in function names by underscores; that module imports every
    vendor's client (openai, anthropic, cohere, ...). We register a stand-in module whose
    registry answers "no" for any model before importing the checker; the checker code that
    runs is BFCL's, unchanged. (A process that had already imported the real registry keeps
    it.)
    """
    bfcl_package_dir()
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:
        shim = types.ModuleType(name)
        shim.MODEL_CONFIG_MAPPING = _AnyModelConfig()  # type: ignore[attr-defined]
        sys.modules[name] = shim
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker  # type: ignore[no-any-return]


def judge(
    reply: str, functions: list[dict[str, Any]], ground_truth: list[dict[str, Any]], category: str
) -> dict[str, Any]:
    """BFCL's verdict on one reply: ``{"valid": bool, "error": [...], "error_type": str,
    "decoded": calls or None}``; a reply that does not decode is invalid (as in BFCL)."""
    try:
        decoded: Any = decode_calls(reply)
    except ToolCallParseError as exc:
        return {
            "valid": False,
            "error": [str(exc)],
            "error_type": "ast_decoder:decoder_failed",
            "decoded": None,
        }
    if not is_call_list(decoded):
        return {
            "valid": False,
            "error": ["not a list of function calls"],
            "error_type": "ast_decoder:decoder_wrong_output_format",
            "decoded": None,
        }
    from bfcl_eval.constants.enums import Language

    verdict = bfcl_ast_checker()(
        functions, decoded, ground_truth, Language.PYTHON, category, CHECKER_MODEL_NAME
    )
    return {
        "valid": bool(verdict["valid"]),
        "error": list(verdict.get("error", [])),
        "error_type": verdict.get("error_type", ""),
        "decoded": decoded,
    }


# --------------------------------------------------------------------------- tasks


def task_records(category: str) -> list[dict[str, Any]]:
    """Task records (the trainer's JSONL shape) for one category. ``messages`` is the chat
    BFCL sends (its system prompt as the system message), which the function-calling
    environment plays; ``prompt`` is the same text as one string (system prompt, blank line,
    question) for single-turn use and the content-hash split. The judge reads ``functions``
    and ``ground_truth``."""
    records = []
    for item in load_category(category):
        if item["id"] in BFCL_DATA_DEFECTS:
            continue
        messages = item_messages(item)
        prompt = "\n\n".join(m["content"] for m in messages)
        records.append(
            {
                "prompt": prompt,
                "answer": canonical_answer(item["ground_truth"], item["function"]),
                "difficulty": CATEGORY_STRATUM[category],
                "verifier": "bfcl_ast",
                "bfcl_id": item["id"],
                "bfcl_category": category,
                "functions": item["function"],
                "ground_truth": item["ground_truth"],
                "messages": messages,
            }
        )
    return records
