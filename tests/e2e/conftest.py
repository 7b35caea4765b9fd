"""Fixtures for end-to-end tests: a local node agent that really runs the pods."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import wait_for as wait_for  # re-exported for the tests here


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
