"""Verification as ``spec.sandbox`` says: where executions run, their limits, and what an
execution the sandbox could not perform means (never a wrong answer).

``build_verification(policy)`` picks the executor for the mode:

* ``local``: the bubblewrap :class:`~posttrain.sandboxes.executor.Executor` in this process;
* ``runner``: a :class:`~posttrain.sandboxes.client.SandboxClient` of ``runnerUrl``, or of the
  runner the operator started for this run (``$POSTTRAIN_SANDBOX_RUNNER_URL``);
* ``task``: a :class:`~posttrain.sandboxes.tasks.SandboxTaskRunner` creating SandboxTasks in
  the run's namespace.

Every request is capped at the policy's ``timeoutSeconds`` and ``memoryMb``. A
:class:`~posttrain.sandboxes.executor.SandboxError` (runner unreachable or saturated through
the client's own retries, task pod never scheduled, bubblewrap refused) is retried here with
a capped exponential backoff, counted, and reported through ``on_health`` (the trainer puts
it in ``status.sandbox``; the operator turns that into the ``SandboxAvailable`` condition).
Once one verification has waited ``unavailableTimeoutSeconds``, :class:`VerificationUnavailable`
fails the step, and the run, naming the sandbox. The reward of that sample is never guessed.

The model-based kinds (``judge``, ``reward_model``) go to :mod:`posttrain.trainer.rewards.scorers`
instead: a model that cannot score a sample masks that one sample out of the loss
(:class:`~posttrain.trainer.rewards.scorers.ScoringUnavailable`) rather than stopping the run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from posttrain.api import env
from posttrain.api.env import TrainerEnv
from posttrain.errors import UsageError
from posttrain.trainer.rewards.scorers import MODEL_KINDS, ModelScorers

if TYPE_CHECKING:
    from posttrain.api import SandboxPolicy

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 30.0

INFRA_FAILURES = Counter(
    "posttrain_verifier_infra_failures_total",
    "Executions the sandbox could not perform (retried, never scored), by sandbox mode.",
    ["mode"],
)
SANDBOX_AVAILABLE = Gauge(
    "posttrain_sandbox_available",
    "1 while the trainer's sandbox performs executions, 0 while they keep failing.",
    ["mode"],
)


class VerificationUnavailable(RuntimeError):
    """The sandbox could not verify a sample for longer than the run allows: the step fails
    (and with it the run) rather than scoring the sample as if the model had been wrong."""


@dataclass(frozen=True)
class SandboxHealth:
    """What the trainer reports as ``status.sandbox`` (camelCase on the wire)."""

    mode: str
    endpoint: str
    available: bool = True
    infra_failures: int = 0
    last_error: str | None = None
    last_failure_time: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """
        >>> SandboxHealth("runner", "http://r:8090").to_wire()
        {'mode': 'runner', 'endpoint': 'http://r:8090', 'available': True, 'infraFailures': 0}
        """
        wire = {
            "mode": self.mode,
            "endpoint": self.endpoint,
            "available": self.available,
            "infraFailures": self.infra_failures,
            "lastError": self.last_error,
            "lastFailureTime": self.last_failure_time,
        }
        return {k: v for k, v in wire.items() if v is not None}


class CappedRunner:
    """Applies the policy's ceilings to every request, then runs it on the mode's executor
    (built on first use: a run whose verifiers never execute code needs no sandbox; one that
    cannot be built, e.g. no bubblewrap, fails the run at once with the reason)."""

    def __init__(self, make: Callable[[], Any], timeout_s: float, memory_mb: int) -> None:
        self._make = make
        self._runner: Any = None
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    def run(self, request: Any) -> Any:
        with self._lock:
            if self._runner is None:
                from posttrain.sandboxes.protocol import SandboxError
                from posttrain.sandboxes.tasks import SandboxConfigError

                try:
                    self._runner = self._make()
                except SandboxConfigError:
                    raise
                except SandboxError as exc:  # bwrap missing or too old: waiting won't help
                    raise SandboxConfigError(str(exc)) from exc
        capped = replace(
            request,
            timeout_s=min(request.timeout_s, self.timeout_s),
            memory_mb=min(request.memory_mb, self.memory_mb),
        )
        return self._runner.run(capped)


class Verification:
    """The trainer's ``verify(kind, completion, task, config)`` for one run."""

    def __init__(
        self,
        mode: str,
        endpoint: str,
        executor: Any,
        unavailable_timeout_s: float,
        *,
        on_health: Callable[[SandboxHealth], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        first_backoff_s: float = 0.5,
    ) -> None:
        self.mode, self.executor = mode, executor
        self.unavailable_timeout_s = unavailable_timeout_s
        self.on_health = on_health
        self.sleep = sleep
        self.first_backoff_s = first_backoff_s
        self.health = SandboxHealth(mode, endpoint)
        self._lock = threading.Lock()
        self.models = ModelScorers()  # judges and reward models: their own retries and masking
        SANDBOX_AVAILABLE.labels(mode).set(1)

    def verify(
        self, kind: str, completion: str, task: Mapping[str, Any], config: Mapping[str, Any]
    ) -> Any:
        from posttrain.sandboxes.protocol import SandboxError
        from posttrain.sandboxes.tasks import SandboxConfigError
        from posttrain.sandboxes.verifiers import verify

        if kind in MODEL_KINDS:
            return self.models.verify(kind, completion, task, config)
        waited_since: float | None = None
        attempt = 0
        while True:
            try:
                result = verify(kind, completion, task, config, executor=self.executor)
            except SandboxConfigError as exc:
                self._failed(exc)
                raise VerificationUnavailable(str(exc)) from exc
            except SandboxError as exc:
                self._failed(exc)
                now = time.monotonic()
                waited_since = now if waited_since is None else waited_since
                waited = now - waited_since
                if waited >= self.unavailable_timeout_s:
                    raise VerificationUnavailable(
                        f"the {self.mode} sandbox ({self.health.endpoint}) failed for "
                        f"{waited:.0f} s (sandbox.unavailableTimeoutSeconds="
                        f"{self.unavailable_timeout_s:g}); last error: {exc}"
                    ) from exc
                backoff = min(
                    MAX_BACKOFF_S,
                    self.first_backoff_s * 2**attempt,
                    max(0.0, self.unavailable_timeout_s - waited),
                )
                log.warning(
                    "sandbox (%s %s) could not run a %s verification: %s; retrying "
                    "in %.1f s (waited %.0f of %g s; the sample is not scored)",
                    self.mode,
                    self.health.endpoint,
                    kind,
                    exc,
                    backoff,
                    waited,
                    self.unavailable_timeout_s,
                )
                self.sleep(backoff)
                attempt += 1
                continue
            if kind in ("unit_tests", "shell"):
                self._worked()
            return result

    def _failed(self, exc: BaseException) -> None:
        INFRA_FAILURES.labels(self.mode).inc()
        SANDBOX_AVAILABLE.labels(self.mode).set(0)
        with self._lock:
            self.health = replace(
                self.health,
                available=False,
                infra_failures=self.health.infra_failures + 1,
                last_error=str(exc)[:500],
                last_failure_time=datetime.now(UTC)
                .replace(microsecond=0)
                .isoformat()
                .replace("+00:00", "Z"),
            )
            health = self.health
        if self.on_health:
            self.on_health(health)

    def _worked(self) -> None:
        with self._lock:
            if self.health.available:
                return
            self.health = replace(self.health, available=True)
            health = self.health
        SANDBOX_AVAILABLE.labels(self.mode).set(1)
        log.info(
            "sandbox (%s %s) works again after %d failed execution(s)",
            self.mode,
            health.endpoint,
            health.infra_failures,
        )
        if self.on_health:
            self.on_health(health)


def _own_run_owner(namespace: str, name: str) -> dict[str, Any] | None:
    """An ownerReference to this trainer's TrainingRun (tasks then go with the run)."""
    from kubernetes import client, config

    try:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        run = client.CustomObjectsApi().get_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, "trainingruns", name
        )
    except Exception as exc:  # tasks still work; they are deleted after use and by TTL
        log.warning(
            "could not read TrainingRun %s/%s to own its SandboxTasks: %s", namespace, name, exc
        )
        return None
    # The custom-objects API returns the decoded JSON object (typed ``object``).
    assert isinstance(run, dict), f"TrainingRun {namespace}/{name} is not a JSON object: {run!r}"
    return {
        "apiVersion": "posttrain.io/v1alpha1",
        "kind": "TrainingRun",
        "name": name,
        "uid": run["metadata"]["uid"],
        "controller": False,
        "blockOwnerDeletion": False,
    }


def build_verification(
    policy: SandboxPolicy,
    *,
    on_health: Callable[[SandboxHealth], None] | None = None,
    contract: TrainerEnv | None = None,
) -> Verification:
    """The verification backend ``policy.mode`` names, with its limits. ``contract`` is what
    the operator handed the pod (default: parsed from this process's environment)."""
    contract = TrainerEnv.from_env() if contract is None else contract
    mode = policy.mode
    make: Callable[[], Any]
    if mode == "local":
        from posttrain.sandboxes.executor import default_executor

        endpoint, make = "bubblewrap in the trainer", default_executor
    elif mode == "runner":
        url = policy.runner_url or contract.sandbox_runner_url or ""
        if not url:
            raise UsageError(
                "sandbox.mode is runner but there is no runner: set sandbox.runnerUrl, or run "
                f"the TrainingRun through the operator (it starts one and sets ${env.SANDBOX_RUNNER_URL})"
            )
        from posttrain.sandboxes.client import SandboxClient

        endpoint = url

        def make() -> Any:
            return SandboxClient(url)
    elif mode == "task":
        namespace, name = contract.run_namespace, contract.run_name
        if not namespace or not name:
            raise UsageError(
                "sandbox.mode is task: SandboxTasks are created in the run's namespace, so the "
                f"trainer needs ${env.RUN_NAMESPACE} and ${env.RUN_NAME} (the operator sets "
                "them); on a laptop use sandbox.mode local"
            )
        endpoint = f"SandboxTasks in namespace {namespace}"

        def make() -> Any:
            from posttrain.sandboxes.tasks import SandboxTaskRunner

            return SandboxTaskRunner(
                namespace,
                owner=_own_run_owner(namespace, name),
                runtime_class_name=policy.runtime_class_name,
                cpu=policy.task_cpu,
                name_prefix=f"{name}-verify"[:40],
            )
    else:  # the API's Literal makes this unreachable for a validated spec
        raise UsageError(f"sandbox.mode {mode!r}: use local, runner or task")
    runner = CappedRunner(make, policy.timeout_seconds, policy.memory_mb)
    return Verification(
        mode, endpoint, runner, policy.unavailable_timeout_seconds, on_health=on_health
    )
