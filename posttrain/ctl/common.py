"""What every ``posttrain`` cluster command shares: the console, the cluster from the flags,
error reporting, and the one-line pod state (used by commands.py, follow.py, report.py)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console

from posttrain.ctl.kube import Cluster, CommandFailed, connect


def make_console(stderr: bool = False) -> Console:
    """A rich console; when piped, wide enough that tables are not wrapped at 80 columns."""
    console = Console(stderr=stderr)
    if not console.is_terminal:
        console = Console(stderr=stderr, width=int(os.environ.get("COLUMNS", "200")))
    return console


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    return connect(args.kubeconfig, args.namespace, args.context)


def fail(message: str) -> int:
    """Print an actionable error on stderr and return exit code 1."""
    print(f"error: {message}", file=sys.stderr)
    return 1


Handler = Callable[[argparse.Namespace], int]


def exits_1_on_failure(handler: Handler) -> Handler:
    """Report a :class:`CommandFailed` (not found, unreachable, rejected) as exit code 1."""

    @functools.wraps(handler)
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except CommandFailed as exc:
            return fail(str(exc))

    return wrapped


def pod_phase(pod: Any) -> str:
    """The pod phase plus the first waiting/terminated container reason (ImagePullBackOff...)."""
    phase = pod.status.phase or "Pending"
    for container in pod.status.container_statuses or []:
        state = container.state
        if state and state.waiting and state.waiting.reason:
            return f"{phase} ({state.waiting.reason})"
        if state and state.terminated and state.terminated.reason:
            return f"{phase} ({state.terminated.reason}, exit {state.terminated.exit_code})"
    if phase == "Pending" and not pod.spec.node_name:
        return "Pending (not scheduled)"
    return phase
