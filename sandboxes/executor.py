"""Run untrusted programs (model output) in a fresh bubblewrap sandbox per execution.

:class:`Executor` is what callers use (the verifiers, the runner server, ``posttrain
sandbox exec``); it puts together the parts, each in its own module:

* :mod:`.protocol`: the request, the result and :class:`SandboxError` (the wire contract);
* :mod:`.bubblewrap`: starting one sandbox, its isolation layers and limits (read that
  module's docstring for why bubblewrap and what each layer stops);
* :mod:`.collect`: feeding, draining and waiting for it, and classifying how it ended;
* :mod:`.warm_pool`: sandboxes pre-started so namespace setup is off the request path.

The names callers import from here (``ExecRequest``, ``ExecResult``, ``SandboxError``,
``files_to_tar`` ...) stay importable from this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

from prometheus_client import Counter, Histogram

from posttrain.telemetry import get_tracer

from .bubblewrap import (
    HOST_UID_BASE,
    HOST_UID_SLOTS,
    SANDBOX_PATH,
    WORKDIR,
    Bubblewrap,
    memfd,
    merge_seed,
    workspace_wrapper,
    write_all,
)
from .collect import classify_exit, collect_async, finish, truncate_output, wait_for
from .protocol import (
    STATUSES,
    ExecRequest,
    ExecResult,
    SandboxError,
    Status,
    files_to_tar,
    safe_relative_path,
    validate_request,
)
from .warm_pool import PooledSandbox, WarmPool

__all__ = [
    "HOST_UID_BASE",
    "HOST_UID_SLOTS",
    "SANDBOX_PATH",
    "STATUSES",
    "WORKDIR",
    "ExecRequest",
    "ExecResult",
    "Executor",
    "SandboxError",
    "Status",
    "classify_exit",
    "default_executor",
    "files_to_tar",
    "safe_relative_path",
    "truncate_output",
    "validate_request",
]

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

SANDBOX_LATENCY = Histogram(
    "posttrain_sandbox_exec_seconds",
    "Wall-clock time of one sandboxed execution, sandbox setup included.",
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
SANDBOX_EXECUTIONS = Counter(
    "posttrain_sandbox_executions_total", "Sandboxed executions by final status.", ["status"]
)


class Executor:
    """Runs :class:`ExecRequest` s in fresh bubblewrap sandboxes; thread-safe."""

    def __init__(self, bwrap: str | None = None, warm_pool: int = 0) -> None:
        """``warm_pool`` > 0 keeps that many sandboxes pre-started for default-shaped
        requests (see :class:`WarmPool`); the runner server uses it, one-shot callers not."""
        self.bubblewrap = Bubblewrap(bwrap)
        self.pool: WarmPool | None = None
        if warm_pool > 0:
            self.pool = WarmPool(self.bubblewrap, warm_pool)

    def close(self) -> None:
        """Stop the warm pool (its idle sandboxes are killed)."""
        if self.pool is not None:
            self.pool.close()

    def run(
        self,
        request: ExecRequest,
        *,
        workspace_tar: bytes | None = None,
        capture_workspace: bool = False,
    ) -> ExecResult:
        """Run one request in a new sandbox and wait for it (never longer than its timeout).

        ``workspace_tar`` seeds /workspace before ``request.files`` are added; with
        ``capture_workspace`` the final /workspace comes back in ``ExecResult.workspace_tar``.
        """
        with tracer.start_as_current_span("sandbox.exec") as span:
            span.set_attribute("sandbox.command", " ".join(request.command)[:200])
            span.set_attribute("sandbox.network", request.network)
            pooled = (
                self.pool.take(request)
                if self.pool is not None and workspace_tar is None and not capture_workspace
                else None
            )
            span.set_attribute("sandbox.warm", pooled is not None)
            if pooled is not None:
                try:
                    result = self._run_pooled(pooled, request)
                finally:
                    pooled.release()
                    self._pool_finished()
            else:
                uid_context = (
                    self.bubblewrap.uids.uid()
                    if self.bubblewrap.is_root
                    else contextlib.nullcontext(None)
                )
                with uid_context as host_uid:
                    result = self._run(request, host_uid, workspace_tar, capture_workspace)
            self._record(span, request, result)
        return result

    async def run_async(self, request: ExecRequest) -> ExecResult:
        """:meth:`run` for an event loop (the runner): waits on loop readers instead of
        blocking a thread. Workspaces are not supported here (use :meth:`run`)."""
        with tracer.start_as_current_span("sandbox.exec") as span:
            span.set_attribute("sandbox.command", " ".join(request.command)[:200])
            span.set_attribute("sandbox.network", request.network)
            pooled = self.pool.take(request) if self.pool is not None else None
            span.set_attribute("sandbox.warm", pooled is not None)
            if pooled is not None:
                try:
                    started = self._dispatch(pooled, request)
                    collected = await collect_async(
                        pooled.proc, request, started, pooled.status_read
                    )
                finally:
                    os.close(pooled.status_read)
                    pooled.release()
                    self._pool_finished()
            else:
                host_uid = self.bubblewrap.uids.acquire() if self.bubblewrap.is_root else None
                try:
                    command, inherited = list(request.command), []
                    if request.files:
                        seed_fd = memfd("workspace", files_to_tar(request.files))
                        inherited.append(seed_fd)
                        command = workspace_wrapper(seed_fd, -1, command)
                    started = time.monotonic()
                    proc, status_read = self.bubblewrap.spawn(request, host_uid, command, inherited)
                    try:
                        collected = await collect_async(proc, request, started, status_read)
                    finally:
                        os.close(status_read)
                finally:
                    if host_uid is not None:
                        self.bubblewrap.uids.release(host_uid)
            result = finish(request, collected, (time.monotonic() - started) * 1000, False)
            self._record(span, request, result)
        return result

    def _pool_finished(self) -> None:
        if self.pool is not None:
            self.pool.finished()

    @staticmethod
    def _record(span: Any, request: ExecRequest, result: ExecResult) -> None:
        span.set_attribute("sandbox.status", result.status)
        span.set_attribute(
            "sandbox.exit_code", -1 if result.exit_code is None else result.exit_code
        )
        span.set_attribute("sandbox.duration_ms", result.duration_ms)
        SANDBOX_LATENCY.observe(result.duration_ms / 1000)
        SANDBOX_EXECUTIONS.labels(result.status).inc()
        log.debug(
            "sandbox %s: %s (%.1f ms)", request.command[:1], result.reason, result.duration_ms
        )

    def _run(
        self,
        request: ExecRequest,
        host_uid: int | None,
        workspace_tar: bytes | None,
        capture_workspace: bool,
    ) -> ExecResult:
        command = list(request.command)
        inherited: list[int] = []
        out_read = -1
        seed = merge_seed(workspace_tar, request.files)
        if seed is not None or capture_workspace:
            seed_fd = memfd("workspace", seed or files_to_tar({}))
            inherited.append(seed_fd)
            out_write = -1
            if capture_workspace:
                out_read, out_write = os.pipe()
                inherited.append(out_write)
            command = workspace_wrapper(seed_fd, out_write, command)
        started = time.monotonic()
        try:
            proc, status_read = self.bubblewrap.spawn(request, host_uid, command, inherited)
        except BaseException:
            if out_read >= 0:
                os.close(out_read)
            raise
        return wait_for(proc, request, started, status_read, out_read, capture_workspace)

    def _run_pooled(self, sandbox: PooledSandbox, request: ExecRequest) -> ExecResult:
        """Hand ``request`` to a pre-started sandbox: only the program's own start-up remains."""
        started = self._dispatch(sandbox, request)
        return wait_for(sandbox.proc, request, started, sandbox.status_read, -1, False)

    def _dispatch(self, sandbox: PooledSandbox, request: ExecRequest) -> float:
        """Send the argv to a pooled sandbox's launcher, then let the pool refill if it ran
        low; returns the start time. A refill starts only after the hand-off, so building
        the next sandbox never delays handing this one its program."""
        started = time.monotonic()
        try:
            write_all(sandbox.control, b"\0".join(a.encode() for a in request.command) + b"\0")
        except BrokenPipeError:
            pass  # the launcher died; collecting reports what happened
        finally:
            os.close(sandbox.control)
            if self.pool is not None:
                self.pool.replenish()
        return started


_default: Executor | None = None
_default_lock = threading.Lock()


def default_executor() -> Executor:
    """A process-wide executor (building one resolves binaries and host binds once)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Executor()
        return _default
