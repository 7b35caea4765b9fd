"""A vLLM replica on this machine: ``posttrain rollout vllm-entry`` in the rollout environment.

vLLM pins its own torch (the CPU build 2.13, the trainer 2.15), so it lives in its own
virtual environment (``make venv-vllm`` creates ``.venv-vllm``), just as a cluster runs it
from its own rollout image. Tests, benchmarks and ``posttrain serve --engine vllm`` start
replicas from the trainer's environment through this module: the same front door and
worker extension a RolloutPool pod runs, as a child process reached over HTTP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from posttrain.api.env import VLLM_PYTHON, WEIGHTS_POLL_SECONDS, WEIGHTS_URI
from posttrain.processes import free_port, tail

log = logging.getLogger(__name__)

VLLM_PYTHON_ENV = VLLM_PYTHON
# Where `make venv-vllm` puts the rollout environment (the repository root's .venv-vllm).
REPO_VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"

# vLLM's CPU build: fp32 (SmolLM2's converted weights; CPU bf16 kernels need AVX512-BF16),
# eager mode (no torch.compile warm-up: start-up in about a minute on an idle core).
CPU_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 2048,
    "extra_args": ["--enforce-eager"],
    # Direct transfers from a trainer on this host (rollout/vllm_transfer.py).
    "weight_transfer_backend": "posttrain_shm",
}


def vllm_python() -> Path | None:
    """The rollout environment's interpreter: ``$POSTTRAIN_VLLM_PYTHON`` or ``.venv-vllm``."""
    configured = os.environ.get(VLLM_PYTHON_ENV)
    if configured:
        return Path(configured)
    candidate = REPO_VLLM_VENV / "bin" / "python"
    return candidate if candidate.is_file() and (REPO_VLLM_VENV / ".installed").exists() else None


class LocalVllmReplica:
    """One ``vllm-entry`` process (front door + vLLM) on loopback; start, wait, kill.

    ``start`` returns at once so several replicas boot in parallel; ``wait_ready`` logs
    progress while it waits. The process leads its own session, so ``kill`` takes the
    front door and vLLM's engine processes down together, like a pod being killed.
    """

    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        *,
        weights_uri: str | None = None,
        engine_args: dict[str, Any] | None = None,
        poll_seconds: float = 0.0,
        served_model_name: str | None = None,
        port: int | None = None,
        kv_cache_gib: int = 1,
        python: Path | None = None,
        cpu_cores: str | None = None,
        transfer_idle_s: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: variables added to the replica's environment (a storage endpoint and
        its credentials). ``cpu_cores``: the cores vLLM's CPU build binds its threads to
        (``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"1"`` or ``"0-3"``); None leaves vLLM's
        ``auto``, which binds every replica on a small machine to the same core."""
        found = python or vllm_python()
        if found is None:
            raise RuntimeError(
                f"no vLLM environment: run `make venv-vllm` (creates {REPO_VLLM_VENV}) or set "
                f"${VLLM_PYTHON_ENV} to an interpreter with vLLM and posttrain installed"
            )
        self.python = found
        self.model = str(model)
        self.log_path = log_path
        self.weights_uri = weights_uri
        self.engine_args = dict(CPU_ENGINE_ARGS if engine_args is None else engine_args)
        self.poll_seconds = poll_seconds
        self.served_model_name = served_model_name
        self.port = port or free_port()
        self.internal_port = free_port()
        self.kv_cache_gib = kv_cache_gib
        self.cpu_cores = cpu_cores
        self.transfer_idle_s = transfer_idle_s  # None: the front door's default
        self.env = dict(env or {})
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        argv = [
            str(self.python), "-m", "posttrain", "rollout", "vllm-entry",
            "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
            "--internal-port", str(self.internal_port),
            "--engine-args", json.dumps(self.engine_args),
        ]  # fmt: skip
        if self.weights_uri:
            argv += ["--weights-uri", self.weights_uri]
        if self.poll_seconds:
            argv += ["--poll-seconds", str(self.poll_seconds)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.transfer_idle_s is not None:
            argv += ["--transfer-idle-seconds", str(self.transfer_idle_s)]
        return argv

    def start(self) -> LocalVllmReplica:
        self.internal_port = free_port()  # a restart must not wait for the old socket
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        # vLLM's CPU KV cache is preallocated (default 4 GiB); tests and laptops need less.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        if self.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_cores
        # Our own variables must not leak in from a trainer process (the CLI reads them).
        env.pop(WEIGHTS_URI, None)
        env.pop(WEIGHTS_POLL_SECONDS, None)
        with open(self.log_path, "ab") as logf:
            self.process = subprocess.Popen(
                self.command(), stdout=logf, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            )  # fmt: skip
        log.info("started vLLM replica %s (pid %d, log %s)", self.url, self.process.pid,
                 self.log_path)  # fmt: skip
        return self

    def health(self) -> dict[str, Any] | None:
        """``/health`` body when it answers 200, else None."""
        try:
            response = httpx.get(f"{self.url}/health", timeout=5)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_ready(self, timeout_s: float = 1800.0) -> dict[str, Any]:
        """Block until ``/health`` is 200; return its body (holds ``weight_version``).

        Raises RuntimeError with the log's tail if the replica exits, TimeoutError after
        ``timeout_s``. vLLM's start-up is minutes on a loaded CPU: progress every 30 s.
        """
        assert self.process is not None, "start() first"
        started = time.monotonic()
        next_log = started + 30
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM replica {self.url} exited with code {self.process.returncode}; "
                    f"{self.log_path} ends with:\n{tail(self.log_path, 40)}"
                )
            body = self.health()
            if body is not None:
                log.info("vLLM replica %s ready after %.0fs at weight version %s", self.url,
                         time.monotonic() - started, body.get("weight_version"))  # fmt: skip
                return body
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                self.kill()
                raise TimeoutError(
                    f"vLLM replica {self.url} not ready after {timeout_s:.0f}s; "
                    f"{self.log_path} ends with:\n{tail(self.log_path, 40)}"
                )
            if time.monotonic() >= next_log:
                log.info("waiting for vLLM replica %s (%.0fs; log %s)", self.url, elapsed,
                         self.log_path)  # fmt: skip
                next_log += 30
            time.sleep(1.0)

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole replica (front door and vLLM engine), like a crashed pod."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=60)
        self._reap_group()

    def stop(self, grace_s: float = 30.0) -> None:
        if self.process is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.process.wait(timeout=60)
        self._reap_group()

    def _reap_group(self) -> None:
        """vLLM's engine processes share the session: make sure none outlives the replica."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> LocalVllmReplica:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
