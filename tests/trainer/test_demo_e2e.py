"""`posttrain run --local` on the real SmolLM2-135M, shortened to 2 steps (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_local_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = yaml.safe_load((REPO / "examples/local-demo.yaml").read_text())
    spec = manifest["spec"]
    # 4 prompts: the 25 % per-domain quota guarantees both domains in every batch
    spec["algorithm"].update(maxSteps=2, promptsPerStep=4, maxNewTokens=16)
    spec["evaluation"].update(everySteps=2, maxItemsPerDomain=2)
    short = tmp_path / "demo.yaml"
    short.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "out"

    assert main(["run", str(short), "--local", "--out", str(out)]) == 0

    printed = capsys.readouterr().out
    assert "held-out accuracy (base -> trained)" in printed and "arithmetic" in printed
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert set(metrics[0]["domain_rewards"]) == {"arithmetic", "code"}
    # the sampled tokens' mean -log p at the demo's temperature 0.8: a live policy is far from 0
    assert all(0.05 < m["entropy"] < 20 for m in metrics), [m["entropy"] for m in metrics]
    held_out = json.loads((out / "eval" / "heldout_step0002.json").read_text())["items"]
    assert {i["difficulty"] for i in held_out} <= {"easy", "medium", "hard"}  # kept per item
    latest = out / "checkpoints" / "latest"
    assert (latest / "model.safetensors").is_file() and (latest / "config.json").is_file()
    for rel in ("report.md", "plots/reward_accuracy.png", "eval/heldout_step0002.json"):
        assert (out / rel).is_file(), rel

    # the checkpoint is loadable by `posttrain eval`
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"domain": "arithmetic", "prompt": "What is 2 + 3?", "answer": "5"}\n')
    result = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(latest),
                "--tasks",
                str(tasks),
                "--out",
                str(result),
                "--max-new-tokens",
                "16",
            ]
        )
        == 0
    )
    scored = json.loads(result.read_text())
    assert scored["counts"] == {"arithmetic": 1} and len(scored["items"]) == 1
