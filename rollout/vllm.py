"""vLLM rollout replicas: the ``vllm serve`` command line and a weight-sync front door.

In clusters each RolloutPool replica runs ``posttrain rollout vllm-entry``. It

1. resolves the model reference to a local directory (packaged id, s3://, path),
2. starts ``vllm serve`` on an internal port with our worker extension
   (:mod:`posttrain.rollout.vllm_ext`) and ``VLLM_SERVER_DEV_MODE=1`` (for ``/collective_rpc``),
3. loads the latest weights published under ``--weights-uri`` *before* reporting ready,
4. serves the public port with the same contract as ``posttrain serve``: OpenAI endpoints are
   proxied to vLLM with ``weight_version`` added, and ``/v1/weights/load`` fetches a version,
   drains in-flight requests, reloads weights on every TP worker, resets the prefix cache
   (cached KV was computed with the old weights) and resumes.

Draining (a readers/writer lock: completions are readers, a weight load is the writer) is
what lets every completion report exactly one weight version on vLLM too; the pause lasts
as long as the longest in-flight request plus the reload.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from posttrain.rollout.protocol import WEIGHT_VERSION_HEADER

log = logging.getLogger(__name__)

WORKER_EXTENSION = "posttrain.rollout.vllm_ext.WeightSyncExtension"


@dataclass
class VllmServeSpec:
    """Everything that shapes one ``vllm serve`` process (mirrors api EngineArgs)."""

    model: str
    port: int = 8000
    host: str = "0.0.0.0"
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    speculative: dict[str, Any] | None = None  # {"method", "num_speculative_tokens", ...}
    extra_args: list[str] = field(default_factory=list)
    worker_extension: bool = True

    @classmethod
    def from_engine_args(cls, model: str, engine_args: Any, **overrides: Any) -> VllmServeSpec:
        """Build from ``api.rolloutpool.EngineArgs`` (or a dict with the same keys)."""
        args = engine_args.model_dump() if hasattr(engine_args, "model_dump") else dict(engine_args)
        known = {f for f in cls.__dataclass_fields__ if f not in {"model"}}
        return cls(model=model, **{k: v for k, v in args.items() if k in known}, **overrides)


def speculative_config(speculative: dict[str, Any]) -> dict[str, Any]:
    """Our speculative settings as vLLM's ``--speculative-config`` JSON keys.

    ``draft_model`` becomes vLLM's ``model``; unset values are dropped.

    >>> speculative_config({"method": "draft_model", "num_speculative_tokens": 4,
    ...                     "draft_model": "/models/draft"})
    {'method': 'draft_model', 'num_speculative_tokens': 4, 'model': '/models/draft'}
    """
    renamed = {"draft_model": "model"}
    return {renamed.get(k, k): v for k, v in speculative.items() if v is not None}


def build_vllm_command(spec: VllmServeSpec | dict[str, Any]) -> list[str]:
    """The ``vllm serve`` argv for ``spec`` (flag names as in vLLM's engine-args docs).

    >>> build_vllm_command({"model": "/m", "port": 9000, "worker_extension": False})[:5]
    ['vllm', 'serve', '/m', '--host', '0.0.0.0']
    """
    if isinstance(spec, dict):
        spec = VllmServeSpec(**spec)
    if spec.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {spec.tensor_parallel_size}")
    argv = [
        "vllm", "serve", spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--gpu-memory-utilization", str(spec.gpu_memory_utilization),
        "--dtype", spec.dtype,
        "--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-chunked-prefill"
        if spec.enable_chunked_prefill
        else "--no-enable-chunked-prefill",
    ]  # fmt: skip
    if spec.served_model_name:
        argv += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.speculative:
        config = speculative_config(spec.speculative)
        argv += ["--speculative-config", json.dumps(config, sort_keys=True)]
    if spec.worker_extension:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    return argv + list(spec.extra_args)


class AsyncReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no starvation)."""

    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    async def acquire_read(self) -> None:
        async with self._condition:
            await self._condition.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._condition:
            self._readers -= 1
            self._condition.notify_all()

    async def acquire_write(self) -> None:
        async with self._condition:
            self._writers_waiting += 1
            await self._condition.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True

    async def release_write(self) -> None:
        async with self._condition:
            self._writer = False
            self._condition.notify_all()


class VllmFrontDoor:
    """Public HTTP face of a vLLM replica: proxy + weight versions + weight loads."""

    def __init__(self, upstream: str, weights_uri: str | None, scratch_dir: str) -> None:
        import httpx

        self.upstream = upstream.rstrip("/")
        self.weights_uri = weights_uri
        self.scratch_dir = scratch_dir
        self.version = 0
        self.ready = False
        self.lock = AsyncReadWriteLock()
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=10.0))

    async def wait_upstream(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {process.returncode}")
            try:
                if (await self.http.get(f"{self.upstream}/health", timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(2)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s}s")

    async def load(self, uri: str, version: int) -> float:
        """Fetch, drain, reload on every worker, reset prefix cache, resume."""
        from posttrain.rollout import weights

        started = time.monotonic()
        path, temporary = await asyncio.to_thread(
            weights.fetch_weights, uri, version, self.scratch_dir
        )
        try:
            await self.lock.acquire_write()
            try:
                await self._rpc("reload_weights_from_path", [str(path)])
                reset = await self.http.post(f"{self.upstream}/reset_prefix_cache")
                reset.raise_for_status()
                self.version = version
            finally:
                await self.lock.release_write()
        finally:
            if temporary:
                shutil.rmtree(path, ignore_errors=True)
        elapsed = time.monotonic() - started
        log.info("vLLM now serving weights v%d (%.2fs)", version, elapsed)
        return elapsed

    async def _rpc(self, method: str, args: list[Any]) -> Any:
        response = await self.http.post(
            f"{self.upstream}/collective_rpc", json={"method": method, "args": args}
        )
        if response.status_code != 200:
            raise RuntimeError(
                f"/collective_rpc {method} failed (HTTP {response.status_code}): "
                f"{response.text[:500]}; is VLLM_SERVER_DEV_MODE=1 and the worker extension set?"
            )
        return response.json()

    def create_app(self) -> FastAPI:
        app = FastAPI(title="posttrain vLLM front door")

        @app.get("/health")
        async def health() -> Response:
            status = 200 if self.ready else 503
            return JSONResponse({"ready": self.ready, "weight_version": self.version}, status)

        @app.get("/v1/weights/version")
        async def version() -> Response:
            return JSONResponse(
                {"weight_version": self.version},
                headers={WEIGHT_VERSION_HEADER: str(self.version)},
            )

        @app.post("/v1/weights/load")
        async def load(request: Request) -> Response:
            body = await request.json()
            try:
                elapsed = await self.load(str(body["uri"]), int(body["version"]))
            except (KeyError, ValueError, FileNotFoundError) as exc:
                return JSONResponse({"error": {"message": str(exc), "code": 400}}, 400)
            return JSONResponse(
                {"weight_version": self.version, "load_seconds": elapsed},
                headers={WEIGHT_VERSION_HEADER: str(self.version)},
            )

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def proxy(path: str, request: Request) -> Response:
            if not self.ready:
                return JSONResponse({"error": {"message": "loading", "code": 503}}, 503)
            headers = {
                k: v
                for k, v in request.headers.items()
                if k.lower() not in {"host", "content-length"}
            }
            await self.lock.acquire_read()
            try:
                version = self.version
                upstream = await self.http.request(
                    request.method, f"{self.upstream}/{path}",
                    content=await request.body(), headers=headers,
                )  # fmt: skip
            finally:
                await self.lock.release_read()
            content_type = upstream.headers.get("content-type", "")
            if path.endswith("completions") and content_type.startswith("application/json"):
                payload = upstream.json()
                if isinstance(payload, dict) and "choices" in payload:
                    payload["weight_version"] = version
                    for choice in payload["choices"]:
                        choice["weight_version"] = version
                return JSONResponse(
                    payload, upstream.status_code, headers={WEIGHT_VERSION_HEADER: str(version)}
                )
            return Response(upstream.content, upstream.status_code, media_type=content_type)

        return app


def run_vllm_entry(
    spec: VllmServeSpec, *, public_port: int, weights_uri: str | None, start_timeout_s: float
) -> int:
    """Start vLLM on ``spec.port`` (internal) and serve the front door on ``public_port``."""
    import uvicorn

    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    # Workers import the extension by module path; make sure posttrain is importable there.
    argv = build_vllm_command(spec)
    log.info("starting %s", " ".join(argv))
    process = subprocess.Popen(argv, env=env)
    scratch = os.environ.get("POSTTRAIN_WEIGHTS_SCRATCH", "/tmp")
    door = VllmFrontDoor(f"http://127.0.0.1:{spec.port}", weights_uri, scratch)

    async def bring_up() -> None:
        from posttrain.rollout import weights

        await door.wait_upstream(process, start_timeout_s)
        if weights_uri:
            latest = await asyncio.to_thread(weights.latest_version, weights_uri)
            if latest is not None:
                await door.load(weights_uri, latest)
        door.ready = True
        log.info("vLLM replica ready at weight version %d", door.version)

    app = door.create_app()

    @app.on_event("startup")
    async def _start() -> None:
        task = asyncio.create_task(bring_up())

        def crashed(done: asyncio.Task[None]) -> None:
            if done.exception() is not None:
                log.error("vLLM bring-up failed: %s", done.exception())
                process.terminate()
                os._exit(1)  # let Kubernetes restart the pod rather than serve 503 forever

        task.add_done_callback(crashed)

    try:
        uvicorn.run(app, host=spec.host, port=public_port, log_level="info")
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return 0 if process.returncode in (0, -15, None) else 1


def vllm_available() -> tuple[bool, str]:
    """Whether a real vLLM can run here, and why not (for skip reasons and errors)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU (torch.cuda.is_available() is False)"
    if shutil.which("vllm") is None and "vllm" not in sys.modules:
        try:
            import vllm  # noqa: F401
        except ImportError:
            return False, "vllm is not installed (pip install posttrain[vllm])"
    return True, ""
