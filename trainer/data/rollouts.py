"""The rollout stage: a producer thread sampling batches ahead, with bounded staleness.

Why a thread: sampling and the optimizer step use different resources (the rollout
server vs. the trainer's cores/GPU), so overlapping them hides one behind the other.
The price is off-policy data; ``max_policy_lag = k`` bounds it:

* the trainer *chooses* the prompts of batch ``b`` (so curriculum state changes only in
  the trainer thread and a resumed run makes the same choices), and submits up to
  ``k + 1`` batches ahead;
* the producer may start sampling batch ``b`` only once the trainer has finished step
  ``b - 1 - k`` and told the server about the new weights, so with ``k = 0`` every
  batch is sampled by exactly the weights it is trained against (strictly on-policy);
* every completion carries the server's ``weight_version``; when the trainer takes a
  batch whose version is more than ``k`` behind its own, the batch is dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from posttrain.telemetry import get_tracer
from posttrain.trainer.data.datasets import Task

if TYPE_CHECKING:
    from posttrain.rollout.client import RolloutClient
    from posttrain.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

ROLLOUT_SECONDS = Gauge("posttrain_trainer_rollout_seconds", "Wall time of the last rollout batch")
STALE_BATCHES = Counter(
    "posttrain_trainer_stale_batches_total", "Rollout batches dropped for exceeding max_policy_lag"
)


@dataclass
class RolloutRequest:
    """Prompts the trainer chose for batch ``batch_index`` (``group_size`` samples each)."""

    batch_index: int
    tasks: list[Task]
    prompt_ids: list[list[int]]
    seed: int


@dataclass
class RolloutBatch:
    """A sampled batch: ``completions[i]`` are the group of ``tasks[i]``."""

    request: RolloutRequest
    completions: list[list[Any]]  # list[list[posttrain.rollout.protocol.Completion]]
    seconds: float
    error: str | None = None

    @property
    def weight_version(self) -> int:
        """The oldest weights any sample of the batch came from."""
        versions = [c.weight_version for group in self.completions for c in group]
        return min(versions) if versions else -1


@dataclass
class _Gate:
    """How many trainer steps are finished (and their weights loaded on the server)."""

    steps_done: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)


class RolloutProducer:
    """Runs ``client.generate`` for submitted requests in order, on a background thread."""

    def __init__(
        self,
        client: RolloutClient,
        sampling_params: SamplingParams,
        max_policy_lag: int,
        steps_done: int = 0,
        sample: Any = None,
    ) -> None:
        self.client = client
        # sample(request, params) -> one group per prompt; multi-turn domains pass an
        # episode sampler (posttrain.envs.training.EpisodeSampler).
        self.sample = sample or (
            lambda request, params: client.generate(request.prompt_ids, params)
        )
        self.sampling_params = sampling_params  # SamplingParams; seed replaced per batch
        self.max_policy_lag = max_policy_lag
        self._gate = _Gate(steps_done=steps_done)
        self._requests: queue.Queue[RolloutRequest | None] = queue.Queue()
        self._results: dict[int, RolloutBatch] = {}
        self._results_cond = threading.Condition()
        self._pending: dict[int, RolloutRequest] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def submit(self, request: RolloutRequest) -> None:
        self._pending[request.batch_index] = request
        self._requests.put(request)

    def preload(self, batch: RolloutBatch) -> None:
        """Put back a batch sampled before a checkpoint (resume without re-sampling)."""
        with self._results_cond:
            self._results[batch.request.batch_index] = batch
            self._pending[batch.request.batch_index] = batch.request
            self._results_cond.notify_all()

    def step_finished(self, steps_done: int) -> None:
        """The trainer finished ``steps_done`` steps and the server has those weights."""
        with self._gate.cond:
            self._gate.steps_done = steps_done
            self._gate.cond.notify_all()

    def take(self, batch_index: int, timeout: float) -> RolloutBatch:
        """Block until batch ``batch_index`` is sampled; raises TimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._results_cond:
            while batch_index not in self._results:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"rollout batch {batch_index} not ready after {timeout:.0f}s; is the "
                        "rollout server overloaded or down? (raise rollout.timeoutSeconds)"
                    )
                self._results_cond.wait(remaining)
            self._pending.pop(batch_index, None)
            return self._results.pop(batch_index)

    def buffered(self) -> tuple[list[RolloutRequest], list[RolloutBatch]]:
        """Requests not yet taken and batches sampled but not yet trained on (checkpoints)."""
        with self._results_cond:
            done = sorted(self._results.values(), key=lambda b: b.request.batch_index)
            done_ids = {b.request.batch_index for b in done}
            waiting = [r for i, r in sorted(self._pending.items()) if i not in done_ids]
            return waiting, done

    def close(self) -> None:
        self._stop.set()
        self._requests.put(None)
        with self._gate.cond:
            self._gate.cond.notify_all()
        self._thread.join(timeout=5)

    def _wait_for_weights(self, batch_index: int) -> bool:
        # Batch b is trained at step b; it may be sampled by weights at most k steps older
        # than those of step b, i.e. once steps 1 .. b-1-k are finished.
        needed = batch_index - 1 - self.max_policy_lag
        with self._gate.cond:
            while self._gate.steps_done < needed and not self._stop.is_set():
                self._gate.cond.wait(timeout=1.0)
        return not self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.is_set():
            request = self._requests.get()
            if request is None:
                return
            with self._results_cond:
                if request.batch_index in self._results:  # preloaded from a checkpoint
                    continue
            if not self._wait_for_weights(request.batch_index):
                return
            started = time.monotonic()
            error = None
            with tracer.start_as_current_span("trainer.rollout") as span:
                span.set_attribute("batch", request.batch_index)
                span.set_attribute("prompts", len(request.prompt_ids))
                try:
                    params = _with_seed(self.sampling_params, request.seed)
                    completions = self.sample(request, params)
                except Exception as exc:  # surfaced to the trainer thread by take()
                    log.error("rollout batch %d failed: %s", request.batch_index, exc)
                    completions, error = [], f"{type(exc).__name__}: {exc}"
            seconds = time.monotonic() - started
            ROLLOUT_SECONDS.set(seconds)
            with self._results_cond:
                self._results[request.batch_index] = RolloutBatch(
                    request, completions, seconds, error
                )
                self._results_cond.notify_all()


def _with_seed(params: Any, seed: int) -> Any:
    from dataclasses import replace

    return replace(params, seed=seed)


def is_too_stale(batch: RolloutBatch, policy_version: int, max_policy_lag: int) -> bool:
    """True when the batch's oldest weights are more than ``max_policy_lag`` versions behind.

    >>> from types import SimpleNamespace as NS
    >>> b = RolloutBatch(RolloutRequest(0, [], [], 0), [[NS(weight_version=3)]], 0.0)
    >>> is_too_stale(b, 4, 0), is_too_stale(b, 4, 1)
    (True, False)
    """
    return policy_version - batch.weight_version > max_policy_lag
