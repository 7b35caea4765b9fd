"""Expected things are not warnings: a one-process checkpoint save and load and a pod's
first plot (no writable $HOME) print nothing on stderr (issue #35, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import posttrain.trainer.checkpointing.checkpoint  # noqa: F401  (its warning filter)
from posttrain.trainer.observe.run_report import _pyplot

out = Path(sys.argv[1])
state = {"w": torch.zeros(4)}
dcp.save(state, checkpoint_id=out / "dcp")
dcp.load(state, checkpoint_id=out / "dcp")
plt = _pyplot()
fig, ax = plt.subplots()
ax.plot([0, 1], [1, 0])
fig.savefig(out / "plot.png")
print("ok")
"""


def test_one_process_checkpoint_and_first_plot_log_no_warning(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()
    home = tmp_path / "a-file/home"  # a pod user's $HOME that cannot be created, even by root
    env = {**os.environ, "HOME": str(home), "PYTHONWARNINGS": "default"}
    env.pop("MPLCONFIGDIR", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    # (matplotlib's "created a temporary cache directory" has no level word: check it too)
    for noise in ("Warning", "WARNING", "Matplotlib created", "mkdir -p failed"):
        assert noise not in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "plot.png").stat().st_size > 0
