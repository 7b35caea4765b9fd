"""Start a CPU rollout server (``posttrain serve``) as a child process for local runs.

Local mode deliberately runs the server as a separate process reached over HTTP, not
in-process: the trainer then exercises exactly the client/server path it uses against a
cluster's rollout pool, and the two do not fight over one interpreter's GIL.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from posttrain.errors import UsageError

log = logging.getLogger(__name__)


def free_port() -> int:
    """An unused TCP port on 127.0.0.1 (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalRolloutServer:
    """Context manager: ``posttrain serve --model REF --port P`` until exit, log in a file."""

    def __init__(
        self, model: str, log_path: Path, *, threads: int | None = None, ready_timeout: float = 600
    ) -> None:
        self.model = model
        self.log_path = log_path
        self.threads = threads
        self.ready_timeout = ready_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalRolloutServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "posttrain", "serve", "--model", self.model,
                   "--port", str(self.port)]
        env = dict(os.environ)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        log.info("starting rollout server: %s (log: %s)", " ".join(command), self.log_path)
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # our Ctrl-C is handled by us, then we stop it
            )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise UsageError(
                    f"rollout server for model {self.model!r} exited with code "
                    f"{self.process.returncode} before becoming ready; its log ends with:\n{tail}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    log.info("rollout server ready at %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"rollout server at {self.url} not ready after {self.ready_timeout}s")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
