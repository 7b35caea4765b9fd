"""Evaluation off the training path: score committed checkpoints while training goes on.

With hundreds of domains a held-out pass (``maxItemsPerDomain`` items each) takes longer
than a training step, and inline evaluation runs it on rank 0 between steps, so every
rank waits. With ``evaluation.inline: false`` the trainer skips it and this evaluator, a
separate process (``posttrain eval-checkpoints``, locally or as a Job beside the run),
does the same work on its own rollout server: it scores the base model as step 0, then
every checkpoint the trainer commits to the run's storage, with the same function
(:func:`posttrain.trainer.evaluation.heldout.evaluate_tasks`), so its numbers equal inline ones.

Results go where inline results go: ``eval/<split>_stepNNNN.json`` in ``--out`` and, for a
run whose storage is a store URI, under the run prefix's ``reports/eval/`` (what
``posttrain report s3://...`` reads). A step whose result is already there is not
evaluated again, so a restarted evaluator picks up where it stopped. A checkpoint that
retention (``keepLast``) pruned before the evaluator reached it is skipped with a log line.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from posttrain.telemetry import get_tracer
from posttrain.trainer.checkpointing.checkpoint import weights_only
from posttrain.trainer.data.rundata import RunData
from posttrain.trainer.evaluation.heldout import EvalResult, evaluate_tasks, save_eval

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

EVALUATED_STEP = Gauge("posttrain_evaluator_step", "Newest checkpoint step the evaluator scored")
EVAL_LAG = Gauge(
    "posttrain_evaluator_lag_steps", "Committed checkpoint steps not yet scored by the evaluator"
)
REPORTS_EVAL = "reports/eval"  # under the run prefix: storage.reports.REPORTS_DIR + "/eval"


def result_key(split: str, step: int) -> str:
    """Store key of one evaluation, relative to the run prefix.

    >>> result_key("heldout", 12)
    'reports/eval/heldout_step0012.json'
    """
    return f"{REPORTS_EVAL}/{split}_step{step:04d}.json"


class CheckpointEvaluator:
    """Scores the base model and each committed checkpoint of one run, oldest first."""

    def __init__(
        self,
        spec: Any,
        store: Any,
        data: RunData,
        client: Any,
        encode_prompt: Callable[[str], list[int]],
        out_dir: Path,
    ) -> None:
        from posttrain.storage.checkpoints import CheckpointManager

        self.spec, self.store, self.data, self.client = spec, store, data, client
        self.encode_prompt, self.out_dir = encode_prompt, out_dir
        self.checkpoints = CheckpointManager(
            store, "checkpoints", keep_last=spec.checkpoint.keep_last
        )

    def done_steps(self) -> set[int]:
        """Steps whose held-out result is already in the store."""
        done = set()
        for key in self.store.list(f"{REPORTS_EVAL}/heldout_step"):
            name = key.rsplit("/", 1)[-1]
            done.add(int(name.removeprefix("heldout_step").removesuffix(".json")))
        return done

    def pending_steps(self) -> list[int]:
        """Step 0 (the base model) and committed checkpoints not yet scored, ascending."""
        done = self.done_steps()
        return [s for s in [0, *self.checkpoints.list_steps()] if s not in done]

    def evaluate_step(self, step: int) -> EvalResult | None:
        """Load step's weights into the server (step 0: the base model it started with),
        score the held-out and regression sets, store the results; None if pruned."""
        with tracer.start_as_current_span("evaluator.checkpoint") as span:
            span.set_attribute("step", step)
            if step > 0 and not self._load_checkpoint(step):
                return None
            result = self._score(step, "heldout", self.data.heldout)
            if self.data.regression:
                self._score(step, "regression", self.data.regression)
            EVALUATED_STEP.set(step)
            return result

    def _load_checkpoint(self, step: int) -> bool:
        scratch = Path(tempfile.mkdtemp(prefix=f"posttrain-eval-step{step}-"))
        try:
            try:
                self.checkpoints.load(step, scratch, include=weights_only)
            except Exception as exc:  # pruned by retention, or damaged
                log.warning("checkpoint step %d is no longer loadable (%s); skipped", step, exc)
                return False
            # The server runs beside us, so it reads the directory in place.
            self.client.load_weights(str(scratch), step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return True

    def _score(self, step: int, split: str, tasks: list[Any]) -> EvalResult:
        evaluation, algo = self.spec.evaluation, self.spec.algorithm
        result = evaluate_tasks(
            self.client,
            self.encode_prompt,
            tasks,
            self.data.verifiers,
            step=step,
            split=split,
            max_new_tokens=algo.max_new_tokens,
            temperature=evaluation.temperature,
            max_concurrency=self.spec.sandbox.max_concurrency,
        )
        path = save_eval(result, self.out_dir)
        # The held-out file is written last: its presence marks the step as done.
        self.store.put_bytes(result_key(split, step), json.dumps(result.to_json()).encode())
        log.info(
            "evaluated step %d (%s): %.1f%% -> %s",
            step,
            split,
            100 * result.overall,
            self.store.uri(result_key(split, step)) if split == "heldout" else path,
        )
        return result

    def run(
        self, *, watch: bool, poll_seconds: float = 30.0, stop: Callable[[], bool] = lambda: False
    ) -> list[int]:
        """Score every pending step; with ``watch``, keep polling until the run's final
        checkpoint (``maxSteps``) is scored or ``stop()`` says the trainer is gone (one
        last pass then). Returns the steps scored."""
        scored: list[int] = []
        final = self.spec.algorithm.max_steps
        next_log = 0.0
        while True:
            stopping = stop()  # read first: a checkpoint committed before it is still scored
            pending = self.pending_steps()
            EVAL_LAG.set(len(pending))
            for step in pending:
                if self.evaluate_step(step) is not None:
                    scored.append(step)
            if not watch or stopping or final in self.done_steps():
                return scored
            if time.monotonic() >= next_log:
                log.info(
                    "waiting for checkpoints under %s (final step %d; polling every %.0f s)",
                    self.store.uri("checkpoints"),
                    final,
                    poll_seconds,
                )
                next_log = time.monotonic() + 300
            time.sleep(poll_seconds)
