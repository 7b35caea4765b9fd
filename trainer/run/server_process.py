"""Start a CPU rollout server (``posttrain serve``) as a child process for local runs.

Local mode deliberately runs the server as a separate process reached over HTTP, not
in-process: the trainer then exercises exactly the client/server path it uses against a
cluster's rollout pool, and the two do not fight over one interpreter's GIL.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import TracebackType

from posttrain.errors import UsageError
from posttrain.processes import ManagedProcess, StartError, free_port, http_ok, tail

log = logging.getLogger(__name__)


def thread_split(cores: int, *, overlapped: bool) -> tuple[int, int]:
    """Intra-op threads ``(trainer, server)`` for a trainer and a local server on one host.

    Strictly on-policy (no overlap) the two take turns, so each may use every core. When
    sampling overlaps the optimizer step both compute at once: more OpenMP threads than
    cores then spin at barriers waiting for descheduled peers, so the cores are split.

    >>> thread_split(2, overlapped=True), thread_split(2, overlapped=False)
    ((1, 1), (2, 2))
    >>> thread_split(1, overlapped=True)
    (1, 1)
    """
    if not overlapped:
        return cores, cores
    server = max(1, cores // 2)
    return max(1, cores - server), server


class LocalRolloutServer:
    """Context manager: ``posttrain serve --model REF --port P`` until exit, log in a file."""

    def __init__(
        self, model: str, log_path: Path, *, threads: int | None = None, ready_timeout: float = 600
    ) -> None:
        self.model = model
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "posttrain",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
        ]
        self.process = ManagedProcess(
            name="rollout server",
            command=command,
            log_path=log_path,
            ready=lambda: http_ok(f"{self.url}/health"),
            env={"OMP_NUM_THREADS": str(threads)} if threads else {},
        )

    def __enter__(self) -> LocalRolloutServer:
        log.info(
            "starting rollout server: %s (log: %s)",
            " ".join(self.process.command),
            self.process.log_path,
        )
        try:
            self.process.start(self.ready_timeout)
        except StartError as exc:
            if exc.exit_code is None:
                raise  # alive but not ready in time (already stopped)
            # A server that dies at start-up almost always means a bad model reference.
            raise UsageError(
                f"rollout server for model {self.model!r} exited with code {exc.exit_code} "
                f"before becoming ready; its log ends with:\n{tail(self.process.log_path)}"
            ) from exc
        log.info("rollout server ready at %s", self.url)
        return self

    def stop(self) -> None:
        self.process.stop(grace_s=15)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
