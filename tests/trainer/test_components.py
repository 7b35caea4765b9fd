"""Audit monitors, status reporters, report/plots and CLI errors (all-reduce: test_distributed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from posttrain.cli import main
from posttrain.devenv.process import free_port
from posttrain.trainer.evaluation.heldout import EvalItem, EvalResult, save_eval
from posttrain.trainer.observe.audit import Auditor, Trajectory
from posttrain.trainer.observe.run_report import plot_run, write_report
from posttrain.trainer.observe.status import KubeStatusReporter, LocalStatusReporter, RunStatus
from posttrain.trainer.observe.step_metrics import ProgressReporter, StepMetrics


def _traj(step: int, text: str, passed: bool, signals: tuple[str, ...] = ()) -> Trajectory:
    return Trajectory(step, "code", f"t{step}", "write f", text, float(passed), passed, 0, signals)


def test_auditor_flags_hacks_empty_passes_and_divergence(tmp_path: Path) -> None:
    auditor = Auditor(tmp_path, spot_check_samples=2, seed=0)
    alerts = auditor.observe_batch(
        1, [_traj(1, "", True), _traj(1, "ok", True, ("exit_early",)), _traj(1, "fine", False)]
    )
    assert sorted(a.kind for a in alerts) == ["empty_answer_passed", "hack_signal"]
    assert auditor.observe_eval(1, {"code": 0.2}, {"code": 0.5}) == []  # first eval: baseline
    alerts = auditor.observe_eval(2, {"code": 0.6}, {"code": 0.4})
    assert [a.kind for a in alerts] == ["reward_heldout_divergence"]
    assert len((tmp_path / "audit/alerts.jsonl").read_text().splitlines()) == 3
    markdown, jsonl = auditor.write_spot_checks()
    assert len(jsonl.read_text().splitlines()) == 2  # reservoir size
    assert "# Spot checks" in markdown.read_text()


def test_auditor_state_round_trip(tmp_path: Path) -> None:
    auditor = Auditor(tmp_path, spot_check_samples=3, seed=5)
    auditor.observe_batch(1, [_traj(i, str(i), i % 2 == 0) for i in range(10)])
    other = Auditor(tmp_path, spot_check_samples=3, seed=99)
    other.load_state_dict(json.loads(json.dumps(auditor.state_dict())))
    batch = [_traj(i, str(i), True) for i in range(10, 20)]
    auditor.observe_batch(2, batch)
    other.observe_batch(2, batch)
    assert other.reservoir == auditor.reservoir


def test_local_status_reporter_writes_camel_case(tmp_path: Path) -> None:
    LocalStatusReporter(tmp_path).report(
        RunStatus(
            step=3,
            max_steps=10,
            reward_mean=0.25,
            domain_rewards={"code": 0.5},
            last_checkpoint="file:///x/step-3",
        )
    )
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["step"] == 3 and status["rewardMean"] == 0.25
    assert status["domainRewards"] == {"code": 0.5} and status["lastCheckpoint"].endswith("3")
    assert "evalAccuracy" in status and "message" not in status  # None fields are omitted


class _RecordingCustomObjectsApi:
    """Stands in for kubernetes.client.CustomObjectsApi; records the patch it receives."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> None:
        assert kwargs == {"field_manager": "posttrain-trainer"}
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("apiserver unavailable")


def test_kube_status_reporter_patches_the_status_subresource() -> None:
    api = _RecordingCustomObjectsApi()
    KubeStatusReporter("demo", "team-a", api=api).report(
        RunStatus(step=4, phase="Succeeded", message="x")
    )
    group, version, namespace, plural, name, body = api.calls[0]
    assert (group, version, namespace, plural, name) == (
        "posttrain.io",
        "v1alpha1",
        "team-a",
        "trainingruns",
        "demo",
    )
    assert body["status"]["step"] == 4
    # The phase is the operator's: a trainer that reports its last step never ends the run.
    assert "phase" not in body["status"] and "message" not in body["status"]
    # an API error is logged, never raised into the training loop
    KubeStatusReporter("demo", "team-a", api=_RecordingCustomObjectsApi(fail=True)).report(
        RunStatus(step=5)
    )


def _metrics(step: int, reward: float) -> StepMetrics:
    return StepMetrics(
        step,
        reward,
        {"code": reward},
        {"code": reward},
        0.1,
        1.0,
        0.0,
        0.0,
        1.0,
        20.0,
        2,
        4,
        step,
        0,
        True,
        "",
        1.0,
        1.0,
        2.0,
    )


def test_report_and_plots_from_run_files(tmp_path: Path) -> None:
    with ProgressReporter(tmp_path, total_steps=2) as progress:
        progress.record(_metrics(1, 0.2))
        progress.record(_metrics(2, 0.4))
    items_before = [
        EvalItem("a", "code", "p", "t", "bad", False, 0.0),
        EvalItem("b", "code", "q", "t", "good", True, 1.0),
    ]
    items_after = [
        EvalItem("a", "code", "p", "t", "fixed", True, 1.0),
        EvalItem("b", "code", "q", "t", "good", True, 1.0),
    ]
    save_eval(EvalResult(0, "heldout", {"code": 0.5}, {"code": 2}, 1.0, items_before), tmp_path)
    save_eval(EvalResult(2, "heldout", {"code": 1.0}, {"code": 2}, 1.0, items_after), tmp_path)
    written = plot_run(tmp_path)
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)
    report = write_report(tmp_path, "test run").read_text()
    assert "| code | 50.0% | 100.0% | +50.0% | 2 |" in report
    assert "1 held-out items fixed, 0 broken." in report


def test_stage_table_gives_each_change_its_paired_error_and_flips(tmp_path: Path) -> None:
    """Per stage: before, after, the change with the standard error of the per-item change
    (same items both times) and the items fixed / broken, overall and per difficulty stratum;
    a stage without an evaluation at its end says so instead of inventing a change."""

    def scored(step: int, *passed: bool) -> EvalResult:
        items = [
            EvalItem(
                str(i), "arithmetic", "p", "e", "c", ok, float(ok), "easy" if i < 2 else "hard"
            )
            for i, ok in enumerate(passed)
        ]
        accuracy = sum(passed) / len(passed)
        return EvalResult(step, "heldout", {"arithmetic": accuracy}, {"arithmetic": 4}, 1.0, items)

    save_eval(scored(0, False, False, True, False), tmp_path)
    save_eval(scored(3, True, True, False, False), tmp_path)  # 2 fixed, 1 broken
    stages = [
        {"name": "sft", "type": "sft", "firstStep": 1, "lastStep": 3},
        {"name": "rl", "type": "rl", "firstStep": 4, "lastStep": 5},
    ]
    report = write_report(tmp_path, "t", stages=stages).read_text()
    # d = (+1, +1, -1, 0): mean 0.25, sample variance (3 - 4 * 0.25**2) / 3, s.e. 0.479
    assert "| sft | sft | 1-3 | 25.0% | 50.0% | +25.0% ± 47.9% | 2 / 1 of 4 |" in report
    assert "| rl | rl | 4-5 | 50.0% | - | - | - |" in report
    assert "| **all** | 25.0% | 50.0% | +25.0% ± 47.9% | 4 |" in report
    # where it happened: both easy items fixed, one hard item broken
    assert "| stage | arithmetic/easy | arithmetic/hard |" in report
    assert "| sft | +100.0% ± 0.0%, 2 / 0 of 2 | -50.0% ± 50.0%, 0 / 1 of 2 |" in report


def test_eval_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"domain": "arithmetic", "prompt": "1+1?", "answer": "2"}\nnot json\n')
    assert main(["eval", "--model", "smollm2-135m-instruct", "--tasks", str(tasks)]) == 2
    assert "tasks.jsonl:2: not valid JSON" in capsys.readouterr().err

    tasks.write_text('{"domain": "poetry", "prompt": "a poem", "answer": "x"}\n')
    assert main(["eval", "--model", "smollm2-135m-instruct", "--tasks", str(tasks)]) == 2
    assert "unknown domain 'poetry'" in capsys.readouterr().err

    tasks.write_text('{"domain": "arithmetic", "prompt": "1+1?", "answer": "2"}\n')
    assert main(["eval", "--model", str(tmp_path / "nope"), "--tasks", str(tasks)]) == 2
    assert "cannot resolve model" in capsys.readouterr().err

    dead = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    assert (
        main(["eval", "--model", "smollm2-135m-instruct", "--tasks", str(tasks), "--server", dead])
        == 2
    )
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.slow  # one rollout server start on the tiny model
def test_eval_logs_progress_with_an_eta(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`posttrain eval` says how far it is (done/total, rate, ETA) instead of staying silent."""
    import json
    import logging

    from posttrain.cli import main
    from posttrain.models import make_tiny_model
    from posttrain.trainer.evaluation import heldout

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps(
                {"domain": "arithmetic", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
            )
            + "\n"
            for i in range(2 * heldout.EVAL_CHUNK + 3)
        )
    )
    with caplog.at_level(logging.INFO, logger="posttrain.progresslog"):
        code = main(
            [
                "eval",
                "--model",
                str(model),
                "--tasks",
                str(tasks),
                "--max-new-tokens",
                "4",
                "--out",
                str(tmp_path / "result.json"),
            ]
        )
    assert code == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "posttrain.progresslog"]
    total = 2 * heldout.EVAL_CHUNK + 3
    assert lines and lines[-1].startswith(f"evaluation: {total}/{total} items (100%) in"), lines
