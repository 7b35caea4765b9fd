"""Held-out evaluation: per-domain accuracy of greedy answers, through the rollout server.

Training reward is measured on the prompts being optimised, so it can rise for the
wrong reasons (memorisation, verifier loopholes). Held-out accuracy on items that are
never trained on is the number that says whether the policy got better; the
regression set (scored on the base model at step 0) says what it may have forgotten.
Evaluation samples through the same HTTP rollout server as training, so it measures
exactly the weights the server holds.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import Gauge

from posttrain.progresslog import ItemProgress
from posttrain.telemetry import get_tracer
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.rewards.scoring import VerifyFn, score_samples

if TYPE_CHECKING:
    from posttrain.rollout.client import RolloutClient
    from posttrain.rollout.protocol import SamplingParams

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

# Items sampled and scored per round: enough to keep a server's batch full, few enough that
# a progress line comes every minute or two even on one CPU server (~10 s per HumanEval item).
EVAL_CHUNK = 16

EVAL_ACCURACY = Gauge(
    "posttrain_trainer_eval_accuracy", "Held-out accuracy at the last evaluation", ["domain"]
)


@dataclass
class EvalItem:
    """One evaluated task: what the model answered and whether it passed."""

    task_id: str
    domain: str
    prompt: str
    expected: str
    completion: str
    passed: bool
    reward: float
    difficulty: str = ""  # the task's stratum, so a report can say where a change happened


@dataclass
class EvalResult:
    """Accuracy per domain (pass fraction) at one step, with every item for the report."""

    step: int
    split: str  # "heldout" or "regression"
    accuracy: dict[str, float]
    counts: dict[str, int]
    seconds: float
    items: list[EvalItem] = field(default_factory=list)
    # Domains played as episodes: success rate, mean turns, valid-tool-call rate, recovery
    # rate after a failing command, errored episodes (see posttrain.envs.episode).
    agent: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def overall(self) -> float:
        """Accuracy over all items (domains weighted by their item count)."""
        total = sum(self.counts.values())
        return sum(self.accuracy[d] * self.counts[d] for d in self.counts) / max(total, 1)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "overall": self.overall}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvalResult:
        items = [EvalItem(**item) for item in data.get("items", [])]
        fields = {k: data[k] for k in ("step", "split", "accuracy", "counts", "seconds")}
        return cls(**fields, items=items, agent=data.get("agent", {}))


def accuracy_by_domain(items: Sequence[EvalItem]) -> tuple[dict[str, float], dict[str, int]]:
    """Pass fraction and item count per domain.

    >>> acc, n = accuracy_by_domain([EvalItem("a", "x", "", "", "", True, 1.0),
    ...                              EvalItem("b", "x", "", "", "", False, 0.0)])
    >>> acc, n
    ({'x': 0.5}, {'x': 2})
    """
    passed: dict[str, int] = {}
    counts: dict[str, int] = {}
    for item in items:
        counts[item.domain] = counts.get(item.domain, 0) + 1
        passed[item.domain] = passed.get(item.domain, 0) + int(item.passed)
    return {d: passed[d] / counts[d] for d in sorted(counts)}, {
        d: counts[d] for d in sorted(counts)
    }


def evaluate_tasks(
    client: RolloutClient,
    encode_prompt: Callable[[str], list[int]],
    tasks: Sequence[Task],
    verifier_specs: dict[str, tuple[str | None, dict[str, Any]]],
    *,
    step: int,
    split: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    max_concurrency: int = 2,
    verify: VerifyFn | None = None,
    episodes: Any = None,  # posttrain.envs.training.EpisodeSampler for environment domains
) -> EvalResult:
    """Sample one answer per task (greedy by default) and score it with its verifier; tasks
    of environment domains are played as one episode each and judged by the environment."""
    from posttrain.rollout.protocol import SamplingParams

    started = time.monotonic()
    with tracer.start_as_current_span("trainer.evaluate") as span:
        span.set_attribute("step", step)
        span.set_attribute("split", split)
        span.set_attribute("items", len(tasks))
        params = SamplingParams(n=1, max_tokens=max_new_tokens, temperature=temperature, seed=0)
        played = [t for t in tasks if episodes is not None and episodes.handles(t)]
        tasks = [t for t in tasks if episodes is None or not episodes.handles(t)]
        label = "evaluation" if split == "eval" else f"{split} evaluation at step {step}"
        items = _answer_and_score(
            client,
            encode_prompt,
            tasks,
            verifier_specs,
            params,
            ItemProgress(label, len(tasks)),
            max_new_tokens=max_new_tokens,
            max_concurrency=max_concurrency,
            verify=verify,
        )
        agent: dict[str, dict[str, float]] = {}
        if played:
            finished, agent = episodes.evaluate(played, params)
            # An errored episode is the environment's failure: counted in ``agent``, never
            # an item scored wrong.
            items += [
                EvalItem(
                    e.task.task_id,
                    e.task.domain,
                    e.task.prompt,
                    e.task.answer or "",
                    e.transcript(),
                    e.passed,
                    e.reward,
                    e.task.difficulty,
                )
                for e in finished
                if e.status != "errored"
            ]
        accuracy, counts = accuracy_by_domain(items)
        result = EvalResult(step, split, accuracy, counts, time.monotonic() - started, items, agent)
        span.set_attribute("accuracy", result.overall)
    if split == "heldout":
        for domain, value in accuracy.items():
            EVAL_ACCURACY.labels(domain).set(value)
    log.info(
        "eval %s step %d: %s (%.0fs)",
        split,
        step,
        ", ".join(f"{d}={a:.1%}" for d, a in accuracy.items()),
        result.seconds,
    )
    return result


def _answer_and_score(
    client: RolloutClient,
    encode_prompt: Callable[[str], list[int]],
    tasks: Sequence[Task],
    verifier_specs: dict[str, tuple[str | None, dict[str, Any]]],
    params: SamplingParams,
    progress: ItemProgress,
    *,
    max_new_tokens: int,
    max_concurrency: int,
    verify: VerifyFn | None,
) -> list[EvalItem]:
    """One answer per (single-turn) task, scored by its verifier; items a judge could not
    score are left out (not scored wrong)."""
    completions: list[Any] = []
    scored: list[Any] = []
    # In chunks, so a long evaluation (164 HumanEval items: half an hour on CPU) logs
    # done/total, rate and ETA as it goes instead of staying silent to the end.
    for first in range(0, len(tasks), EVAL_CHUNK):
        chunk = tasks[first : first + EVAL_CHUNK]
        groups = client.generate([encode_prompt(t.prompt) for t in chunk], params)
        chunk_completions = [group[0] for group in groups]
        scored += score_samples(
            [c.text for c in chunk_completions],
            [len(c.token_ids) for c in chunk_completions],
            chunk,
            verifier_specs,
            max_new_tokens=max_new_tokens,
            overlong_buffer=0,
            overlong_penalty_value=0.0,
            max_concurrency=max_concurrency,
            verify=verify,
        )
        completions += chunk_completions
        progress.advance(len(chunk))
    if tasks:
        progress.finish()
    return [
        EvalItem(
            task_id=t.task_id,
            domain=t.domain,
            prompt=t.prompt,
            expected=t.answer if t.answer is not None else (t.tests or ""),
            completion=c.text,
            passed=s.passed,
            reward=s.verifier_reward,
            difficulty=t.difficulty,
        )
        for t, c, s in zip(tasks, completions, scored, strict=True)
        if not s.errored  # a judge that could not score it: not an item scored wrong
    ]


def save_eval(result: EvalResult, out_dir: Path) -> Path:
    """Write ``eval/<split>_step<NNNN>.json`` and append a summary line to ``eval/history.jsonl``."""
    eval_dir = out_dir / "eval"
    eval_dir.mkdir(parents=True, exist_ok=True)
    path = eval_dir / f"{result.split}_step{result.step:04d}.json"
    path.write_text(json.dumps(result.to_json(), indent=1))
    summary = {k: v for k, v in result.to_json().items() if k != "items"}
    with (eval_dir / "history.jsonl").open("a") as fh:
        fh.write(json.dumps(summary) + "\n")
    return path
