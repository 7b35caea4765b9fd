"""``posttrain report``: HTML and Markdown with every plot embedded, from a run directory
written with the trainer's own record types (StepMetrics, EvalResult/save_eval)."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.trainer.evaluation.heldout import EvalItem, EvalResult, save_eval
from posttrain.trainer.observe.step_metrics import StepMetrics

CliRunner = Any
DOMAINS = ("arith", "code")


def write_run_dir(
    out: Path, steps: int = 4, latencies: bool = True, eval_steps: tuple[int, ...] | None = None
) -> None:
    """What ``posttrain run --local --out`` leaves behind: metrics.jsonl and eval/*.json.

    The arith domain is promoted to its "hard" stratum at step 3; ``eval_steps=(0,)`` is an
    interrupted run that only evaluated the base model.
    """
    out.mkdir(parents=True, exist_ok=True)
    with (out / "metrics.jsonl").open("w") as fh:
        for step in range(1, steps + 1):
            line = StepMetrics(
                step=step,
                reward_mean=0.1 * step,
                domain_rewards={"arith": 0.15 * step, "code": 0.05 * step},
                domain_pass_rates={"arith": 0.15 * step, "code": 0.05 * step},
                loss=-0.01 * step,
                grad_norm=0.5,
                kl=0.001 * step,
                clip_fraction=0.02,
                ratio_mean=1.0,
                response_length=40.0 + step,
                kept_groups=3,
                total_groups=4,
                weight_version=step,
                staleness=0,
                applied=True,
                skip_reason="",
                rollout_seconds=2.0,
                train_seconds=1.0,
                step_seconds=3.2,
                strata={"arith": "easy" if step < 3 else "hard", "code": "easy"},
            ).to_json()
            if latencies:
                line["sandbox_latency_ms"] = [20.0 + step + i for i in range(10)]
            fh.write(json.dumps(line) + "\n")
    evals = ((0, 1), (steps, 3))
    for step, passed in [e for e in evals if eval_steps is None or e[0] in eval_steps]:
        items = [
            EvalItem(
                f"{d}-{i}",
                d,
                f"q{i}",
                "1",
                # a completion with its own fenced block (it must not break the report's)
                ("```python\nprint(1)\n```" if i < passed else "```\n0\n```"),
                i < passed,
                float(i < passed),
            )
            for d in DOMAINS
            for i in range(4)
        ]
        accuracy = {d: passed / 4 for d in DOMAINS}
        save_eval(EvalResult(step, "heldout", accuracy, {d: 4 for d in DOMAINS}, 1.0, items), out)


def embedded_pngs(text: str) -> list[bytes]:
    """Decode every base64 PNG data URI in the report."""
    return [
        base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", text)
    ]


def assert_real_pngs(images: list[bytes], expected: int) -> None:
    from PIL import Image

    assert len(images) == expected
    for png in images:
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        with Image.open(io.BytesIO(png)) as image:
            image.verify()  # a complete, decodable PNG
            assert image.size[0] >= 300


def test_html_report_embeds_every_plot(cli: CliRunner, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run_dir(run_dir)
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "posttrain.io/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": "r"},
                "spec": {
                    "model": "m",
                    "algorithm": {"groupSize": 8},
                    "domains": [
                        {
                            "name": "arith",
                            "dataset": "builtin:arithmetic",
                            "verifier": {"kind": "numeric"},
                        }
                    ],
                },
            }
        )
    )
    out = tmp_path / "report.html"
    result = cli("report", str(run_dir), "--out", str(out), "--manifest", str(manifest))
    assert result.code == 0, result.err
    html = out.read_text()
    assert html.startswith("<!doctype html>")
    # the trainer's four plots, plus throughput and the sandbox latency histogram
    assert_real_pngs(embedded_pngs(html), expected=6)
    for title in (
        "Reward and held-out accuracy per domain",
        "KL to the reference model",
        "Response length",
        "Policy loss",
        "Rollout throughput",
        "Sandbox latency",
    ):
        assert f"<h3>{title}</h3>" in html
    assert "25.0%</td>" in html and "75.0%</td>" in html and "+50.0%" in html  # base -> trained
    assert 'src="plots/' not in html and "<img" in html  # self-contained


def test_markdown_report_without_latencies_or_group_size(cli: CliRunner, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run_dir(run_dir, latencies=False)
    out = tmp_path / "report.md"
    result = cli("report", str(run_dir), "--out", str(out))
    assert result.code == 0, result.err
    text = out.read_text()
    assert "| arith | 25.0% | 75.0% | +50.0% | 4 |" in text
    assert_real_pngs(embedded_pngs(text), expected=4)  # the trainer's plots only
    assert "Sandbox latency: this run recorded no sandbox_latency_ms." in text
    assert "Rollout throughput: not recorded" in text


def test_report_input_errors_are_exit_2(cli: CliRunner, tmp_path: Path) -> None:
    assert cli("report", str(tmp_path / "missing")).code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("report", str(empty))
    assert result.code == 2 and "no metrics.jsonl" in result.err
    write_run_dir(tmp_path / "run")
    wrong = cli("report", str(tmp_path / "run"), "--out", str(tmp_path / "r.pdf"))
    assert wrong.code == 2 and ".html or .md" in wrong.err


@pytest.mark.slow
def test_report_from_a_real_local_run(cli: CliRunner, tmp_path: Path) -> None:
    """`posttrain run --local` (2 steps, tiny model), then `posttrain report` on its --out."""
    from posttrain.models import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    manifest = tmp_path / "run.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "posttrain.io/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": "t"},
                "spec": {
                    "model": str(model),
                    "algorithm": {
                        "groupSize": 2,
                        "promptsPerStep": 2,
                        "maxSteps": 2,
                        "maxNewTokens": 8,
                        "learningRate": 1e-5,
                        "dynamicSampling": False,
                    },
                    "domains": [
                        {
                            "name": "arithmetic",
                            "dataset": "builtin:arithmetic",
                            "verifier": {"kind": "numeric"},
                        }
                    ],
                    "evaluation": {"everySteps": 1, "maxItemsPerDomain": 4},
                    "checkpoint": {"everySteps": 1},
                },
            }
        )
    )
    out = tmp_path / "out"
    trained = cli("run", str(manifest), "--local", "--out", str(out))
    assert trained.code == 0, trained.err[-2000:]

    report = tmp_path / "report.html"
    result = cli("report", str(out), "--out", str(report), "--manifest", str(manifest))
    assert result.code == 0, result.err
    html = report.read_text()
    assert_real_pngs(embedded_pngs(html), expected=5)  # trainer's 4 + derived throughput
    assert "<h3>Rollout throughput</h3>" in html
    assert "| arithmetic |" not in html and "<td>arithmetic</td>" in html


def test_html_report_has_the_all_row_and_fixed_and_broken_examples(
    cli: CliRunner, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    write_run_dir(run_dir, latencies=False)
    out = tmp_path / "report.html"
    assert cli("report", str(run_dir), "--out", str(out)).code == 0
    html = out.read_text()
    assert "<h2>Held-out accuracy: base (step 0) vs trained (step 4)</h2>" in html
    assert '<tr><td><b>all</b></td><td class="n">25.0%</td><td class="n">75.0%</td>' in html
    assert "<p>4 held-out items fixed, 0 broken.</p>" in html
    assert html.count('<div class="ex">') == 3  # three examples shown, all in eval/*.json
    assert "<pre>```python\nprint(1)\n```</pre>" in html


def test_report_of_an_interrupted_run_claims_no_trained_result(
    cli: CliRunner, tmp_path: Path
) -> None:
    """Only the base model (step 0) was evaluated: nothing may be called "trained"."""
    from posttrain.trainer.observe.run_report import write_report

    run_dir = tmp_path / "run"
    write_run_dir(run_dir, steps=2, latencies=False, eval_steps=(0,))
    out = tmp_path / "report.html"
    assert cli("report", str(run_dir), "--out", str(out)).code == 0
    html = out.read_text()
    assert "vs trained" not in html and "<th>trained</th>" not in html, html[:3000]
    assert "measured at step 0 only (25.0%)" in html
    markdown = write_report(run_dir, "t").read_text()
    assert "vs trained" not in markdown and "| trained |" not in markdown, markdown
    assert "## Held-out accuracy at step 0 only" in markdown


def test_markdown_report_fences_survive_completions_with_fences(tmp_path: Path) -> None:
    """A completion holding ```python ... ``` is wrapped in a longer fence, so the report's
    own blocks open and close where they should (every fence line pairs up)."""
    from posttrain.trainer.observe.run_report import write_report

    run_dir = tmp_path / "run"
    write_run_dir(run_dir, latencies=False)
    markdown = write_report(run_dir, "t").read_text()
    fences = [line for line in markdown.splitlines() if line.startswith("````")]
    assert fences and len(fences) % 2 == 0, markdown
    assert all(line in ("````text", "````") for line in fences)
    assert "````text\n```python\nprint(1)\n```\n````" in markdown


def test_curriculum_promotions_and_a_zero_kl_weight_are_explained() -> None:
    from posttrain.trainer.observe.run_report import curriculum_changes, kl_note

    metrics = [{"step": s, "strata": {"arith": "easy" if s < 3 else "hard"}} for s in (1, 2, 3)]
    assert curriculum_changes(metrics) == [(3, "arith -> hard")]
    assert kl_note(0.0, [0.0]) is not None and kl_note(0.1, [0.02]) is None


@pytest.mark.minio
def test_a_cluster_runs_outputs_synced_to_minio_render_without_the_pod(
    cli: CliRunner, tmp_path: Path, minio_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a trainer pod does while it runs (ReportSync over the loop's output files, to the
    run's prefix in MinIO), then `posttrain report s3://…/reports` once the pod and its
    emptyDir are gone; a second sync sends only what changed."""
    import shutil
    import uuid

    from posttrain.storage.reports import ReportSync
    from posttrain.storage.store import S3Store
    from posttrain.trainer.run.loop import output_files

    for key, value in minio_server.env().items():
        monkeypatch.setenv(key, value)
    bucket = f"reports-{uuid.uuid4().hex[:8]}"
    store = S3Store(
        minio_server.endpoint,
        bucket,
        "runs/ns/r",
        access_key=minio_server.access_key,
        secret_key=minio_server.secret_key,
    )
    pod_dir = tmp_path / "workspace"
    write_run_dir(pod_dir)
    sync = ReportSync(store)
    first = sync.sync(output_files(pod_dir))
    assert "reports/metrics.jsonl" in first and "reports/eval/history.jsonl" in first, first
    with (pod_dir / "metrics.jsonl").open("a") as fh:
        fh.write((pod_dir / "metrics.jsonl").read_text().splitlines()[-1] + "\n")
    assert sync.sync(output_files(pod_dir)) == ["reports/metrics.jsonl"]
    local = tmp_path / "local.html"
    assert cli("report", str(pod_dir), "--out", str(local)).code == 0
    shutil.rmtree(pod_dir)  # the pod is gone

    out = tmp_path / "report.html"
    uri = f"s3://{bucket}/runs/ns/r/reports"
    result = cli("report", uri, "--out", str(out))
    assert result.code == 0, result.err
    html, from_pod = out.read_text(), local.read_text()
    # The report names where its files came from, not the temporary download deleted since.
    assert f"<li><b>outputs from:</b> {uri}</li>" in html
    assert "posttrain-report-" not in html + result.out + result.err
    # The same report as from the pod's own directory: every plot, the eval table.
    titles = re.findall(r"<h3>([^<]+)</h3>", html)
    assert titles == re.findall(r"<h3>([^<]+)</h3>", from_pod) and "Policy loss" in titles
    assert_real_pngs(embedded_pngs(html), expected=len(embedded_pngs(from_pod)))
    assert "25.0%</td>" in html and "75.0%</td>" in html  # the eval files came back too
    missing = cli("report", f"s3://{bucket}/runs/ns/nothing-here", "--out", str(out))
    assert missing.code != 0 and "no outputs under" in missing.err


def test_report_shows_agent_episode_metrics_per_environment(cli: CliRunner, tmp_path: Path) -> None:
    """Environment domains: success, turns, valid tool calls, recovery, errored, base ->
    trained, in the Markdown and the HTML report."""
    run_dir = tmp_path / "run"
    write_run_dir(run_dir, latencies=False)
    for path in sorted((run_dir / "eval").glob("heldout_step*.json")):
        data = json.loads(path.read_text())
        trained = data["step"] > 0
        data["agent"] = {
            "code": {
                "episodes": 4.0,
                "errored": 1.0 if trained else 0.0,
                "success_rate": 0.75 if trained else 0.25,
                "truncated_rate": 0.0,
                "mean_turns": 2.5 if trained else 4.0,
                "valid_tool_call_rate": 0.9 if trained else 0.5,
                "recovery_rate": 1.0 if trained else 0.0,
                "episodes_with_failure": 2.0,
            }
        }
        path.write_text(json.dumps(data))
    out = tmp_path / "report.md"
    result = cli("report", str(run_dir), "--out", str(out))
    assert result.code == 0, result.err
    text = out.read_text()
    assert "## Agent episodes (held-out): base -> trained" in text
    assert (
        "| code | 25.0% -> 75.0% | 4.00 -> 2.50 | 50.0% -> 90.0% | 0.0% -> 100.0% "
        "| 0.0% -> 0.0% | 1 |" in text
    )
    html_out = tmp_path / "report.html"
    assert cli("report", str(run_dir), "--out", str(html_out)).code == 0
    assert '<td class="n">25.0% -&gt; 75.0%</td>' in html_out.read_text()
