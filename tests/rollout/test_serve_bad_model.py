"""`posttrain serve` with a model that cannot load exits with the reason, not a forever-503."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from posttrain.devenv.process import free_port


def test_unloadable_model_exits_non_zero_naming_the_model(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "posttrain", "serve", "--model", str(missing),
         "--host", "127.0.0.1", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"could not load model '{missing}'" in result.stderr
