"""Reward-hacking monitors and spot-check exports.

RL optimises the verifier, not the intent behind it, so the run watches for the usual
symptoms and writes them to ``audit/alerts.jsonl`` (and the log) instead of failing:

* **reward/held-out divergence**: training reward of a domain keeps rising between two
  evaluations while its held-out accuracy does not;
* **verifier hack signals**: verifiers report suspicious patterns in ``details``
  (e.g. tests edited, ``exit()`` before asserts) -- counted per domain;
* **empty answers that pass**: a completion with no content scoring as passed means the
  verifier accepts format without substance;
* **judge vs rule disagreement**: where a judge runs beside a rule check (``judge.ruleCheck``
  on tasks with an answer), the share of samples on which their pass/fail verdicts differ,
  per domain, in ``audit/judges.json`` and the spot checks; above
  ``JUDGE_DISAGREEMENT_ALERT`` (over at least ``JUDGE_DISAGREEMENT_MIN`` samples) it is an
  alert. A judge the policy has learnt to please shows up here first.

A seeded sample of trajectories is exported to Markdown and JSONL for a human to read.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from prometheus_client import Counter

log = logging.getLogger(__name__)

HACK_ALERTS = Counter(
    "posttrain_trainer_hack_alerts_total", "Reward-hacking alerts raised", ["kind", "domain"]
)
DIVERGENCE_MIN_REWARD_RISE = 0.05  # reward must rise this much between evals to count
JUDGE_DISAGREEMENT_ALERT = 0.2  # judge and rule check differ on more than this share...
JUDGE_DISAGREEMENT_MIN = 20  # ...of at least this many samples of a domain


@dataclass(frozen=True)
class Alert:
    step: int
    kind: str  # reward_heldout_divergence | hack_signal | empty_answer_passed | judge_rule_disagreement
    domain: str
    message: str


LOGPROB_DECIMALS = 4  # see round_logprobs


@dataclass(frozen=True)
class Trajectory:
    """One sampled completion as the auditor and the trajectory log see it.

    The token ids are exactly what the rollout server sampled and the trainer trained on;
    ``completion_logprobs[i]`` is the behaviour policy's log-prob of
    ``completion_token_ids[i]`` as sampled (rounded, see :func:`round_logprobs`).
    ``advantage`` is None when dynamic sampling dropped the group (not trained on).
    """

    step: int
    domain: str
    task_id: str
    prompt: str
    completion: str
    reward: float
    passed: bool
    weight_version: int
    hack_signals: tuple[str, ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    completion_token_ids: tuple[int, ...] = ()
    completion_logprobs: tuple[float, ...] = ()
    advantage: float | None = None
    finish_reason: str = ""
    verifier: dict[str, Any] = field(default_factory=dict)  # kind, reward parts, details


def round_logprobs(
    logprobs: Sequence[float], decimals: int = LOGPROB_DECIMALS
) -> tuple[float, ...]:
    """Log-probs rounded to ``decimals`` places, the bulk of a record made ~3x shorter.

    Why 4 places: a log-prob only enters the loss through the importance ratio
    ``exp(logp - behaviour)``, so an absolute error of at most 5e-5 is a relative ratio
    error of at most 5e-5 -- far below the clip range (0.2) and below the usual
    sampler/trainer numeric mismatch (~1e-3 in bf16). Absolute, not significant, digits
    for the same reason. ``-0.0`` is written as ``0.0``.

    >>> round_logprobs([-0.123456789, -2.5e-06, -17.000049])
    (-0.1235, 0.0, -17.0)
    """
    return tuple(round(float(v), decimals) + 0.0 for v in logprobs)


def trajectory_record(t: Trajectory) -> dict[str, Any]:
    """The storage record (``posttrain.storage.trajectories``) of one trajectory.

    >>> r = trajectory_record(Trajectory(1, "m", "id", "1+1?", "2", 1.0, True, 0,
    ...                                  completion_token_ids=(17,), completion_logprobs=(-0.5,)))
    >>> r["completion_token_ids"], r["completion_logprobs"], r["hack_signals"]
    ([17], [-0.5], [])
    """
    record = asdict(t)
    for name in ("hack_signals", "prompt_token_ids", "completion_token_ids", "completion_logprobs"):
        record[name] = list(record[name])
    return record


def trajectory_from_record(record: dict[str, Any]) -> Trajectory:
    """Inverse of :func:`trajectory_record`; records written before a field existed get its
    default (older checkpoints and trajectory logs stay readable)."""
    known = {f.name for f in fields(Trajectory)}
    values = {k: v for k, v in record.items() if k in known}
    for name in ("hack_signals", "prompt_token_ids", "completion_token_ids", "completion_logprobs"):
        if name in values:
            values[name] = tuple(values[name])
    return Trajectory(**values)


def verifier_record(
    kind: str, verifier_reward: float, overlong_penalty: float, details: dict[str, Any]
) -> dict[str, Any]:
    """The ``verifier`` field of a trajectory record: which verifier, its score, the length
    penalty the trainer added, and the verifier's own details (test results, stderr tail),
    minus ``hack_signals``, which the record carries at top level.

    >>> verifier_record("numeric", 1.0, -0.5, {"parsed": 7.0, "hack_signals": []})
    {'kind': 'numeric', 'reward': 1.0, 'overlong_penalty': -0.5, 'details': {'parsed': 7.0}}
    """
    return {
        "kind": kind,
        "reward": verifier_reward,
        "overlong_penalty": overlong_penalty,
        "details": {k: v for k, v in details.items() if k != "hack_signals"},
    }


def verifier_summary(verifier: dict[str, Any]) -> str:
    """One line for the spot-check Markdown.

    >>> verifier_summary({"kind": "unit_tests", "reward": 0.5, "overlong_penalty": 0.0,
    ...                   "details": {"tests_passed": 1, "tests_total": 2}})
    'unit_tests, score 0.50, 1/2 tests passed'
    """
    parts = [str(verifier.get("kind", "?")), f"score {float(verifier.get('reward', 0.0)):.2f}"]
    if verifier.get("overlong_penalty"):
        parts.append(f"overlong penalty {float(verifier['overlong_penalty']):.2f}")
    details = verifier.get("details", {})
    for done, total, noun in (
        ("tests_passed", "tests_total", "tests"),
        ("checks_passed", "checks_total", "checks"),
    ):
        if total in details:
            parts.append(f"{details.get(done, 0)}/{details[total]} {noun} passed")
    if details.get("masked"):
        parts.append("not scored (masked out of the loss)")
    if "rule_passed" in details:
        parts.append(f"rule check {details.get('rule_check')}: "
                     f"{'pass' if details['rule_passed'] else 'fail'}")  # fmt: skip
    if "error" in details:
        parts.append(f"error: {str(details['error'])[:200]}")
    return ", ".join(parts)


def judge_agreement(trajectories: Sequence[Trajectory]) -> dict[str, tuple[int, int]]:
    """Per domain ``(samples with both verdicts, samples where judge and rule differ)``.

    >>> def t(passed, rule):
    ...     details = {"rule_check": "numeric", "rule_passed": rule}
    ...     return Trajectory(1, "m", "id", "p", "c", float(passed), passed, 0,
    ...                       verifier={"kind": "judge", "details": details})
    >>> judge_agreement([t(True, True), t(True, False), t(False, False)])
    {'m': (3, 1)}
    """
    out: dict[str, tuple[int, int]] = {}
    for t in trajectories:
        details = t.verifier.get("details", {}) if t.verifier else {}
        if "rule_passed" not in details or details.get("masked"):
            continue
        both, differ = out.get(t.domain, (0, 0))
        out[t.domain] = (both + 1, differ + int(bool(details["rule_passed"]) != t.passed))
    return out


def divergence_alerts(
    step: int,
    reward_at_eval: dict[str, tuple[float, float]],
    accuracy_at_eval: dict[str, tuple[float, float]],
    min_rise: float = DIVERGENCE_MIN_REWARD_RISE,
) -> list[Alert]:
    """Domains whose mean reward rose by ``min_rise`` while held-out accuracy did not rise.

    Both maps give ``domain -> (value at previous eval, value now)``.

    >>> [a.domain for a in divergence_alerts(5, {"m": (0.2, 0.5)}, {"m": (0.4, 0.4)})]
    ['m']
    >>> divergence_alerts(5, {"m": (0.2, 0.5)}, {"m": (0.4, 0.45)})
    []
    """
    alerts = []
    for domain, (reward_before, reward_now) in sorted(reward_at_eval.items()):
        if domain not in accuracy_at_eval:
            continue
        acc_before, acc_now = accuracy_at_eval[domain]
        if reward_now - reward_before >= min_rise and acc_now <= acc_before:
            alerts.append(
                Alert(
                    step,
                    "reward_heldout_divergence",
                    domain,
                    f"train reward {reward_before:.2f}->{reward_now:.2f} but held-out accuracy "
                    f"{acc_before:.2f}->{acc_now:.2f}: check spot checks for verifier exploits",
                )
            )
    return alerts


def sample_alerts(step: int, trajectories: Sequence[Trajectory]) -> list[Alert]:
    """Per-sample alerts: verifier hack signals, and empty completions that passed.

    >>> t = Trajectory(1, "m", "id", "p", "  ", 1.0, True, 0)
    >>> [a.kind for a in sample_alerts(1, [t])]
    ['empty_answer_passed']
    """
    alerts = []
    for t in trajectories:
        for signal in t.hack_signals:
            alerts.append(Alert(step, "hack_signal", t.domain, f"task {t.task_id}: {signal}"))
        if t.passed and not t.completion.strip():
            alerts.append(
                Alert(step, "empty_answer_passed", t.domain, f"task {t.task_id} passed empty")
            )
    return alerts


class Auditor:
    """Collects alerts over a run and keeps a reservoir of trajectories for spot checks."""

    def __init__(self, out_dir: Path, spot_check_samples: int, seed: int = 0) -> None:
        self.dir = out_dir / "audit"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spot_check_samples = spot_check_samples
        self.rng = random.Random(seed)
        self.reservoir: list[Trajectory] = []
        self.seen = 0
        self.alerts: list[Alert] = []
        self._reward_at_last_eval: dict[str, float] = {}
        self._accuracy_at_last_eval: dict[str, float] = {}
        self.judge_counts: dict[str, tuple[int, int]] = {}  # domain -> (both, differ)
        self._judge_alerted: set[str] = set()

    def observe_batch(self, step: int, trajectories: Sequence[Trajectory]) -> list[Alert]:
        """Per-sample checks plus reservoir sampling (uniform over the whole run)."""
        alerts = sample_alerts(step, trajectories)
        for domain, (both, differ) in judge_agreement(trajectories).items():
            total_both, total_differ = self.judge_counts.get(domain, (0, 0))
            self.judge_counts[domain] = (total_both + both, total_differ + differ)
        for domain, rate in self.judge_disagreement().items():
            both = self.judge_counts[domain][0]
            noisy = both >= JUDGE_DISAGREEMENT_MIN and rate > JUDGE_DISAGREEMENT_ALERT
            if noisy and domain not in self._judge_alerted:  # once per domain and run
                self._judge_alerted.add(domain)
                alerts.append(Alert(step, "judge_rule_disagreement", domain,
                                    f"judge and rule check disagree on {rate:.0%} of {both} "
                                    "samples: read the judge's rationales in the spot "
                                    "checks"))  # fmt: skip
        for t in trajectories:
            self.seen += 1
            if len(self.reservoir) < self.spot_check_samples:
                self.reservoir.append(t)
            else:
                j = self.rng.randrange(self.seen)
                if j < self.spot_check_samples:
                    self.reservoir[j] = t
        if self.judge_counts:
            (self.dir / "judges.json").write_text(json.dumps(self.judge_report(), indent=1))
        return self._raise(alerts)

    def judge_disagreement(self) -> dict[str, float]:
        """Per domain, the share of judged samples whose rule check disagreed, so far."""
        return {d: differ / both for d, (both, differ) in self.judge_counts.items() if both}

    def judge_report(self) -> dict[str, dict[str, float]]:
        """What ``audit/judges.json`` holds: per domain samples, disagreements and rate."""
        return {
            d: {"samples": both, "disagreements": differ, "rate": differ / both if both else 0.0}
            for d, (both, differ) in sorted(self.judge_counts.items())
        }

    def observe_eval(
        self, step: int, recent_reward: dict[str, float], accuracy: dict[str, float]
    ) -> list[Alert]:
        """Compare reward and held-out accuracy with their values at the previous eval."""
        alerts: list[Alert] = []
        if self._accuracy_at_last_eval:
            rewards = {
                d: (self._reward_at_last_eval[d], r)
                for d, r in recent_reward.items()
                if d in self._reward_at_last_eval
            }
            accs = {
                d: (self._accuracy_at_last_eval[d], a)
                for d, a in accuracy.items()
                if d in self._accuracy_at_last_eval
            }
            alerts = divergence_alerts(step, rewards, accs)
        self._reward_at_last_eval = dict(recent_reward)
        self._accuracy_at_last_eval = dict(accuracy)
        return self._raise(alerts)

    def _raise(self, alerts: list[Alert]) -> list[Alert]:
        if alerts:
            with (self.dir / "alerts.jsonl").open("a") as fh:
                for alert in alerts:
                    fh.write(json.dumps(asdict(alert)) + "\n")
                    HACK_ALERTS.labels(alert.kind, alert.domain).inc()
                    log.warning("audit %s [%s]: %s", alert.kind, alert.domain, alert.message)
        self.alerts.extend(alerts)
        return alerts

    def write_spot_checks(self) -> tuple[Path, Path]:
        """Export the reservoir to ``spot_checks.jsonl`` and a readable ``spot_checks.md``."""
        ordered = sorted(self.reservoir, key=lambda t: (t.step, t.domain, t.task_id))
        jsonl = self.dir / "spot_checks.jsonl"
        jsonl.write_text("".join(json.dumps(trajectory_record(t)) + "\n" for t in ordered))
        lines = ["# Spot checks", "", f"{len(ordered)} trajectories sampled uniformly", ""]
        for domain, row in self.judge_report().items():
            lines += [f"Judge vs rule check, {domain}: {int(row['disagreements'])} of "
                      f"{int(row['samples'])} samples disagree ({row['rate']:.0%})", ""]  # fmt: skip
        fence = "````"  # longer than any ``` a completion may contain
        for t in ordered:
            verdict = "PASS" if t.passed else "fail"
            lines += [
                f"## step {t.step} · {t.domain} · {verdict} · reward {t.reward:.2f}",
                "",
                f"**Prompt:** {t.prompt}",
                "",
                f"{fence}text",
                t.completion,
                fence,
                "",
            ]
            if t.verifier:
                lines += [f"**Verifier:** {verifier_summary(t.verifier)}", ""]
                rationale = t.verifier.get("details", {}).get("rationale")
                if rationale:
                    lines += ["**Judge's rationale:**", "", f"{fence}text", rationale, fence, ""]
            if t.hack_signals:
                lines += [f"**Hack signals:** {', '.join(t.hack_signals)}", ""]
        markdown = self.dir / "spot_checks.md"
        markdown.write_text("\n".join(lines))
        return markdown, jsonl

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {
            "rng": [version, list(internal), gauss],
            "seen": self.seen,
            "reservoir": [trajectory_record(t) for t in self.reservoir],
            "reward_at_last_eval": self._reward_at_last_eval,
            "accuracy_at_last_eval": self._accuracy_at_last_eval,
            "judge_counts": {d: list(v) for d, v in self.judge_counts.items()},
            "judge_alerted": sorted(self._judge_alerted),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.seen = int(state["seen"])
        self.reservoir = [trajectory_from_record(t) for t in state["reservoir"]]
        self._reward_at_last_eval = dict(state["reward_at_last_eval"])
        self._accuracy_at_last_eval = dict(state["accuracy_at_last_eval"])
        # Checkpoints from before judges existed have neither key.
        self.judge_counts = {
            d: (int(v[0]), int(v[1])) for d, v in state.get("judge_counts", {}).items()
        }
        self._judge_alerted = set(state.get("judge_alerted", []))
