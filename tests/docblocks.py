"""What the walkthrough tests share: a documented command block, taken out of its Markdown file
to be run in bash as written, and the processes it leaves behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def bash_block(doc: str, heading: str) -> list[str]:
    """The command lines of the first ```bash block under the heading ``heading`` (any level)
    of ``doc`` (a path from the repository root), continuation lines joined to theirs."""
    text = (REPO_ROOT / doc).read_text()
    parts = re.split(rf"^#+ {re.escape(heading)}\n", text, maxsplit=1, flags=re.M)
    assert len(parts) == 2, f"{doc} has no heading {heading!r}"
    block = re.search(r"```bash\n(.*?)```", parts[1], flags=re.DOTALL)
    assert block is not None, f"no bash block under {heading!r} in {doc}"
    joined = re.sub(r"\\\n\s*", "", block.group(1))
    return [line for line in joined.splitlines() if line.strip()]


def processes_of(markers: list[str]) -> set[int]:
    """Pids (this one aside) whose environment or command line mentions one of ``markers``."""
    found: set[int] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            text = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if any(marker.encode() in text for marker in markers):
            found.add(int(proc.name))
    return found


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
