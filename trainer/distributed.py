"""Multi-node training (filled in below; single-node runs never import Ray)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def launch_if_distributed(run: Any, out_dir: Path) -> bool:
    """False on a single node (the caller trains in process)."""
    nodes = int(os.environ.get("POSTTRAIN_NODES", "1"))
    return nodes > 1 or bool(os.environ.get("RAY_ADDRESS"))
