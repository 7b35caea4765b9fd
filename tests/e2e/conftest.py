"""Fixtures for end-to-end tests: a local node agent that really runs the pods."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.nodeagent import NodeAgent


@pytest.fixture
def agent(kube_api: Any, namespace: str, tmp_path: Path) -> Iterator[NodeAgent]:
    """A node agent limited to the test's namespace (other tests' pods stay untouched)."""
    node_agent = NodeAgent(
        kube_api,
        node_name=f"local-{namespace}",
        workdir=tmp_path / "agent",
        namespaces=[namespace],
        poll_interval_s=0.1,
    ).start()
    yield node_agent
    node_agent.stop()


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Poll until ``predicate()`` is truthy; return its value or fail with ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
