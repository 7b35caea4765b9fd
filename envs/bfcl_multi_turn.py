"""BFCL multi-turn as a stateful environment: BFCL's executable backends, BFCL's checks.

``BFCL_v4_multi_turn_base`` (200 items) gives a conversation of user turns, the initial
state of a few API classes (a file system, a trading bot, a messaging app, ...) whose
Python sources ship in ``bfcl_eval/eval_checker/multi_turn_eval/func_source_code``, and per
user turn the ground-truth calls. An episode plays it as BFCL's prompting-mode inference
does (``model_handler/base_handler.py``):

* the system prompt is BFCL's default one with the function docs of the involved classes
  (``data/multi_turn_func_doc``); the first user turn follows;
* each model reply is decoded as python calls (BFCL's decoder, see :mod:`.bfcl`); the calls
  run on *this episode's own* instances of the backend classes and the results come back
  as the next observation; a reply that decodes to no call ends the user turn (BFCL:
  "Proceed to next turn"), as does the 21st step of a turn (BFCL's ``MAXIMUM_STEP_LIMIT``);
* at the end of every user turn the turn is judged as BFCL's ``multi_turn_checker`` judges
  it: the turn's ground-truth calls run on a second set of instances (carried across turns),
  then BFCL's own ``state_checker`` (every public attribute of every instance equal) and
  ``response_checker`` (the ground truth's results are contained in all the model's results
  so far) decide. A failing turn ends the episode with reward 0 and BFCL's error; when the
  last turn passes the reward is 1.

What differs from BFCL, on purpose: BFCL ``eval``s the call strings, keeps instances in a
module's globals keyed by model name and test id (so two episodes of one item in a process
would share state) and checks ``kill``/``exit``-like names by hand. Here a call is resolved
to a public method of this episode's instances and invoked with literal arguments only, so
model output never reaches ``eval`` and concurrent episodes never share state. A name that
is not a method gives BFCL's own error text (``name 'x' is not defined``).
``tests/envs/test_bfcl_multi_turn.py`` replays the ground truth of all 200 items through this
environment and through BFCL's ``multi_turn_checker`` itself and compares the verdicts.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import json
from typing import Any

from posttrain.envs.base import EnvFailure, StepResult
from posttrain.envs.task import Task
from posttrain.errors import UsageError
from posttrain.sandboxes import bfcl

CATEGORY = "multi_turn_base"
MAX_STEPS_PER_TURN = 20  # BFCL's MAXIMUM_STEP_LIMIT: the 21st step of a turn ends it
# BFCL refuses these names before eval (multi_turn_utils.execute_multi_turn_func_call).
FORBIDDEN_NAMES = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")


@functools.cache
def _backend_config() -> tuple[dict[str, str], dict[str, str], tuple[str, ...]]:
    """BFCL's class -> module and class -> function-doc file maps, stateless classes."""
    bfcl.bfcl_package_dir()
    from bfcl_eval.constants import executable_backend_config as config

    return (
        dict(config.CLASS_FILE_PATH_MAPPING),
        dict(config.MULTI_TURN_FUNC_DOC_FILE_MAPPING),
        tuple(config.STATELESS_CLASSES),
    )


def function_docs(involved_classes: list[str]) -> list[dict[str, Any]]:
    """The function docs BFCL offers for these classes (``populate_test_cases_with_
    predefined_functions``), in BFCL's order."""
    _, doc_files, _ = _backend_config()
    folder = bfcl.bfcl_package_dir() / "data" / "multi_turn_func_doc"
    docs: list[dict[str, Any]] = []
    for name in involved_classes:
        docs.extend(bfcl._read_jsonl(folder / doc_files[name]))
    return docs


def load_items() -> list[dict[str, Any]]:
    """BFCL's multi_turn_base items, each with its per-turn ``ground_truth`` call strings."""
    data = bfcl.bfcl_package_dir() / "data"
    items = bfcl._read_jsonl(data / f"BFCL_v4_{CATEGORY}.json")
    answers = {
        a["id"]: a["ground_truth"]
        for a in bfcl._read_jsonl(data / "possible_answer" / f"BFCL_v4_{CATEGORY}.json")
    }
    missing = [item["id"] for item in items if item["id"] not in answers]
    if missing:
        raise UsageError(f"BFCL {CATEGORY}: no possible_answer for {missing[:5]}")
    return [{**item, "ground_truth": answers[item["id"]]} for item in items]


def task_records() -> list[dict[str, Any]]:
    """Task records for ``builtin:bfcl_multi_turn_base``. ``prompt`` (what the content-hash
    split keys on) is the item's user turns, one per paragraph; the environment reads the
    rest. Difficulty strata by the number of user turns: easy <= 2, medium 3-4, hard 5+."""
    records = []
    for item in load_items():
        questions = [[dict(m) for m in turn] for turn in item["question"]]
        turns = len(questions)
        records.append(
            {
                "prompt": "\n\n".join(m["content"] for turn in questions for m in turn),
                "difficulty": "easy" if turns <= 2 else "medium" if turns <= 4 else "hard",
                "verifier": "bfcl_multi_turn",
                "bfcl_id": item["id"],
                "bfcl_category": CATEGORY,
                "questions": questions,
                "initial_config": item["initial_config"],
                "involved_classes": list(item["involved_classes"]),
                "ground_truth": item["ground_truth"],
            }
        )
    return records


# --------------------------------------------------------------------------- backends


class Backends:
    """This episode's instances of the involved API classes, and the calls made on them."""

    def __init__(self, initial_config: dict[str, Any], involved_classes: list[str]) -> None:
        modules, _, stateless = _backend_config()
        self.instances: dict[str, Any] = {}
        self.methods: dict[str, Any] = {}
        for name in involved_classes:
            if name not in modules:
                raise EnvFailure(f"BFCL class {name!r} has no executable backend")
            instance = getattr(importlib.import_module(modules[name]), name)()
            if name not in stateless:
                instance._load_scenario(
                    copy.deepcopy(initial_config.get(name, {})), long_context=False
                )
            self.instances[name] = instance
            # As BFCL: every public bound method, by bare name (a later class wins a clash).
            for method_name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not method_name.startswith("_"):
                    self.methods[method_name] = method

    def execute(self, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
        """One call's result as BFCL formats it (str as is, dict as JSON, else ``str``);
        any failure is BFCL's ``Error during execution: ...`` text, never an exception."""
        try:
            bare = name.split(".")[-1]
            if bare in FORBIDDEN_NAMES:
                raise Exception(f"Function call {bare} is not allowed.")
            if bare not in self.methods:
                raise NameError(f"name {bare!r} is not defined")
            result = self.methods[bare](*args, **kwargs)
        except Exception as exc:  # the policy's call failed: an observation, as in BFCL
            return f"Error during execution: {exc}"
        if isinstance(result, str):
            return result
        if isinstance(result, dict):
            try:
                return json.dumps(result)
            except (TypeError, ValueError):
                return str(result)
        return str(result)

    def execute_source(self, call: str) -> str:
        """Run one call written as python source (the ground truth's form, which may pass
        arguments by position), literals only."""
        try:
            node = ast.parse(call.strip(), mode="eval").body
            if not isinstance(node, ast.Call):
                raise bfcl.ToolCallParseError(f"not a call: {call[:80]!r}")
            name = bfcl._resolve_call(node)
            args = [bfcl._resolve_value(a) for a in node.args]
        except (SyntaxError, bfcl.ToolCallParseError) as exc:
            return f"Error during execution: {exc}"
        ((func, kwargs),) = name.items()
        return self.execute(func, args, kwargs)


def keyword_call(call: str, docs: list[dict[str, Any]]) -> str:
    """A ground-truth call with positional arguments rewritten as keywords (BFCL's decoder
    keeps keyword arguments only, so a policy replaying the ground truth must name them).

    >>> keyword_call("sort('a.txt')", [{"name": "sort", "parameters": {"properties":
    ...     {"file_name": {"type": "string"}}}}])
    "sort(file_name='a.txt')"
    """
    node = ast.parse(call.strip(), mode="eval").body
    assert isinstance(node, ast.Call), call
    name = ast.unparse(node.func)
    params = next(
        list(d.get("parameters", {}).get("properties", {})) for d in docs if d["name"] == name
    )
    parts = [f"{params[i]}={ast.unparse(a)}" for i, a in enumerate(node.args)]
    parts += [f"{kw.arg}={ast.unparse(kw.value)}" for kw in node.keywords]
    return f"{name}({', '.join(parts)})"


@functools.cache
def _bfcl_checkers() -> tuple[Any, Any]:
    bfcl.bfcl_package_dir()
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
        response_checker,
        state_checker,
    )

    return state_checker, response_checker


def _call_text(name: str, kwargs: dict[str, Any]) -> str:
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


# --------------------------------------------------------------------------- environment


class BfclMultiTurnEnv:
    """One BFCL multi-turn item (see the module docstring). ``max_turns`` bounds the model
    replies of the whole episode (every step of every user turn)."""

    name = "bfcl_multi_turn"
    observation_role = "user"

    def __init__(self, max_turns: int = 64, max_steps_per_turn: int = MAX_STEPS_PER_TURN) -> None:
        if max_turns < 1 or max_steps_per_turn < 1:
            raise ValueError(
                f"max_turns and max_steps_per_turn must be >= 1, got {max_turns}, "
                f"{max_steps_per_turn}"
            )
        self.max_turns = max_turns
        self.max_steps_per_turn = max_steps_per_turn
        self._task: Task | None = None
        self._docs: list[dict[str, Any]] = []

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(self._docs)

    def reset(self, task: Task) -> list[dict[str, str]]:
        extra = task.extra
        for key in ("questions", "initial_config", "involved_classes", "ground_truth"):
            if key not in extra:
                raise EnvFailure(
                    f"task {task.task_id} has no {key!r}: is it a BFCL multi-turn task "
                    "(dataset builtin:bfcl_multi_turn_base)?"
                )
        if len(extra["questions"]) != len(extra["ground_truth"]):
            raise EnvFailure(f"task {task.task_id}: questions and ground_truth differ in turns")
        self._task = task
        self._docs = function_docs(extra["involved_classes"])
        self.model = Backends(extra["initial_config"], extra["involved_classes"])
        self.truth = Backends(extra["initial_config"], extra["involved_classes"])
        self.user_turn = 0
        self.steps_in_turn = 0
        self.turn_calls: list[str] = []  # calls of the current user turn (for the record)
        self.all_results: list[str] = []  # every model call's result, all turns so far
        self.turn_verdicts: list[dict[str, Any]] = []
        return [
            {"role": "system", "content": bfcl.system_prompt(self._docs)},
            *[dict(m) for m in extra["questions"][0]],
        ]

    def step(self, model_turn: str) -> StepResult:
        assert self._task is not None, "reset() first"
        error: str | None
        try:
            decoded: Any = bfcl.decode_calls(model_turn)
        except bfcl.ToolCallParseError as exc:
            decoded, error = None, str(exc)
        else:
            error = None if bfcl.is_call_list(decoded) else "not a list of function calls"
        if not decoded or error is not None:  # no decodable call: the user turn is over
            return self._end_turn({"tool_calls": 0, "valid_tool_calls": 0, "turn_ended": error})
        self.steps_in_turn += 1
        lines, failed, valid = [], False, 0
        for call in decoded:
            ((name, kwargs),) = call.items()
            result = self.model.execute(name, [], kwargs)
            self.all_results.append(result)
            self.turn_calls.append(_call_text(name, kwargs))
            # BFCL's backends report failures as {"error": ...} results or raise.
            failed = failed or result.startswith(("Error during execution", '{"error"'))
            valid += name.split(".")[-1] in self.model.methods
            lines.append(f"{_call_text(name, kwargs)} -> {result}")
        info = {"tool_calls": len(decoded), "valid_tool_calls": valid, "command_failed": failed}
        if self.steps_in_turn >= self.max_steps_per_turn + 1:
            return self._end_turn({**info, "turn_ended": "step limit"})
        return StepResult("\n".join(lines), 0.0, False, info)

    def _end_turn(self, info: dict[str, Any]) -> StepResult:
        """Judge the user turn that just ended (BFCL's per-turn checks); next turn or done."""
        verdict = self._check_turn()
        self.turn_verdicts.append(verdict)
        self.user_turn += 1
        self.steps_in_turn, self.turn_calls = 0, []
        assert self._task is not None
        questions = self._task.extra["questions"]
        if not verdict["valid"]:
            return StepResult(None, 0.0, True, {**info, **self._final(False)})
        if self.user_turn == len(questions):
            return StepResult(None, 1.0, True, {**info, **self._final(True)})
        nxt = questions[self.user_turn]
        return StepResult("\n\n".join(m["content"] for m in nxt), 0.0, False, info)

    def _check_turn(self) -> dict[str, Any]:
        """BFCL's ``multi_turn_checker`` for one turn: ground truth run on its own
        instances, then an empty turn, the state and the responses are checked."""
        assert self._task is not None
        truth_calls = self._task.extra["ground_truth"][self.user_turn]
        truth_results = [self.truth.execute_source(c) for c in truth_calls]
        if not truth_calls:  # BFCL leaves such turns to its irrelevance checker
            return {"valid": True, "turn": self.user_turn}
        if not self.turn_calls:
            return {
                "valid": False,
                "turn": self.user_turn,
                "error_type": "multi_turn:empty_turn_model_response",
                "error_message": f"Model response list is empty for turn {self.user_turn}",
            }
        state_checker, response_checker = _bfcl_checkers()
        state = state_checker(self.model.instances, self.truth.instances)
        if not state["valid"]:
            return {
                "valid": False,
                "turn": self.user_turn,
                "error_type": state["error_type"],
                "error_message": state["error_message"],
                "differences": _jsonable(state["details"]["differences"]),
            }
        response = response_checker(list(self.all_results), truth_results, self.user_turn)
        if not response["valid"]:
            return {
                "valid": False,
                "turn": self.user_turn,
                "error_type": response["error_type"],
                "error_message": response["error_message"],
                "missing": [str(m)[:300] for m in response["details"]["missing_items"]],
            }
        return {"valid": True, "turn": self.user_turn}

    def _final(self, passed: bool) -> dict[str, Any]:
        assert self._task is not None
        return {
            "passed": passed,
            "details": {
                "turns_passed": sum(v["valid"] for v in self.turn_verdicts),
                "user_turns": len(self._task.extra["questions"]),
                "verdicts": self.turn_verdicts,
            },
        }

    def score(self) -> StepResult:
        """Out of model replies: the current user turn is judged as it stands (BFCL's step
        limit ends a turn the same way); solved only if that was the last turn and every
        turn passed (later turns were never reached)."""
        assert self._task is not None
        turns = len(self._task.extra["questions"])
        if self.user_turn < turns:
            self.turn_verdicts.append(self._check_turn())
            self.user_turn += 1
        passed = self.user_turn == turns and all(v["valid"] for v in self.turn_verdicts)
        return StepResult(None, float(passed), True, self._final(passed))

    def close(self) -> None:
        self._task = None


def _jsonable(value: Any) -> Any:
    """BFCL's state differences hold backend objects: keep them readable in trajectories."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)[:1000]
    return value
