"""Data of the SFT and DPO stages: JSONL demonstrations and preference pairs, and built-ins.

SFT lines are ``{"prompt": ..., "completion": ...}``; DPO lines are ``{"prompt": ...,
"chosen": ..., "rejected": ...}``. Prompts are chat-templated with the trainer's tokenizer
exactly as RL prompts are (so SFT teaches the format RL and evaluation use). Instead of
``prompt`` a line may give ``messages`` (a chat: ``[{"role", "content"}, ...]``), templated
as the environments template their first messages -- a system prompt of its own stays a
system message, so a demonstration sees exactly the tokens an episode starts with; a completion
is the assistant's answer followed by the end-of-turn (EOS) token, so the model also learns
to stop.

Unusable examples are skipped, counted by reason and logged with their ``file:line``:
``identicalPair`` (chosen == rejected: no preference to learn), ``emptyCompletion``, and
``promptTooLong`` (the prompt leaves no room for a completion token within ``maxLength``).
A completion that does not fit is truncated, as TRL does (``truncation_mode="keep_start"``).
A malformed line (bad JSON, missing key) fails the run with its ``file:line``: that is a
broken file, not an unusable example.

Built-ins (``builtin:arithmetic``, ``builtin:code``) come from the RL generators' *training*
split (held-out items never appear): SFT gets correct worked answers in the requested
format; DPO pairs that answer (chosen) with a wrong one in the same format (rejected).
``builtin:bfcl_<category>`` (and ``builtin:bfcl``, SFT only) are BFCL's items of the training
side of the content-hash split, as the function-calling environment plays them (BFCL's
system prompt and question as ``messages``), each answered with one reply BFCL's checker
accepts, built from the item's ``possible_answer`` (:func:`posttrain.sandboxes.bfcl.canonical_answer`).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from posttrain.errors import UsageError
from posttrain.trainer.data.datasets import (
    BFCL_SINGLE_TURN_NAMES,
    BUILTIN_POOL_PER_STRATUM,
    CODE_FAMILIES,
    Task,
    builtin_tasks,
)

log = logging.getLogger(__name__)

SKIPPED_EXAMPLES = Counter(
    "posttrain_trainer_skipped_examples_total",
    "SFT/DPO examples skipped as unusable",
    ["stage", "reason"],
)

IDENTICAL_PAIR = "identicalPair"
EMPTY_COMPLETION = "emptyCompletion"
PROMPT_TOO_LONG = "promptTooLong"


@dataclass(frozen=True)
class SftExample:
    """One demonstration, tokenized: the loss covers ``completion_ids`` only."""

    prompt_ids: list[int]
    completion_ids: list[int]
    where: str  # file:line, for messages


@dataclass(frozen=True)
class PreferencePair:
    """One DPO pair, tokenized; both answers follow the same prompt."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str


@dataclass
class StageData:
    """A stage's usable examples plus what was skipped, by reason."""

    examples: list[Any]  # SftExample | PreferencePair
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0


@dataclass(frozen=True)
class RawRecord:
    """One line of a stage data source before tokenization."""

    record: dict[str, Any]
    where: str


# --------------------------------------------------------------------------- sources


def read_records(source: str, kind: str) -> Iterator[RawRecord]:
    """Records of one source: ``builtin:NAME`` or a JSONL path (missing file: UsageError)."""
    if source.startswith("builtin:"):
        yield from builtin_records(source.removeprefix("builtin:"), kind)
        return
    path = Path(source.removeprefix("file://"))
    if not path.is_file():
        raise UsageError(
            f"{kind} data file {str(path)!r} does not exist; fix the stage's datasets entry "
            "(a JSONL path readable by the trainer, or builtin:arithmetic / builtin:code)"
        )
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg}); one object per line") from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
        yield RawRecord(record, where)


REQUIRED_KEYS = {"sft": ("prompt", "completion"), "dpo": ("prompt", "chosen", "rejected")}

Prompt = str | list[dict[str, str]]  # a user prompt, or a whole chat (``messages``)


def record_prompt(record: dict[str, Any], where: str, kind: str) -> Prompt:
    """The record's ``prompt`` string, or its ``messages`` chat checked for shape.

    >>> record_prompt({"messages": [{"role": "user", "content": "hi"}]}, "f:1", "sft")
    [{'role': 'user', 'content': 'hi'}]
    """
    if "messages" not in record or "prompt" in record:
        value = record.get("prompt")
        if not isinstance(value, str):
            raise UsageError(
                f"{where}: {kind} lines need string keys "
                f'{", ".join(REQUIRED_KEYS[kind])} (or a "messages" chat instead of '
                f"\"prompt\"); 'prompt' is {'missing' if value is None else type(value).__name__}"
            )
        return value
    messages = record["messages"]
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise UsageError(
            f'{where}: "messages" must be a non-empty list of {{"role": str, "content": str}}'
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_stage_data(
    kind: str,
    sources: list[str],
    encode_prompt: Callable[[Prompt], list[int]],
    encode_completion: Callable[[str], list[int]],
    max_length: int,
    stage: str,
) -> StageData:
    """Read, check and tokenize every source of a stage (``kind`` is ``sft`` or ``dpo``)."""
    data = StageData([])
    for source in sources:
        for raw in read_records(source, kind):
            prompt = record_prompt(raw.record, raw.where, kind)
            texts = {}
            for key in REQUIRED_KEYS[kind][1:]:
                value = raw.record.get(key)
                if not isinstance(value, str):
                    raise UsageError(
                        f"{raw.where}: {kind} lines need string keys "
                        f"{', '.join(REQUIRED_KEYS[kind])}; {key!r} is "
                        f"{'missing' if value is None else type(value).__name__}"
                    )
                texts[key] = value
            example = _tokenized(
                kind, prompt, texts, raw.where, encode_prompt, encode_completion, max_length, data
            )
            if example is not None:
                data.examples.append(example)
    for reason, count in data.skipped.items():
        SKIPPED_EXAMPLES.labels(stage, reason).inc(count)
    if not data.examples:
        raise UsageError(
            f"stage {stage!r}: no usable {kind} examples in {', '.join(sources)} "
            f"(skipped: {data.skipped or 'none'})"
        )
    return data


def _tokenized(
    kind: str,
    prompt: Prompt,
    texts: dict[str, str],
    where: str,
    encode_prompt: Callable[[Prompt], list[int]],
    encode_completion: Callable[[str], list[int]],
    max_length: int,
    data: StageData,
) -> SftExample | PreferencePair | None:
    """The example, or None after counting and logging why it is skipped."""
    answers = [texts[k] for k in (("completion",) if kind == "sft" else ("chosen", "rejected"))]
    reason = None
    if any(not a.strip() for a in answers):
        reason = EMPTY_COMPLETION
    elif kind == "dpo" and answers[0] == answers[1]:
        reason = IDENTICAL_PAIR
    prompt_ids: list[int] = []
    if reason is None:
        prompt_ids = encode_prompt(prompt)
        if len(prompt_ids) >= max_length:
            reason = PROMPT_TOO_LONG
    if reason is not None:
        data.skipped[reason] = data.skipped.get(reason, 0) + 1
        log.warning("%s: skipped %s example (%s)", where, kind, reason)
        return None
    room = max_length - len(prompt_ids)
    encoded = [encode_completion(a) for a in answers]
    if any(len(ids) > room for ids in encoded):
        data.truncated += 1
    encoded = [ids[:room] for ids in encoded]
    if kind == "sft":
        return SftExample(prompt_ids, encoded[0], where)
    return PreferencePair(prompt_ids, encoded[0], encoded[1], where)


# --------------------------------------------------------------------------- batches


def batch_indices(n_examples: int, batch_size: int, stage_step: int, seed: int) -> list[int]:
    """Indices of the examples of one step (1-based ``stage_step``), a pure function of it.

    Passes over the data are shuffled with their own seed, so a resumed stage needs no data
    state: it recomputes the same batches from the step number.

    >>> sorted(batch_indices(4, 2, 1, 0) + batch_indices(4, 2, 2, 0))
    [0, 1, 2, 3]
    """
    start = (stage_step - 1) * batch_size
    out = []
    for position in range(start, start + batch_size):
        epoch, offset = divmod(position, n_examples)
        order = list(range(n_examples))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        out.append(order[offset])
    return out


# --------------------------------------------------------------------------- built-ins

ARITHMETIC_PROMPT = re.compile(r"What is (-?\d+) ([+\-*]) (\d+)\?")
ARITHMETIC_OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def arithmetic_answer(task: Task, wrong_by: int = 0) -> str:
    """A worked answer in the requested format (``wrong_by`` shifts the result).

    >>> arithmetic_answer(Task("arithmetic", "What is 3 + 4? Give ...", "7"))
    '3 + 4 = 7\\nAnswer: 7'
    """
    match = ARITHMETIC_PROMPT.search(task.prompt)
    if match is None:
        raise ValueError(f"not a built-in arithmetic prompt: {task.prompt!r}")
    a, op, b = int(match[1]), match[2], int(match[3])
    value = ARITHMETIC_OPS[op](a, b) + wrong_by
    return f"{a} {op} {b} = {value}\nAnswer: {value}"


def code_answer(task: Task, wrong_by: int = 0) -> str:
    """The reference function of a built-in code task, in a python block (``wrong_by``
    shifts its constant, which makes a plausible wrong answer)."""
    for families in CODE_FAMILIES.values():
        for name, description, body in families:
            head = f"Write a Python function `{name}("
            if not task.prompt.startswith(head):
                continue
            pattern = re.escape(description).replace(re.escape("{k}"), r"(\d+)")
            match = re.search(pattern, task.prompt)
            if match is None:
                continue
            arg = task.prompt[len(head) :].split(")", 1)[0]
            source = f"def {name}({arg}):\n    {body.format(k=int(match[1]) + wrong_by)}\n"
            return f"```python\n{source}```"
    raise ValueError(f"not a built-in code prompt: {task.prompt!r}")


def _passes(task: Task, answer: str) -> bool:
    """Whether a built-in code answer passes the task's asserts (our own generated code)."""
    source = answer.removeprefix("```python\n").removesuffix("```")
    scope: dict[str, Any] = {}
    try:
        exec(source + (task.tests or ""), scope)  # reference code we generated, not model output
    except Exception:  # a failed assert, or e.g. x % 0 after the shift: wrong either way
        return False
    return True


BUILTIN_ANSWERS: dict[str, Callable[[Task, int], str]] = {
    "arithmetic": arithmetic_answer,
    "code": code_answer,
}


def bfcl_records(name: str, kind: str) -> Iterator[RawRecord]:
    """SFT demonstrations of BFCL tool calling: the training side of the content-hash split
    (the items RL trains on; held-out items never appear), played as the environment plays
    them, answered with a reply BFCL accepts built from ``possible_answer``."""
    if kind != "sft":
        raise UsageError(
            f"builtin:{name} has demonstrations only (an sft stage); a dpo stage needs "
            "preference pairs: give a JSONL file of prompt/chosen/rejected"
        )
    for i, task in enumerate(builtin_tasks(name, "train", BUILTIN_POOL_PER_STRATUM)):
        messages = task.extra.get("messages") or [{"role": "user", "content": task.prompt}]
        yield RawRecord(
            {"messages": messages, "completion": task.answer or ""}, f"builtin:{name}#{i}"
        )


def builtin_records(name: str, kind: str) -> Iterator[RawRecord]:
    """SFT demonstrations or DPO pairs from a built-in generator's training split."""
    if name in BFCL_SINGLE_TURN_NAMES:
        yield from bfcl_records(name, kind)
        return
    if name not in BUILTIN_ANSWERS:
        raise UsageError(
            f"unknown built-in dataset 'builtin:{name}' for a {kind} stage; use "
            + " or ".join(f"builtin:{n}" for n in (*BUILTIN_ANSWERS, *BFCL_SINGLE_TURN_NAMES))
        )
    answer = BUILTIN_ANSWERS[name]
    for i, task in enumerate(builtin_tasks(name, "train", BUILTIN_POOL_PER_STRATUM)):
        where = f"builtin:{name}#{i}"
        correct = answer(task, 0)
        if kind == "sft":
            yield RawRecord({"prompt": task.prompt, "completion": correct}, where)
            continue
        rng = random.Random(task.task_id)
        wrong = answer(task, rng.choice([-3, -2, -1, 1, 2, 3]))
        if name == "code" and _passes(task, wrong):
            continue  # the shifted constant happens to pass these tests: not a wrong answer
        yield RawRecord({"prompt": task.prompt, "chosen": correct, "rejected": wrong}, where)
