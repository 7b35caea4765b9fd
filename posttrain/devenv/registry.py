"""Which processes work against the dev environment, so ``posttrain dev down`` stops them.

``dev up`` starts etcd, kube-apiserver and MinIO itself, but a person also starts
``posttrain dev agent &`` and ``posttrain operator --standalone &`` by hand, and the agent
starts one process group per pod. Each of them records itself here (one small JSON file
per process under ``<dev state dir>/processes/``) and removes its file when it exits;
``dev down`` stops whatever is still listed: the operator first (so it recreates
nothing), then the agent (which stops its pods), then any pod group left behind.

A recorded process is only signalled while its command line is still the recorded one,
so a pid reused by an unrelated process after a crash is never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from posttrain.api.env import DEV_DIR

log = logging.getLogger(__name__)

# Stop order in `dev down`: what creates pods goes before what runs them.
ROLES = ("operator", "agent", "pod")


def state_dir() -> Path:
    """Where ``posttrain dev up`` keeps its state ($POSTTRAIN_DEV_DIR overrides it)."""
    return Path(os.environ.get(DEV_DIR, Path.home() / ".cache/posttrain/dev"))


def registry_dir() -> Path:
    return state_dir() / "processes"


def _cmdline(pid: int) -> str | None:
    """The process's command line, None when it no longer exists."""
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .strip()
        )
    except OSError:
        return None


@dataclass
class Registered:
    """One process working against the dev environment."""

    pid: int
    role: str  # operator | agent | pod
    cmdline: str  # what /proc/<pid>/cmdline said when it registered
    group: bool = False  # signal its whole process group (pods run in their own sessions)

    def alive(self) -> bool:
        return _cmdline(self.pid) == self.cmdline

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)


def register(role: str, pid: int | None = None, group: bool = False) -> Path | None:
    """Record ``pid`` (default: this process) under ``role``; returns the entry's file."""
    pid = pid or os.getpid()
    cmdline = _cmdline(pid)
    if cmdline is None:
        return None
    path = registry_dir() / f"{pid}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(Registered(pid, role, cmdline, group))))
    return path


def unregister(pid: int | None = None) -> None:
    (registry_dir() / f"{pid or os.getpid()}.json").unlink(missing_ok=True)


def register_this_process(role: str, kubeconfig: str | None) -> bool:
    """Record this process when it works against the running dev environment's cluster.

    ``kubeconfig`` is the file the process uses (``None``: ``$KUBECONFIG``). Nothing is
    recorded for another cluster, so ``dev down`` never stops an operator serving one.
    """
    state_file = state_dir() / "state.json"
    used = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    if not used or not state_file.is_file():
        return False
    try:
        dev_kubeconfig = json.loads(state_file.read_text())["kubeconfig"]
    except (OSError, ValueError, KeyError):
        return False
    if Path(used).expanduser().resolve() != Path(dev_kubeconfig).resolve():
        return False
    if register(role) is None:
        return False
    atexit.register(unregister, os.getpid())
    return True


def registered() -> list[Registered]:
    """Every recorded process that is still running, in stop order."""
    found: list[Registered] = []
    for path in sorted(registry_dir().glob("*.json")) if registry_dir().is_dir() else []:
        try:
            entry = Registered(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if entry.alive():
            found.append(entry)
        else:
            path.unlink(missing_ok=True)
    return sorted(found, key=lambda e: ROLES.index(e.role) if e.role in ROLES else len(ROLES))


def stop_registered(grace_s: float = 15.0) -> list[Registered]:
    """SIGTERM every recorded process in stop order, SIGKILL what outlives ``grace_s``.

    The agent gets its grace to stop its pods itself (their SIGTERM grace is 5 s); pod
    groups still listed afterwards (an agent killed with -9) are stopped here.
    Returns what was stopped.
    """
    stopped: list[Registered] = []
    for role in ROLES:
        entries = [e for e in registered() if e.role == role]
        for entry in entries:
            entry.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(e.alive() for e in entries) and time.monotonic() < deadline:
            time.sleep(0.1)
        for entry in entries:
            if entry.alive():
                log.warning(
                    "%s (pid %d) outlived SIGTERM by %.0f s; killing it",
                    entry.role,
                    entry.pid,
                    grace_s,
                )
                entry.signal(signal.SIGKILL)
        stopped += entries
    for entry in stopped:
        unregister(entry.pid)
    return stopped
