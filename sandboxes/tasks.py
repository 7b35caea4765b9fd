"""``sandbox.mode: task``: one SandboxTask object per execution, created and awaited.

:class:`SandboxTaskRunner` has the executor's ``run(ExecRequest) -> ExecResult``, so every
verifier runs unchanged on it. The operator turns each SandboxTask into an isolated pod
(restricted securityContext, no ServiceAccount token, default-deny egress, the run's
RuntimeClass); the program's output is read back from the log the pod's entrypoint stored
(``status.logsUri``), which is why this mode needs the operator's sandbox artifact storage.

What the pod did is told apart from what the sandbox did: a program that failed, timed out or
ran out of memory is an :class:`ExecResult` like any other; a pod that was never scheduled,
a task whose sandbox failed on every attempt, or a task the apiserver refused raises
:class:`SandboxUnavailable`, which the trainer retries and never scores.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from posttrain.api.envnames import OPERATOR_SANDBOX_ARTIFACTS_URI, S3_ENDPOINT
from posttrain.kubeapi import custom_objects_api
from posttrain.telemetry import get_tracer

from .client import SandboxUnavailable
from .protocol import ExecRequest, ExecResult, SandboxError

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

GROUP, VERSION, PLURAL = "posttrain.io", "v1alpha1", "sandboxtasks"
LABEL_PURPOSE = "posttrain.io/verification-of"

# SandboxTask status.reason -> ExecResult.status (the program's outcome, not the sandbox's).
_STATUS_BY_REASON = {"Completed": "ok", "Timeout": "timeout", "OOMKilled": "oom"}


class SandboxConfigError(SandboxError):
    """Task mode cannot work with this operator's configuration; retrying will not help."""


def read_s3_text(uri: str) -> str:
    """The text of one object, with the trainer's own S3 credentials (``AWS_*`` env).

    The store is opened at the object's own folder: opening it checks the bucket as
    narrowly as it works, and a run's scoped keys (storage.scopedCredentials) may list
    under its namespace's sandbox logs but not HEAD the bucket."""
    from posttrain.storage.store import open_store

    folder, _, name = uri.rpartition("/")
    store = open_store(folder, create_bucket=False)
    return store.get_bytes(name).decode("utf-8", errors="replace")


class SandboxTaskRunner:
    """Runs each :class:`ExecRequest` as a SandboxTask in ``namespace`` (thread-safe)."""

    def __init__(
        self,
        namespace: str,
        *,
        owner: dict[str, Any] | None = None,
        api: Any | None = None,
        read_log: Callable[[str], str] = read_s3_text,
        runtime_class_name: str | None = None,
        cpu: str = "1",
        name_prefix: str = "verify",
        start_timeout_s: float = 120.0,
        finish_margin_s: float = 120.0,
        poll_s: float = 0.25,
    ) -> None:
        """``owner``: an ownerReference (the TrainingRun), so tasks left behind by a killed
        trainer are garbage-collected with the run. ``start_timeout_s``: how long a task may
        stay unstarted (pod not scheduled, image pulling) before that counts as the sandbox
        being unavailable. ``finish_margin_s``: time beyond the execution's own timeout for
        the entrypoint's upload and the status to arrive. ``cpu``: each task pod's CPU
        (``spec.sandbox.taskCpu``); the memory is the request's own ``memory_mb``."""
        if api is None:
            api = custom_objects_api()
        self.api = api
        self.namespace = namespace
        self.owner = owner
        self.read_log = read_log
        self.runtime_class_name = runtime_class_name
        self.cpu = cpu
        self.name_prefix = name_prefix
        self.start_timeout_s = start_timeout_s
        self.finish_margin_s = finish_margin_s
        self.poll_s = poll_s

    def body(self, name: str, request: ExecRequest) -> dict[str, Any]:
        """The SandboxTask for ``request``.

        >>> r = SandboxTaskRunner("ns", api=object(), cpu="200m")
        >>> spec = r.body("t", ExecRequest(["python3", "x.py"], timeout_s=2.5,
        ...                                memory_mb=256))["spec"]
        >>> spec["timeoutSeconds"], spec["resources"], spec["network"]
        (3, {'cpu': '200m', 'memory': '256Mi'}, 'none')
        """
        spec: dict[str, Any] = {
            "command": list(request.command),
            "files": dict(request.files),
            "timeoutSeconds": max(1, math.ceil(request.timeout_s)),
            "resources": {"cpu": self.cpu, "memory": f"{request.memory_mb}Mi"},
            "network": "egress" if request.network == "host" else "none",
            # One more pod when the sandbox (not the program) fails: eviction, start error.
            "retries": 1,
            "ttlSecondsAfterFinished": 300,  # we delete it once read; this is the fallback
        }
        if request.stdin:
            spec["stdin"] = request.stdin
        if self.runtime_class_name:
            spec["runtimeClassName"] = self.runtime_class_name
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "labels": {LABEL_PURPOSE: self.name_prefix},
        }
        if self.owner:
            metadata["ownerReferences"] = [self.owner]
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SandboxTask",
            "metadata": metadata,
            "spec": spec,
        }

    def run(self, request: ExecRequest) -> ExecResult:
        name = f"{self.name_prefix}-{uuid.uuid4().hex[:12]}"
        with tracer.start_as_current_span("sandbox.task.exec") as span:
            span.set_attribute("posttrain.sandbox_task", name)
            try:
                self.api.create_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.body(name, request)
                )
            except Exception as exc:
                raise SandboxUnavailable(
                    f"could not create SandboxTask {self.namespace}/{name}: {exc}"
                ) from exc
            try:
                status = self._wait(name, request.timeout_s)
                return self._result(name, status)
            finally:
                self._delete(name)

    def _wait(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The task's status once it finished; raises SandboxUnavailable when it never
        started within ``start_timeout_s`` or never finished after starting."""
        created = time.monotonic()
        started: float | None = None
        while True:
            try:
                obj = self.api.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, name
                )
            except Exception as exc:  # an apiserver hiccup: keep waiting within the limits
                log.debug("reading SandboxTask %s failed: %s", name, exc)
                obj = {}
            status = obj.get("status") or {}
            phase = status.get("phase")
            if phase in ("Succeeded", "Failed"):
                return dict(status)
            now = time.monotonic()
            if started is None and (phase == "Running" or status.get("startTime")):
                started = now
            if started is None and now - created > self.start_timeout_s:
                raise SandboxUnavailable(
                    f"SandboxTask {self.namespace}/{name} did not start within "
                    f"{self.start_timeout_s:.0f} s (phase {phase or 'none yet'}): its pod was "
                    "not scheduled or could not start; check node capacity, the sandbox "
                    "image and the RuntimeClass"
                )
            if started is not None and now - started > timeout_s + self.finish_margin_s:
                raise SandboxUnavailable(
                    f"SandboxTask {self.namespace}/{name} ran {now - started:.0f} s, past its "
                    f"timeout of {timeout_s:.0f} s, without finishing"
                )
            time.sleep(self.poll_s)

    def _result(self, name: str, status: dict[str, Any]) -> ExecResult:
        reason = str(status.get("reason") or "")
        if reason == "SandboxFailed":
            raise SandboxUnavailable(
                f"SandboxTask {self.namespace}/{name}: the sandbox pod failed on all "
                f"{status.get('attempts', 1)} attempt(s) before the program ran"
            )
        logs_uri = status.get("logsUri")
        if not logs_uri:
            raise SandboxConfigError(
                f"SandboxTask {self.namespace}/{name} finished without a stored log "
                "(status.logsUri): sandbox.mode task reads the program's output from there, so "
                f"the operator needs sandbox artifact storage ({OPERATOR_SANDBOX_ARTIFACTS_URI}, "
                "chart value sandbox.artifactsUri) and its own S3 client to sign "
                f"upload URLs for it ({S3_ENDPOINT} and credentials in the operator's "
                "environment; its log says 'runs without a stored log' and why when signing "
                "failed); or use sandbox.mode runner"
            )
        try:
            output = self.read_log(logs_uri)
        except Exception as exc:
            raise SandboxUnavailable(f"could not read {logs_uri}: {exc}") from exc
        exit_code = status.get("exitCode")
        return ExecResult(
            status=_STATUS_BY_REASON.get(reason, "error"),  # type: ignore[arg-type]
            exit_code=None if reason == "Timeout" else exit_code,
            stdout=output,  # stdout and stderr share one pipe in the pod (kubectl logs order)
            stderr="",
            duration_ms=float(status.get("durationMs") or 0.0),
            reason=f"SandboxTask {name}: {reason or 'finished'} (exit {exit_code})",
        )

    def _delete(self, name: str) -> None:
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except Exception as exc:  # its TTL deletes it anyway
            log.debug("deleting SandboxTask %s failed: %s", name, exc)
