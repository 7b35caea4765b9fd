"""The dev environment's process helpers live in :mod:`posttrain.processes` (the trainer's local
rollout server uses them too, and components must not import the dev environment); these names
stay importable from here for the dev tooling and tests."""

from posttrain.processes import (
    ManagedProcess,
    StartError,
    free_port,
    http_ok,
    pid_alive,
    port_in_use,
    stop_pid,
    tail,
    wait_for,
)

__all__ = [
    "ManagedProcess",
    "StartError",
    "free_port",
    "http_ok",
    "pid_alive",
    "port_in_use",
    "stop_pid",
    "tail",
    "wait_for",
]
