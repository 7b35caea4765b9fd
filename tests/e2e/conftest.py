"""Fixtures for end-to-end tests: a local node agent that really runs the pods."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.nodeagent import NodeAgent
from posttrain.devenv.process import wait_for as wait_for  # re-exported for the tests here

log = logging.getLogger(__name__)


def _transient(exc: Exception) -> bool:
    """An answer worth asking again: the apiserver's 5xx (a 504 under load) or 429, no
    connection, MinIO not answering within its retry budget (a stalled disk)."""
    import urllib3
    from kubernetes.client.exceptions import ApiException

    from posttrain.storage.errors import StorageUnreachableError

    if isinstance(exc, ApiException):
        return exc.status is not None and (exc.status >= 500 or exc.status == 429)
    return isinstance(
        exc,
        urllib3.exceptions.HTTPError | ConnectionError | TimeoutError | StorageUnreachableError,
    )


def wait_logged(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` (every second) until truthy and return it, logging progress every
    30 s; fail naming ``what``. For the minutes-long waits of runs on a loaded machine, where
    the dev apiserver itself times out now and then: such answers count as "not yet"."""
    started = time.monotonic()
    next_log = started + 30
    last: Any = None
    while True:
        try:
            last = predicate()
        except Exception as exc:
            if not _transient(exc):
                raise
            log.warning("asking for %s failed (%s); asking again", what, str(exc)[:200])
            last = None
        if last:
            return last
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            raise AssertionError(
                f"timed out after {timeout_s:.0f}s waiting for {what} (last: {last!r})"
            )
        if time.monotonic() >= next_log:
            log.info("waiting for %s (%.0fs of %.0fs)", what, elapsed, timeout_s)
            next_log += 30
        time.sleep(1.0)


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
