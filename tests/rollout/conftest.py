"""Shared fixtures: a tiny SmolLM2-architecture model and servers on loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from posttrain.devenv.process import free_port
from posttrain.models import make_tiny_model
from posttrain.rollout.weights import version_dir_name


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


def publish_perturbed(model_dir: Path, prefix: Path, version: int, scale: float) -> Path:
    """Publish ``model_dir``'s weights, deterministically perturbed, as ``version``.

    scale=0 republishes the original weights unchanged.
    """
    state = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(version)
    perturbed = {
        name: tensor + scale * torch.randn(tensor.shape, generator=generator)
        for name, tensor in state.items()
    }
    dest = prefix / version_dir_name(version)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(perturbed, str(dest / "model.safetensors"))
    return dest


@pytest.fixture(scope="session")
def publish_weights(tiny_model_dir: Path) -> Callable[[Path, int, float], Path]:
    """``publish(prefix, version, scale)``: publish perturbed tiny weights as ``version``."""

    def publish(prefix: Path, version: int, scale: float) -> Path:
        return publish_perturbed(tiny_model_dir, prefix, version, scale)

    return publish


class ServeProcess:
    """``posttrain serve`` in a subprocess (so a test can kill it like a crashed pod)."""

    def __init__(self, model: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, POSTTRAIN_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "posttrain", "serve", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = 120.0) -> ServeProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not ready after {timeout_s}s")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture
def serve_process(tiny_model_dir: Path) -> Iterator[type[ServeProcess]]:
    """Factory for server subprocesses; every one started is killed at teardown."""
    started: list[ServeProcess] = []

    class Tracked(ServeProcess):
        def __init__(self, model: Path = tiny_model_dir, *extra: str) -> None:
            super().__init__(model, *extra)
            started.append(self)

    yield Tracked
    for server in started:
        server.kill()
