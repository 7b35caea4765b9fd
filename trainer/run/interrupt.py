"""Ctrl-C during ``posttrain run``: stop at a step boundary with a checkpoint, and say how
to resume.

A run interrupted mid-step loses every step since its last checkpoint, and a person who
presses Ctrl-C wants to know what survived. So the first Ctrl-C only asks the loop to
stop after the step in progress (it checkpoints that step, then stops); a second Ctrl-C
stops at once. Either way the command ends by naming the last checkpoint and the exact
command that resumes from it, and ``status.json`` says ``Interrupted``, not ``Running``.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec

INTERRUPTED = "Interrupted"  # status.json's phase after Ctrl-C (local runs only)


class GracefulStop:
    """SIGINT handler: the first press sets :attr:`requested`, the second raises.

    >>> stop = GracefulStop(announce=lambda: None)
    >>> stop.handle(signal.SIGINT, None); stop.requested.is_set()
    True
    >>> try:
    ...     stop.handle(signal.SIGINT, None)
    ... except KeyboardInterrupt:
    ...     print("stopped at once")
    stopped at once
    """

    def __init__(self, announce: Any = None) -> None:
        self.requested = threading.Event()
        self._announce = announce or self._print_notice

    def install(self) -> GracefulStop:
        """Take over SIGINT (only the main thread may install signal handlers)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()
        self._announce()

    @staticmethod
    def _print_notice() -> None:
        print(
            "\nCtrl-C: finishing the step in progress, saving a checkpoint, then stopping. "
            "Press Ctrl-C again to stop at once (steps after the last checkpoint are then lost).",
            file=sys.stderr,
            flush=True,
        )


def resume_command(argv: Sequence[str]) -> str:
    """The command line that resumes: the same one (a run resumes from its --out).

    >>> resume_command(["/x/.venv/bin/posttrain", "run", "demo.yaml", "--local"])
    '/x/.venv/bin/posttrain run demo.yaml --local'
    >>> resume_command(["/x/posttrain/__main__.py", "run", "my run.yaml"])
    "posttrain run 'my run.yaml'"
    """
    program = argv[0] if argv and Path(argv[0]).name == "posttrain" else "posttrain"
    return shlex.join([program, *argv[1:]])


def last_checkpoint(spec: TrainingRunSpec, out_dir: Path) -> tuple[int, str] | None:
    """(step, URI) of the newest committed checkpoint of this run, None when there is none."""
    from posttrain.storage.checkpoints import CheckpointManager
    from posttrain.storage.store import open_store

    store = open_store(spec.checkpoint.storage_uri or str(out_dir.resolve()))
    manager = CheckpointManager(store, "checkpoints")
    step = manager.latest_step()
    if step is None:
        return None
    return step, store.uri(manager.step_prefix(step))


def interrupted_message(
    step: int, checkpoint: tuple[int, str] | None, every_steps: int, argv: Sequence[str]
) -> str:
    """What the person reads after Ctrl-C: what survived and how to go on.

    >>> print(interrupted_message(7, (5, "file:///r/checkpoints/step-000005"), 5,
    ...                           ["posttrain", "run", "a.yaml"]))
    interrupted at step 7; last checkpoint: step 5 (file:///r/checkpoints/step-000005)
    steps 6..7 came after it and will be taken again
    resume from it with: posttrain run a.yaml
    >>> print(interrupted_message(2, None, 5, ["posttrain", "run", "a.yaml"]))
    interrupted at step 2 before the first checkpoint (every 5 steps): the 2 step(s) done are lost
    running the same command again starts from step 0: posttrain run a.yaml
    (press Ctrl-C only once next time: the run then checkpoints the step in progress before it stops)
    """
    command = resume_command(argv)
    if checkpoint is None and step == 0:
        return f"interrupted before the first step; the same command starts the run: {command}"
    if checkpoint is None:
        return (
            f"interrupted at step {step} before the first checkpoint (every {every_steps} "
            f"steps): the {step} step(s) done are lost\n"
            f"running the same command again starts from step 0: {command}\n"
            "(press Ctrl-C only once next time: the run then checkpoints the step in "
            "progress before it stops)"
        )
    saved, uri = checkpoint
    lost = (
        f"steps {saved + 1}..{step} came after it and will be taken again\n" if step > saved else ""
    )
    return (
        f"interrupted at step {step}; last checkpoint: step {saved} ({uri})\n{lost}"
        f"resume from it with: {command}"
    )


def mark_status_interrupted(out_dir: Path, message: str) -> None:
    """Rewrite ``status.json`` (if the run wrote one) as Interrupted with ``message``.

    A run stopped by Ctrl-C never reaches its own final report, so without this the file
    would say Running forever.
    """
    path = out_dir / "status.json"
    if not path.is_file():
        return
    try:
        status = json.loads(path.read_text())
    except ValueError:
        status = {}
    status.update(phase=INTERRUPTED, message=message, updatedAt=datetime.now(UTC).isoformat())
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(status, indent=1))
    tmp.replace(path)
