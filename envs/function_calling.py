"""Function calling judged by BFCL: the policy answers with calls, BFCL's checker decides.

With ``max_turns = 1`` an episode is exactly BFCL's single-turn evaluation (one reply,
decoded and AST-matched against the accepted answers). With more turns, a reply that does
not decode gets the decoder's error back and may try again -- the recovery the training
signal can teach -- while a reply that decodes is final, right or wrong.
"""

from __future__ import annotations

from typing import Any

from posttrain.envs.base import StepResult
from posttrain.envs.task import Task
from posttrain.sandboxes import bfcl

RETRY_HINT = (
    "Reply again with only the function calls, in the format "
    "[func_name1(params_name1=params_value1, ...), func_name2(params)]."
)


class FunctionCallingEnv:
    """One BFCL item: tools are the item's functions; reward 1 when BFCL accepts the calls."""

    name = "function_calling"
    observation_role = "user"

    def __init__(self, max_turns: int = 1, format_reward: float = 0.0) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        self.max_turns = max_turns
        self.format_reward = format_reward
        self._task: Task | None = None
        self._turns = 0
        self._last: dict[str, Any] = {}

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(self._extra("functions")) if self._task else []

    def _extra(self, key: str) -> Any:
        assert self._task is not None, "reset() first"
        if key not in self._task.extra:
            raise KeyError(
                f"task {self._task.task_id} has no {key!r}: is it a BFCL task "
                "(dataset builtin:bfcl)?"
            )
        return self._task.extra[key]

    def reset(self, task: Task) -> list[dict[str, str]]:
        self._task, self._turns, self._last = task, 0, {}
        self._extra("functions"), self._extra("ground_truth")  # fail now, not mid-episode
        messages = task.extra.get("messages")  # BFCL's chat: its system prompt, the question
        return (
            [dict(m) for m in messages] if messages else [{"role": "user", "content": task.prompt}]
        )

    def step(self, model_turn: str) -> StepResult:
        self._turns += 1
        names = {f["name"] for f in self._extra("functions")}
        verdict = bfcl.judge(
            model_turn,
            self._extra("functions"),
            self._extra("ground_truth"),
            str(self._extra("bfcl_category")),
        )
        self._last = verdict
        decoded = verdict["decoded"]
        if decoded is None:
            info = {"tool_calls": 1, "valid_tool_calls": 0, "parse_error": verdict["error"][0]}
            if self._turns < self.max_turns:
                return StepResult(
                    f"Your reply could not be parsed as function calls: "
                    f"{verdict['error'][0]}. {RETRY_HINT}",
                    0.0,
                    False,
                    info,
                )
            return StepResult(None, 0.0, True, {**info, **self._verdict_info()})
        valid_calls = sum(1 for call in decoded if next(iter(call)) in names)
        # Shaping (off by default): calls that decode and name offered functions earn a
        # fraction of the reward even when BFCL rejects their arguments. ``passed`` -- what
        # accuracy counts -- stays BFCL's verdict.
        reward = (
            1.0
            if verdict["valid"]
            else (self.format_reward * valid_calls / len(decoded) if decoded else 0.0)
        )
        return StepResult(
            None,
            reward,
            True,
            {"tool_calls": len(decoded), "valid_tool_calls": valid_calls, **self._verdict_info()},
        )

    def _verdict_info(self) -> dict[str, Any]:
        verdict = self._last
        return {
            "passed": bool(verdict.get("valid")),
            "details": {
                "error": [str(e)[:500] for e in verdict.get("error", [])],
                "error_type": verdict.get("error_type", ""),
                "decoded": verdict.get("decoded"),
            },
        }

    def score(self) -> StepResult:
        """Out of turns without a decodable reply: not solved."""
        return StepResult(None, 0.0, True, {"passed": False, **self._verdict_info()})

    def close(self) -> None:
        self._task = None
