"""A terminal environment: shell commands in a sandboxed workspace, judged by checks.

A task gives an instruction (``prompt``), an optional ``setup`` script and ``files`` that
build the starting workspace, and ``verify``: shell checks that must all succeed in the
final workspace (the same task shape the ``shell`` verifier reads). The policy acts with
one tool, ``shell``, called as a fenced JSON block; a reply without a tool call ends the
episode and the checks judge the workspace.

Every command runs in a fresh bubblewrap sandbox seeded with the workspace (see
:class:`posttrain.sandboxes.snapshot.Workspace`): no process survives a step, a command
that hangs is killed at ``command_timeout_s`` and its step leaves the workspace unchanged,
and the episode continues with the timeout as the observation. Snapshots make the rest
cheap: the set-up state of a task is built once and every episode of its group branches
from it; checks run from a snapshot and are rolled back, so they can never change what the
next check sees; a step the sandbox itself failed on (not the command) is retried from the
same state before the episode is given up as errored.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

from posttrain.envs.base import EnvFailure, StepResult
from posttrain.envs.task import Task, content_hash
from posttrain.sandboxes.protocol import SandboxError
from posttrain.sandboxes.snapshot import Workspace

log = logging.getLogger(__name__)

SHELL_TOOL: dict[str, Any] = {
    "name": "shell",
    "description": "Run a bash command in the workspace; returns its exit code and output.",
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
    },
}
INSTRUCTIONS = (
    "You are working in a Linux shell, in a directory with the task's files. To run a "
    "command, reply with one tool call in a fenced block:\n"
    '```json\n{"name": "shell", "arguments": {"cmd": "ls -la"}}\n```\n'
    "You will see its output. When the task is done, reply without a tool call.\n\nTask: "
)
FENCED_BLOCK = re.compile(r"```[a-zA-Z_]*[ \t]*\n?(.*?)```", re.DOTALL)
MAX_OBSERVATION_CHARS = 2000
SANDBOX_RETRIES = 2


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def parse_tool_call(text: str) -> tuple[ToolCall | None, str | None]:
    """``(call, None)``, ``(None, None)`` when the reply makes no call, or ``(None, error)``
    when it tried to (a fenced or bare JSON object) and the call cannot be read.

    >>> parse_tool_call('```json\\n{"name": "shell", "arguments": {"cmd": "ls"}}\\n```')
    (ToolCall(name='shell', arguments={'cmd': 'ls'}), None)
    >>> parse_tool_call("All done.")
    (None, None)
    >>> parse_tool_call('```json\\n{"name": "shell", "arguments": {"cmd": "ls"}\\n```')[1]
    "invalid JSON: Expecting ',' delimiter (line 2, column 1)"
    """
    blocks = [b.strip() for b in FENCED_BLOCK.findall(text)]
    if not blocks and text.strip().startswith("{"):
        blocks = [text.strip()]
    for block in blocks:
        if not block.startswith("{"):
            continue  # code or prose in a fence: not a call
        try:
            payload = json.loads(block)
        except json.JSONDecodeError as exc:
            return None, f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None, 'a tool call is an object with a "name" string'
        arguments = payload.get("arguments", {})
        if not isinstance(arguments, dict):
            return None, f'"arguments" must be an object, got {type(arguments).__name__}'
        return ToolCall(payload["name"], arguments), None
    return None, None


def _clip(text: str) -> str:
    if len(text) <= MAX_OBSERVATION_CHARS:
        return text
    return text[:MAX_OBSERVATION_CHARS] + f"\n... [{len(text)} chars, truncated]"


class SetupCache:
    """Set-up workspaces by task id, so a group's episodes branch from one built state."""

    def __init__(self) -> None:
        self._states: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._states.get(key)

    def put(self, key: str, state: bytes) -> None:
        with self._lock:
            self._states[key] = state


class TerminalEnv:
    """One terminal task in a sandboxed workspace (see the module docstring)."""

    name = "terminal"
    observation_role = "user"
    tools = [SHELL_TOOL]

    def __init__(
        self,
        executor: Any = None,
        *,
        max_turns: int = 8,
        command_timeout_s: float = 10.0,
        memory_mb: int = 512,
        setup_cache: SetupCache | None = None,
        setup_timeout_s: float = 60.0,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if executor is None:
            from posttrain.sandboxes.executor import default_executor

            executor = default_executor()
        self.executor = executor
        self.max_turns = max_turns
        self.command_timeout_s = command_timeout_s
        self.memory_mb = memory_mb
        # A task's setup (installs, builds) may take longer than one agent command.
        self.setup_timeout_s = setup_timeout_s
        self.setup_cache = setup_cache or SetupCache()
        self.workspace: Workspace | None = None
        self._checks: list[str] = []

    def reset(self, task: Task) -> list[dict[str, str]]:
        checks = task.extra.get("verify")
        if isinstance(checks, str):
            checks = [c for c in checks.splitlines() if c.strip() and not c.startswith("#")]
        if not checks:
            raise EnvFailure(f'terminal task {task.task_id} has no "verify" checks')
        self._checks = list(checks)
        self.workspace = Workspace(
            self.executor, timeout_s=self.command_timeout_s, memory_mb=self.memory_mb
        )
        setup, files = task.extra.get("setup", ""), dict(task.extra.get("files", {}))
        # Keyed by what builds the state (the task id names the prompt only).
        key = content_hash(task.task_id, setup, json.dumps(files, sort_keys=True))
        built = self.setup_cache.get(key)
        if built is not None:
            self.workspace.restore(built)
        else:
            if setup or files:
                result = self._run(
                    ["sh", "-c", setup or "true"], files=files, timeout_s=self.setup_timeout_s
                )
                if result.status != "ok":
                    raise EnvFailure(
                        f"setup of task {task.task_id} failed ({result.reason}): "
                        f"{result.stderr[-500:]}"
                    )
            self.setup_cache.put(key, self.workspace.export())
        return [{"role": "user", "content": INSTRUCTIONS + task.prompt}]

    def _run(self, command: list[str], **overrides: Any) -> Any:
        """One sandboxed step; a sandbox failure (not the command's) is retried from the same
        state (the workspace is untouched by a step that did not finish)."""
        assert self.workspace is not None, "reset() first"
        for attempt in range(SANDBOX_RETRIES + 1):
            try:
                return self.workspace.run(command, **overrides)
            except SandboxError as exc:
                log.warning("sandbox failed (attempt %d): %s", attempt + 1, exc)
                if attempt == SANDBOX_RETRIES:
                    raise EnvFailure(f"the sandbox failed {attempt + 1} times: {exc}") from exc
        raise AssertionError("unreachable")

    def step(self, model_turn: str) -> StepResult:
        call, error = parse_tool_call(model_turn)
        if error is not None:
            return StepResult(
                f"error: could not parse your tool call: {error}. Call a tool as "
                '```json\n{"name": "shell", "arguments": {"cmd": "..."}}\n```',
                0.0,
                False,
                {"tool_calls": 1, "valid_tool_calls": 0, "parse_error": error},
            )
        if call is None:
            return self.score()
        if call.name != "shell" or not isinstance(call.arguments.get("cmd"), str):
            problem = (
                f"unknown tool {call.name!r}; the only tool is 'shell'"
                if call.name != "shell"
                else 'shell needs {"cmd": "<command>"}'
            )
            return StepResult(
                f"error: {problem}",
                0.0,
                False,
                {"tool_calls": 1, "valid_tool_calls": 0, "parse_error": problem},
            )
        result = self._run(["bash", "-c", call.arguments["cmd"]])
        info = {
            "tool_calls": 1,
            "valid_tool_calls": 1,
            "exit_code": result.exit_code,
            "command_status": result.status,
            "command_failed": result.status != "ok",
        }
        if result.status == "timeout":
            observation = (
                f"error: the command did not finish within {self.command_timeout_s:g}"
                " s and was killed; the workspace is unchanged."
            )
        else:
            observation = (
                f"exit code: {result.exit_code}\nstdout:\n{_clip(result.stdout)}"
                f"\nstderr:\n{_clip(result.stderr)}"
            )
        return StepResult(observation, 0.0, False, info)

    def score(self) -> StepResult:
        """Run every check on the current workspace, each from the same snapshot."""
        assert self.workspace is not None, "reset() first"
        start = self.workspace.snapshot()
        outcomes = []
        for check in self._checks:
            result = self._run(["sh", "-c", check])
            outcomes.append({"command": check, "passed": result.status == "ok"})
            self.workspace.rollback(start)
        passed = sum(o["passed"] for o in outcomes)
        return StepResult(
            None,
            passed / len(outcomes),
            True,
            {"passed": passed == len(outcomes), "details": {"checks": outcomes}},
        )

    def close(self) -> None:
        self.workspace = None
