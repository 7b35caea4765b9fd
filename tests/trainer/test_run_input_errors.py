"""`posttrain run` rejects a missing dataset at once: before it creates --out and before a
rollout server spends seconds loading a model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_dataset_fails_first_and_leaves_no_out_folder(tmp_path: Path) -> None:
    manifest = yaml.safe_load((REPO_ROOT / "examples/local-demo.yaml").read_text())
    manifest["spec"]["domains"][1]["dataset"] = str(tmp_path / "no-such-tasks.jsonl")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "run", str(path), "--local", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert "spec.domains[1].dataset" in result.stderr and "does not exist" in result.stderr
    assert "rollout server" not in result.stderr.lower()  # none was started
    assert not out.exists()
