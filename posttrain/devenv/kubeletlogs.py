"""The kubelet's log endpoint for the dev node agent, so ``kubectl logs`` and
``posttrain logs`` work on the dev control plane.

The apiserver serves ``pods/log`` by calling the kubelet of the pod's node over HTTPS:
``GET /containerLogs/<namespace>/<pod>/<container>?follow=true&tailLines=N`` at the
Node's InternalIP and ``status.daemonEndpoints.kubeletEndpoint.Port``. The agent has no
kubelet, so this serves that one path from the log files it writes, on loopback only.
The apiserver of ``posttrain dev up`` is started without a kubelet CA, so it accepts the
self-signed certificate made here.

A pod's log file holds every container of the pod, each section opened by the line
``==> container NAME: COMMAND`` that the agent writes; a request returns the named
container's section.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

log = logging.getLogger(__name__)

CONTAINER_MARKER = "==> container "
FOLLOW_POLL_S = 0.25


def container_section(text: str, container: str) -> str:
    """The lines of ``container`` in a pod log holding several containers' sections.

    >>> log_text = "==> container init: cp a b\\nx\\n==> container main: run\\ny\\nz\\n"
    >>> container_section(log_text, "main")
    'y\\nz\\n'
    >>> container_section(log_text, "other")
    ''
    """
    out: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        if line.startswith(CONTAINER_MARKER):
            inside = line[len(CONTAINER_MARKER) :].split(":", 1)[0] == container
            continue
        if inside:
            out.append(line)
    return "".join(out)


def last_lines(text: str, count: int | None) -> str:
    """The last ``count`` lines of ``text`` (all with None).

    >>> last_lines("a\\nb\\nc\\n", 2), last_lines("a\\n", None)
    ('b\\nc\\n', 'a\\n')
    """
    if count is None:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(lines[-count:]) if count > 0 else ""


class KubeletLogServer:
    """HTTPS ``/containerLogs`` over the agent's pod log files.

    ``log_path(namespace, pod)`` names a pod's file; ``running(namespace, pod)`` says
    whether the pod may still write (a followed log ends once it is not).
    """

    def __init__(
        self,
        certs_dir: Path,
        log_path: Callable[[str, str], Path],
        running: Callable[[str, str], bool],
    ) -> None:
        from posttrain.devenv.certs import make_pki

        server_self = self
        self.log_path, self.running = log_path, running

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server_self.handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("kubelet log endpoint: " + format, *args)

        pki = make_pki(certs_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.serving_cert, pki.serving_key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="kubelet-logs", daemon=True
        )

    def start(self) -> KubeletLogServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, request: BaseHTTPRequestHandler) -> None:
        url = urlparse(request.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            request.send_error(404, "only /containerLogs/<namespace>/<pod>/<container>")
            return
        _, namespace, pod, container = parts
        path = self.log_path(namespace, pod)
        if not path.is_file():
            request.send_error(404, f"no log for pod {namespace}/{pod} on this node")
            return
        query = parse_qs(url.query)
        tail = int(query["tailLines"][0]) if "tailLines" in query else None
        follow = query.get("follow") == ["true"]
        request.send_response(200)
        request.send_header("Content-Type", "text/plain; charset=utf-8")
        request.send_header("Transfer-Encoding", "chunked")
        request.end_headers()
        try:
            for chunk in self._chunks(path, namespace, pod, container, tail, follow):
                data = chunk.encode()
                request.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                request.wfile.flush()
            request.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # the client stopped reading (Ctrl-C on `kubectl logs -f`)

    def _chunks(
        self,
        path: Path,
        namespace: str,
        pod: str,
        container: str,
        tail: int | None,
        follow: bool,
    ) -> Iterator[str]:
        """The container's log so far, then (with ``follow``) what is appended to it."""
        text = path.read_text(errors="replace")
        sent = len(text)
        first = last_lines(container_section(text, container), tail)
        if first:
            yield first
        while follow:
            alive = self.running(namespace, pod)  # read before the file: no line is missed
            text = path.read_text(errors="replace")
            # Whole lines only while the pod writes, so a marker is never split in two.
            end = len(text) if not alive else text.rfind("\n", sent) + 1
            if end > sent:
                section = container_section(
                    self._section_context(text, sent) + text[sent:end], container
                )
                sent = end
                if section:
                    yield section
            if not alive:
                return
            time.sleep(FOLLOW_POLL_S)

    @staticmethod
    def _section_context(text: str, offset: int) -> str:
        """The last container marker line before ``offset``: which section new text is in."""
        marker = text.rfind("\n" + CONTAINER_MARKER, 0, offset)
        if marker < 0:
            return text[: text.find("\n") + 1] if text.startswith(CONTAINER_MARKER) else ""
        end = text.find("\n", marker + 1)
        return text[marker + 1 : end + 1]
