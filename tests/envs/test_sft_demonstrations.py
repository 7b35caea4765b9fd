"""SFT demonstrations of BFCL tool calling: training items only, the episode's own prompt."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.envs.episode import ChatTokens
from posttrain.errors import UsageError
from posttrain.sandboxes import bfcl
from posttrain.trainer.data.datasets import builtin_tasks
from posttrain.trainer.data.stage_data import load_stage_data, read_records
from posttrain.trainer.model.policy import chat_messages_ids, chat_prompt_ids


def test_demonstrations_are_training_items_answered_as_bfcl_accepts(tokenizer: Any) -> None:
    records = [r.record for r in read_records("builtin:bfcl_simple_python", "sft")]
    train = builtin_tasks("bfcl_simple_python", "train", 0)
    held_out = builtin_tasks("bfcl_simple_python", "eval", 0)
    assert len(records) == len(train) and held_out
    held_out_questions = {t.extra["messages"][-1]["content"] for t in held_out}
    for record, task in zip(records, train, strict=True):
        assert record["messages"][-1]["content"] not in held_out_questions
        verdict = bfcl.judge(
            record["completion"], task.extra["functions"], task.extra["ground_truth"], "simple"
        )
        assert verdict["valid"], (task.extra["bfcl_id"], record["completion"], verdict)

    def encode(prompt: Any) -> list[int]:
        if isinstance(prompt, list):
            return chat_messages_ids(tokenizer, prompt)
        return chat_prompt_ids(tokenizer, prompt)

    data = load_stage_data(
        "sft",
        ["builtin:bfcl_simple_python"],
        encode,
        lambda t: [*tokenizer(t, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id],
        2048,
        "sft",
    )
    # The demonstration's prompt is token for token what an episode of the item starts with.
    assert data.examples[0].prompt_ids == ChatTokens(tokenizer).prompt_ids(
        train[0].extra["messages"]
    )
    assert tokenizer.decode(data.examples[0].completion_ids[:-1]) == records[0]["completion"]


def test_messages_lines_are_checked_and_bfcl_has_no_dpo_pairs(tmp_path: Any) -> None:
    bad = tmp_path / "sft.jsonl"
    bad.write_text('{"messages": [{"role": "user"}], "completion": "x"}\n')
    with pytest.raises(UsageError, match=r"sft\.jsonl:1: \"messages\" must be a non-empty list"):
        load_stage_data("sft", [str(bad)], lambda p: [1], lambda t: [2], 64, "sft")
    with pytest.raises(UsageError, match="demonstrations only"):
        list(read_records("builtin:bfcl_simple_python", "dpo"))
