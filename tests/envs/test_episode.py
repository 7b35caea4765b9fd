"""Episodes as token sequences: template arithmetic, loss mask and the real rollout server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.envs.episode import ChatTokens, run_episode
from posttrain.envs.function_calling import FunctionCallingEnv
from posttrain.envs.terminal import TerminalEnv
from posttrain.rollout.client import RolloutClient
from posttrain.rollout.protocol import SamplingParams
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.model.policy import chat_prompt_ids

from .conftest import ScriptedPolicy

TASK = Task("terminal", "Make a file a.txt.", "", extra={"verify": ["test -f a.txt"]})
CALL = '```json\n{"name": "shell", "arguments": {"cmd": "touch a.txt"}}\n```'


def test_token_sequence_is_the_chat_template_of_the_conversation(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    policy = ScriptedPolicy(tokenizer, [CALL, "I made it."])
    episode = run_episode(policy, chat, TerminalEnv(), TASK, SamplingParams(seed=0))
    assert episode.passed and len(episode.turns) == 2
    first, second = episode.turns
    # The whole sequence is exactly the template applied to the conversation as messages
    # (the model's turns closed by its own end-of-turn token).
    messages = [
        *TerminalEnv().reset(TASK),
        {"role": "assistant", "content": CALL},
        {"role": "user", "content": first.observation},
        {"role": "assistant", "content": "I made it."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    sequence = episode.prompt_ids + episode.completion_ids
    assert tokenizer.decode(sequence) + "\n" == rendered
    # The second model turn was sampled after exactly prompt + turn 1 + observation.
    assert policy.contexts[1] == episode.prompt_ids + first.token_ids + first.observation_ids
    # Token by token: 1 on each model token, 0 on each environment token.
    mask = episode.loss_mask
    assert len(mask) == len(episode.completion_ids) == len(episode.logprobs)
    expected = (
        [1] * len(first.token_ids) + [0] * len(first.observation_ids) + [1] * len(second.token_ids)
    )
    assert mask == expected
    for position, (token, bit) in enumerate(zip(episode.completion_ids, mask, strict=True)):
        owner = "model" if bit else "environment"
        if position < len(first.token_ids):
            assert owner == "model" and token == first.token_ids[position]
        elif position < len(first.token_ids) + len(first.observation_ids):
            assert owner == "environment"
        else:
            assert owner == "model"
    assert [lp for lp, bit in zip(episode.logprobs, mask, strict=True) if not bit] == [0.0] * len(
        first.observation_ids
    )
    assert {t.weight_version for t in episode.turns} == {3}
    # A single-message prompt gets the same ids as the trainer's single-turn encoding.
    assert chat.prompt_ids([{"role": "user", "content": "hi"}]) == chat_prompt_ids(tokenizer, "hi")


def test_a_turn_cut_by_max_tokens_is_closed_by_environment_tokens(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    closed = chat.observation_ids("user", "out", model_ended_turn=True)
    cut = chat.observation_ids("user", "out", model_ended_turn=False)
    assert cut[0] == tokenizer.eos_token_id and cut[1:] == closed
    assert tokenizer.decode(closed).endswith("<|im_start|>assistant\n")


def test_episode_through_the_real_rollout_server(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Random tiny model, real HTTP server: every model token keeps the server's logprob and
    weight version; the loss mask marks exactly those tokens."""
    server = ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
    contexts: list[list[int]] = []
    try:
        with RolloutClient([server.url]) as client:

            class Recording:
                def generate(self, prompts: list[list[int]], params: SamplingParams) -> Any:
                    contexts.append(list(prompts[0]))
                    return client.generate(prompts, params)

            task = Task(
                "bfcl",
                "Call f.",
                "",
                extra={
                    "functions": [
                        {
                            "name": "f",
                            "description": "d",
                            "parameters": {"type": "dict", "properties": {}, "required": []},
                        }
                    ],
                    "ground_truth": [{"f": {}}],
                    "bfcl_category": "simple_python",
                },
            )
            episode = run_episode(
                Recording(),
                ChatTokens(tokenizer),
                FunctionCallingEnv(max_turns=3),
                task,
                SamplingParams(max_tokens=6, seed=0, temperature=1.0),
            )
    finally:
        server.stop()
    assert episode.status in {"done", "truncated"} and episode.turns
    assert len(contexts) == len(episode.turns)
    for k, turn in enumerate(episode.turns):
        assert len(turn.token_ids) == len(turn.logprobs) and turn.token_ids
        assert all(lp <= 0.0 for lp in turn.logprobs)
        assert turn.weight_version == 0
        # turn k was sampled after the prompt plus everything before it
        before = episode.turns[:k]
        assert contexts[k] == episode.prompt_ids + [
            t for b in before for t in b.token_ids + b.observation_ids
        ]
    model_positions = [i for i, bit in enumerate(episode.loss_mask) if bit]
    assert [episode.completion_ids[i] for i in model_positions] == [
        t for turn in episode.turns for t in turn.token_ids
    ]
    assert [episode.logprobs[i] for i in model_positions] == [
        lp for turn in episode.turns for lp in turn.logprobs
    ]


def test_a_first_prompt_over_the_context_budget_is_an_errored_episode(tokenizer: Any) -> None:
    """The policy is never asked to continue a prompt that fills the budget by itself: the
    episode is errored with the sizes (counted, never scored), not a crash or a made-up 0."""
    policy = ScriptedPolicy(tokenizer, [CALL])
    chat = ChatTokens(tokenizer)
    env = TerminalEnv(max_turns=2)
    prompt_tokens = len(chat.prompt_ids(env.reset(TASK)))
    env.close()
    env = TerminalEnv(max_turns=2)
    try:
        episode = run_episode(
            policy, chat, env, TASK, SamplingParams(max_tokens=8), max_context_tokens=prompt_tokens
        )
    finally:
        env.close()
    assert policy.contexts == [] and episode.turns == []
    assert episode.status == "errored"
    assert f"first prompt is {prompt_tokens} tokens, over maxContextTokens {prompt_tokens}" in (
        episode.error
    )
