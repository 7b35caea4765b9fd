"""Judges and reward models over real HTTP on loopback: strict parsing, retries with backoff,
timeouts, the verdict cache, batching, and masking of what could not be scored.

The fast tests talk to a scripted OpenAI-compatible server (a real HTTP server in a thread
whose replies each test chooses: a flaky judge cannot be had on demand from a model); the
slow one uses the packaged SmolLM2 in ``posttrain serve`` as judge and reward model.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.api import TrainingRunSpec, VerifierSpec
from posttrain.rollout.protocol import Completion
from posttrain.trainer.algorithms.loss import LossConfig
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest
from posttrain.trainer.observe.audit import Auditor
from posttrain.trainer.rewards.scorers import (
    FORMAT_INSTRUCTION,
    ChatJudge,
    Endpoint,
    ModelScorers,
    RewardModelScorer,
    ScoringUnavailable,
)
from posttrain.trainer.rewards.scoring import score_samples
from posttrain.trainer.rewards.verification import Verification
from posttrain.trainer.run.batch import prepare_batch, score_batch

Reply = tuple[int, Any, float]  # status, JSON body, seconds to wait before answering


class ScriptedServer:
    """An HTTP server answering each POST with the next scripted reply (the last repeats)."""

    def __init__(self, replies: list[Reply] | Callable[[dict[str, Any]], Reply]) -> None:
        self.replies = replies
        self.requests: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body, dict(self.headers)))
                if callable(server.replies):
                    status, payload, delay = server.replies(body)
                else:
                    index = min(len(server.requests), len(server.replies)) - 1
                    status, payload, delay = server.replies[index]
                time.sleep(delay)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedServer]]:
    servers: list[ScriptedServer] = []

    def start(replies: Any) -> ScriptedServer:
        servers.append(ScriptedServer(replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def chat(text: str) -> Reply:
    return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}, 0.0


RUBRIC = "Question: {prompt}\nAnswer: {answer}\nReference: {reference}\nGrade it."
TASK = {"domain": "qa", "prompt": "What is 3 + 4?", "answer": "7"}


def judge_settings(url: str, **extra: Any) -> dict[str, Any]:
    spec = VerifierSpec.model_validate(
        {
            "kind": "judge",
            "judge": {
                "url": url,
                "model": "judge",
                "rubric": RUBRIC,
                "backoffSeconds": 0.5,
                **extra,
            },
        }
    )
    endpoint = spec.scorer_config()["endpoint"]
    assert isinstance(endpoint, dict)
    return endpoint


def test_judge_sends_the_rubric_parses_the_score_and_caches(scripted: Any) -> None:
    server = scripted([chat("The answer matches the reference.\nSCORE: 8")])
    judge = ChatJudge(Endpoint("judge", judge_settings(server.url, scale="1-10")))
    first = judge.score("It is 7.", TASK)
    assert first.reward == pytest.approx(7 / 9) and first.passed
    assert first.details["rationale"] == "The answer matches the reference."
    assert first.details["cached"] is False
    path, body, _ = server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "judge"
    assert body["temperature"] == 0.0
    content = body["messages"][0]["content"]
    assert content.startswith("Question: What is 3 + 4?\nAnswer: It is 7.\nReference: 7\n")
    assert content.endswith(FORMAT_INSTRUCTION.format(low="1", high="10"))
    again = judge.score("It is 7.", TASK)  # same (rubric, prompt, answer): no request
    assert again.reward == first.reward and again.details["cached"] is True
    assert len(server.requests) == 1
    judge.score("It is 8.", TASK)  # another answer is another verdict
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    "reply",
    [
        "Looks right.",  # no SCORE line
        "SCORE: 0.9\nI am confident.",  # not the last line
        "SCORE: 1.5",  # outside 0-1
        "SCORE: high",
        "",
    ],
)
def test_judge_format_failures_are_retried_then_masked_never_zero(
    scripted: Any, reply: str
) -> None:
    server = scripted([chat(reply)])
    sleeps: list[float] = []
    endpoint = Endpoint("judge", judge_settings(server.url, maxRetries=2), sleep=sleeps.append)
    with pytest.raises(ScoringUnavailable, match=r"failed 3 times.*ScoreFormatError"):
        ChatJudge(endpoint).score("7", TASK)
    assert len(server.requests) == 3 and sleeps == [0.5, 1.0]  # backoff doubles


def test_judge_retries_server_errors_and_timeouts(scripted: Any) -> None:
    server = scripted(
        [(500, {"error": "overloaded"}, 0.0), chat("late\nSCORE: 1"), chat("ok\nSCORE: 1")]
    )
    server.replies[1] = (200, server.replies[1][1], 1.5)  # answers after the client gave up
    judge = ChatJudge(
        Endpoint(
            "judge",
            judge_settings(server.url, timeoutSeconds=0.5, maxRetries=2),
            sleep=lambda s: None,
        )
    )
    started = time.monotonic()
    result = judge.score("7", TASK)
    assert result.reward == 1.0 and result.details["rationale"] == "ok"
    assert len(server.requests) == 3
    assert time.monotonic() - started < 1.4  # the timed-out request was not waited for


def test_api_key_comes_from_the_named_environment_variable(scripted: Any) -> None:
    server = scripted([chat("SCORE: 1")])
    settings = judge_settings(server.url, apiKeyEnv="JUDGE_KEY")
    ChatJudge(Endpoint("judge", settings, environ={"JUDGE_KEY": "s3cret"})).score("7", TASK)
    headers = {k.lower(): v for k, v in server.requests[0][2].items()}
    assert headers["authorization"] == "Bearer s3cret"


def test_a_pool_judge_goes_round_robin_over_ready_replicas_and_masks_when_none(
    scripted: Any,
) -> None:
    one, two = scripted([chat("SCORE: 1")]), scripted([chat("SCORE: 0")])
    replicas = [one.url.removesuffix("/v1"), two.url.removesuffix("/v1")]
    settings = {**judge_settings(one.url), "url": None, "pool": "judges"}
    judge = ChatJudge(Endpoint("judge", settings, discover=lambda pool: replicas))
    rewards = {judge.score(answer, TASK).reward for answer in ("a", "b", "c", "d")}
    assert rewards == {0.0, 1.0} and len(one.requests) == len(two.requests) == 2
    empty = ChatJudge(Endpoint("judge", {**settings, "max_retries": 0}, discover=lambda pool: []))
    with pytest.raises(ScoringUnavailable, match="no ready replica"):
        empty.score("7", TASK)


def test_unscorable_samples_are_masked_out_of_the_loss_and_the_statistics(
    scripted: Any,
) -> None:
    """Through score_batch and prepare_batch as the loop runs them: the judge fails on one
    answer, whose sample gets no advantage, no reward statistic and no place in its group."""

    def reply(body: dict[str, Any]) -> Reply:
        content = body["messages"][0]["content"]
        if "Answer: unjudgeable" in content:
            return chat("I refuse to grade this.")
        return chat("fine\nSCORE: 1" if "Answer: 7" in content else "wrong\nSCORE: 0")

    server = scripted(reply)
    spec = VerifierSpec.model_validate(
        {
            "kind": "judge",
            "judge": {
                "url": server.url,
                "rubric": RUBRIC,
                "model": "j",
                "maxRetries": 1,
                "backoffSeconds": 0,
                "ruleCheck": "numeric",
            },
        }
    )
    task = Task("qa", "What is 3 + 4?", "7")
    texts = ["7", "5", "unjudgeable", "7"]
    completions = [Completion(0, t, [11, 12], [-0.5, -0.5], "stop", 1) for t in texts]
    batch = RolloutBatch(RolloutRequest(1, [task], [[1, 2]], seed=0), [completions], 1.0)
    algorithm = SimpleNamespace(max_new_tokens=8, overlong_buffer_tokens=0, overlong_penalty=0)
    verification = Verification("local", "none", None, 60.0)
    scored = score_batch(
        batch,
        {"qa": (spec.kind, spec.scorer_config())},
        algorithm,
        max_concurrency=1,
        verify=verification.verify,
    )
    assert [s.errored for s in scored[0]] == [False, False, True, False]
    assert scored[0][2].details["masked"] and "failed 2 times" in scored[0][2].details["error"]
    prepared = prepare_batch(
        batch, scored, algorithm="dr_grpo", dynamic_sampling=True, loss_config=LossConfig(), step=1
    )
    # the group is the three scored samples (rewards 1, 0, 1), not four with a made-up 0
    assert [s.advantage for s in prepared.samples] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert prepared.masked_samples == 1
    assert prepared.domain_rewards == {"qa": pytest.approx(2 / 3)}
    assert prepared.group_pass_rates == [pytest.approx(2 / 3)]
    assert [t.advantage is None for t in prepared.trajectories] == [False, False, True, False]
    # the rule check rides along for the audit: "7" passes it, "5" does not
    assert [s.details.get("rule_passed") for s in scored[0]] == [True, False, None, True]


def test_audit_shows_rationales_and_the_judge_rule_disagreement(tmp_path: Path) -> None:
    from posttrain.trainer.observe.audit import Trajectory

    def judged(passed: bool, rule: bool, rationale: str) -> Trajectory:
        details = {"rationale": rationale, "rule_check": "numeric", "rule_passed": rule}
        return Trajectory(
            3,
            "qa",
            f"t{rationale}",
            "What is 3 + 4?",
            "7",
            float(passed),
            passed,
            1,
            verifier={
                "kind": "judge",
                "reward": float(passed),
                "overlong_penalty": 0.0,
                "details": details,
            },
        )

    auditor = Auditor(tmp_path, spot_check_samples=10)
    batch = [judged(True, True, "matches")] * 15 + [judged(True, False, "generous")] * 6
    alerts = auditor.observe_batch(3, batch)
    assert auditor.judge_disagreement() == {"qa": pytest.approx(6 / 21)}
    assert [a.kind for a in alerts] == ["judge_rule_disagreement"]
    assert auditor.observe_batch(4, batch[:1]) == []  # alerted once per domain
    report = json.loads((tmp_path / "audit" / "judges.json").read_text())
    assert report["qa"]["samples"] == 22 and report["qa"]["disagreements"] == 6
    markdown, _ = auditor.write_spot_checks()
    text = markdown.read_text()
    assert "Judge vs rule check, qa: 6 of 22 samples disagree (27%)" in text
    assert "**Judge's rationale:**" in text and "matches" in text
    assert "rule check numeric: fail" in text
    restored = Auditor(tmp_path, spot_check_samples=10)
    restored.load_state_dict(json.loads(json.dumps(auditor.state_dict())))
    assert restored.judge_counts == auditor.judge_counts


def test_reward_model_batches_concurrent_scorings(scripted: Any) -> None:
    def reply(body: dict[str, Any]) -> Reply:
        scores = [len(c[1]["content"]) - 2.0 for c in body["input"]]  # a logit per answer
        return 200, {"data": [{"index": i, "score": s} for i, s in enumerate(scores)]}, 0.05

    server = scripted(reply)
    spec = VerifierSpec.model_validate(
        {
            "kind": "reward_model",
            "rewardModel": {"url": server.url, "model": "rm", "batchSize": 4},
        }
    )
    scorers = ModelScorers()
    config = spec.scorer_config()
    task = Task("qa", "What is 3 + 4?", "7")
    texts = ["7", "seven", "ab", "x", "abcd", "77", "no", "7!"]
    scored = score_samples(
        texts,
        [1] * 8,
        [task] * 8,
        {"qa": (spec.kind, config)},
        max_new_tokens=8,
        overlong_buffer=0,
        overlong_penalty_value=0,
        verify=lambda k, c, t, cfg: scorers.verify(k, c, t, cfg),
    )
    scorer = scorers.scorer("reward_model", config)
    assert isinstance(scorer, RewardModelScorer)
    assert sum(scorer.batches) == 8 and max(scorer.batches) <= 4 and len(scorer.batches) < 8
    assert all(len(body["input"]) <= 4 for _, body, _ in server.requests)
    logits = [len(t) - 2.0 for t in texts]
    assert [s.details["logit"] for s in scored] == logits
    assert [s.reward for s in scored] == pytest.approx([1 / (1 + 2.718281828**-x) for x in logits])
    assert [s.passed for s in scored] == [x >= 0 for x in logits]


def test_the_api_validates_judges_and_reward_models() -> None:
    def domain(verifier: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": "m",
            "domains": [{"name": "d", "dataset": "builtin:arithmetic", "verifier": verifier}],
        }

    judge = {"url": "http://j/v1", "rubric": "Grade {answer}"}
    TrainingRunSpec.model_validate(domain({"kind": "judge", "judge": judge}))
    bad = [
        ({"kind": "judge"}, "judge is required"),
        ({"kind": "numeric", "judge": judge}, "only allowed"),
        ({"kind": "judge", "judge": {**judge, "rubric": "Grade it"}}, "must contain {answer}"),
        ({"kind": "judge", "judge": {**judge, "pool": "p"}}, "exactly one of pool and url"),
        ({"kind": "judge", "judge": {"rubric": "{answer}"}}, "exactly one of pool and url"),
        ({"kind": "judge", "judge": {**judge, "scale": "1-5"}}, "'0-1' or '1-10'"),
        (
            {"kind": "judge", "judge": {**judge, "apiKeySecret": {"name": "s", "key": "k"}}},
            "apiKeySecret needs apiKeyEnv",
        ),
        ({"kind": "reward_model"}, "rewardModel is required"),
    ]
    for verifier, message in bad:
        with pytest.raises(ValueError, match=message):
            TrainingRunSpec.model_validate(domain(verifier))
    one = {**judge, "apiKeyEnv": "K", "apiKeySecret": {"name": "a", "key": "k"}}
    two = {**one, "apiKeySecret": {"name": "b", "key": "k"}}
    spec = domain({"kind": "judge", "judge": one})
    spec["domains"].append(
        {"name": "e", "dataset": "builtin:arithmetic", "verifier": {"kind": "judge", "judge": two}}
    )
    with pytest.raises(ValueError, match="filled from two Secrets"):
        TrainingRunSpec.model_validate(spec)


@pytest.mark.slow  # loads SmolLM2-135M twice (generator + classifier): 21-196 s measured, by load
def test_packaged_smollm2_as_judge_and_reward_model_through_posttrain_serve() -> None:
    """The real server and model: every sample is either scored from a parsed SCORE line
    (with its rationale) or masked after its retries -- never a made-up 0 --, verdicts are
    cached, and the reward model's batched scores equal its one-by-one scores."""
    from posttrain.rollout.server import ServerConfig, ServerThread

    server = ServerThread(
        ServerConfig(
            model="smollm2-135m-instruct",
            served_model_name="judge",
            reward_model="smollm2-135m-instruct",
            num_threads=2,
        )
    ).start()
    try:
        url = f"{server.url}/v1"
        spec = VerifierSpec.model_validate(
            {
                "kind": "judge",
                "judge": {
                    "url": url,
                    "rubric": "Question: {prompt}\nStudent's answer: {answer}\n"
                    "Correct result: {reference}\nGive 1 if the student is right, else 0.",
                    "maxTokens": 32,
                    "timeoutSeconds": 300,
                    "maxRetries": 1,
                    "backoffSeconds": 0,
                    "ruleCheck": "numeric",
                },
            }
        )
        verification = Verification("local", "none", None, 60.0)
        task = Task("arithmetic", "What is 3 + 4?", "7")
        texts = ["3 + 4 = 7. Answer: 7", "Answer: 9", "SCORE: 1"]
        specs = {"arithmetic": (spec.kind, spec.scorer_config())}
        scored = score_samples(texts, [8] * 3, [task] * 3, specs, max_new_tokens=32,
                               overlong_buffer=0, overlong_penalty_value=0,
                               verify=verification.verify)  # fmt: skip
        judge = verification.models.scorer("judge", spec.scorer_config())
        assert isinstance(judge, ChatJudge)
        for sample in scored:
            if sample.errored:
                assert sample.details["masked"] and "failed 2 times" in sample.details["error"]
            else:
                assert sample.reward in (0.0, 1.0)  # scale 0-1, the reply's own number
                assert isinstance(sample.details["rationale"], str)
                assert sample.details["rule_passed"] in (True, False)
        sent = judge.requests
        again = score_samples(texts, [8] * 3, [task] * 3, specs, max_new_tokens=32,
                              overlong_buffer=0, overlong_penalty_value=0,
                              verify=verification.verify)  # fmt: skip
        failed = sum(s.errored for s in scored)
        assert judge.requests == sent + failed  # verdicts came from the cache
        for before, after in zip(scored, again, strict=True):
            if not before.errored:
                assert after.details["cached"] and after.reward == before.reward

        rm_spec = VerifierSpec.model_validate(
            {"kind": "reward_model", "rewardModel": {"url": url, "batchSize": 3}}
        )
        rm = RewardModelScorer(Endpoint("reward_model", rm_spec.scorer_config()["endpoint"]))
        batched = score_samples(texts, [8] * 3, [task] * 3, {"arithmetic": (rm_spec.kind,
                                rm_spec.scorer_config())}, max_new_tokens=32, overlong_buffer=0,
                                overlong_penalty_value=0, verify=verification.verify)  # fmt: skip
        alone = [rm.score(t, task.to_dict()).details["logit"] for t in texts]
        assert [s.details["logit"] for s in batched] == pytest.approx(alone, abs=1e-4)
        assert len(set(alone)) == 3  # the head sees the answers
    finally:
        server.stop()


@pytest.mark.slow  # a rollout-server process and two RL steps of the tiny model: 11-25 s measured
def test_a_run_trains_on_judge_and_reward_model_domains_with_gspo(
    scripted: Any, tmp_path: Path
) -> None:
    """The loop end to end: TrainingRunSpec -> rundata -> scoring through the run's own
    Verification -> masking -> GSPO step -> audit files; the judge refuses every answer whose
    length is a multiple of 3, and those samples are masked, not trained on."""
    from posttrain.models import make_tiny_model
    from posttrain.rollout.client import RolloutClient
    from posttrain.storage.store import open_store
    from posttrain.storage.trajectories import read_trajectories
    from posttrain.trainer.observe.step_metrics import load_metrics
    from posttrain.trainer.run.loop import train
    from posttrain.trainer.run.server_process import LocalRolloutServer

    def judge_reply(body: dict[str, Any]) -> Reply:
        answer = body["messages"][0]["content"].split("Answer: ", 1)[1].split("\nReference")[0]
        if len(answer) % 3 == 0:
            return chat("cannot grade this")
        return chat("one\nSCORE: 1" if len(answer) % 3 == 1 else "two\nSCORE: 0")

    def reward_reply(body: dict[str, Any]) -> Reply:
        scores = [float(len(c[1]["content"]) % 5) - 2.0 for c in body["input"]]
        return 200, {"data": [{"index": i, "score": s} for i, s in enumerate(scores)]}, 0.0

    judge, rm = scripted(judge_reply), scripted(reward_reply)
    model = make_tiny_model(tmp_path / "model", seed=0)
    spec = TrainingRunSpec.model_validate(
        {
            "model": str(model),
            "algorithm": {"name": "gspo", "groupSize": 4, "promptsPerStep": 2, "maxSteps": 2,
                          "learningRate": 1e-3, "maxNewTokens": 6, "microBatchSize": 4,
                          "dynamicSampling": False, "clipLow": 3e-4, "clipHigh": 4e-4,
                          "lossAggregation": "sequence_mean", "seed": 1},
            "domains": [
                {"name": "judged", "dataset": "builtin:arithmetic",
                 "verifier": {"kind": "judge", "judge": {
                     "url": judge.url, "model": "j", "rubric": RUBRIC, "maxRetries": 1,
                     "backoffSeconds": 0, "ruleCheck": "numeric"}}},
                {"name": "scored", "dataset": "builtin:arithmetic",
                 "verifier": {"kind": "reward_model", "rewardModel": {
                     "url": rm.url, "model": "rm", "batchSize": 4}}},
            ],
            "curriculum": {"minDomainFraction": 0.5},
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 2, "keepLast": 1},
            "audit": {"spotCheckSamples": 16},
        }
    )  # fmt: skip
    out = tmp_path / "run"
    with LocalRolloutServer(spec.model, tmp_path / "server.log") as server:
        client = RolloutClient([server.url], timeout_s=300, max_in_flight=4)
        try:
            result = train(spec, out, client)
        finally:
            client.close()
    assert result.steps_done == 2
    metrics = load_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    records = list(read_trajectories(open_store(str(out)), "trajectories"))
    masked = sum(bool(r["verifier"]["details"].get("masked")) for r in records)
    assert masked > 0 and sum(m["masked_samples"] for m in metrics) == masked
    assert judge.requests and rm.requests  # both domains were scored by their models
    spot = [json.loads(line) for line in (out / "audit" / "spot_checks.jsonl").open()]
    judged = [r for r in spot if r["verifier"]["kind"] == "judge"]
    assert {bool(r["verifier"]["details"].get("masked")) for r in judged} == {True, False}
    for record in judged:
        details = record["verifier"]["details"]
        if details.get("masked"):
            assert record["advantage"] is None and "ScoreFormatError" in details["error"]
        else:
            assert details["rationale"] in ("one", "two")
    assert all(len(body["input"]) <= 4 for _, body, _ in rm.requests)
    report = json.loads((out / "audit" / "judges.json").read_text())
    assert report["judged"]["samples"] >= 1


def test_a_judge_that_cannot_work_as_configured_fails_the_step_not_the_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool judge outside a cluster, or a task asking for a judge its domain does not
    configure: an error naming the fix, never every sample masked or scored 0."""
    from posttrain.trainer.rewards.scorers import ScorerConfigError

    monkeypatch.delenv("POSTTRAIN_RUN_NAMESPACE", raising=False)
    spec = VerifierSpec.model_validate(
        {"kind": "judge", "judge": {"pool": "judges", "rubric": "{answer}"}}
    )
    verification = Verification("local", "none", None, 60.0)
    task = Task("qa", "What is 3 + 4?", "7")

    def run(specs: dict[str, Any], on: Task) -> Any:
        return score_samples(["7"], [1], [on], specs, max_new_tokens=8, overlong_buffer=0,
                             overlong_penalty_value=0, verify=verification.verify)  # fmt: skip

    with pytest.raises(ScorerConfigError, match="give the endpoint's url"):
        run({"qa": (spec.kind, spec.scorer_config())}, task)
    with pytest.raises(ScorerConfigError, match=r"set verifier.judge"):
        run({"qa": ("numeric", {})}, Task("qa", "What is 3 + 4?", "7", verifier="judge"))
