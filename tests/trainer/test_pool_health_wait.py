"""A trainer pod waits for its rollout pool instead of failing while the pool loads."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from posttrain.devenv.process import free_port
from posttrain.errors import UsageError
from posttrain.rollout.client import RolloutClient
from posttrain.trainer.run.entrypoints import _require_healthy


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def late_server() -> Iterator[str]:
    """A /health server that starts listening 1.5 s after the test begins."""
    port = free_port()
    server: list[http.server.HTTPServer] = []

    def start() -> None:
        time.sleep(1.5)
        server.append(http.server.HTTPServer(("127.0.0.1", port), _Health))
        server[0].serve_forever(poll_interval=0.05)

    threading.Thread(target=start, daemon=True).start()
    yield f"http://127.0.0.1:{port}"
    if server:
        server[0].shutdown()


def test_waits_for_a_server_that_comes_up_later(late_server: str) -> None:
    client = RolloutClient([late_server], timeout_s=5)
    started = time.monotonic()
    _require_healthy(client, [late_server], timeout_s=30)
    assert 1.0 < time.monotonic() - started < 30
    client.close()


def test_gives_up_after_the_timeout_naming_the_endpoint() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient([dead], timeout_s=5)
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"unreachable after 2 s: http://127\.0\.0\.1"):
        _require_healthy(client, [dead], timeout_s=2)
    assert time.monotonic() - started < 10
    client.close()
