"""The operator's liveness endpoint, ``GET /healthz`` on ``liveness_port`` (the chart's
liveness and readiness probes), served on the operator's own event loop (runtime.py;
"One event path", docs/operator.md).

On the loop on purpose: the informers, the requeue and the leader election all run there, so
a loop that stopped turning stops answering and the kubelet restarts the pod. The answer does
not depend on leadership: a standby is alive and ready too (a rolling update waits for the new
pod to be ready while the old one still holds the Lease).
"""

from __future__ import annotations

import logging

from aiohttp import web

from .informer import Gate

log = logging.getLogger(__name__)


def health_app(gate: Gate) -> web.Application:
    """``/healthz``: 200 with ``{"status": "ok", "leading": <bool>}`` (leading: this replica
    works now; always true standalone)."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "leading": gate.is_open()})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    return app


async def start_health_server(port: int, gate: Gate) -> web.AppRunner | None:
    """Serve :func:`health_app` on ``0.0.0.0:port`` (None when ``port`` is 0); the caller
    cleans the returned runner up at shutdown."""
    if not port:
        return None
    runner = web.AppRunner(health_app(gate), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    log.info("liveness endpoint on :%d/healthz", port)
    return runner
