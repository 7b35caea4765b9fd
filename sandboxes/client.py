"""Client of the sandbox runner: ``SandboxClient(url).exec([...]) -> ExecResult``.

It has the same ``run(ExecRequest)`` method as the local :class:`~.executor.Executor`, so a
verifier takes either. Retries cover what is safe to retry: connection failures (the request
never ran, or the runner restarted mid-request; re-running untrusted code in a fresh sandbox
has no lasting effect) and 429/503 back-pressure, waiting ``Retry-After`` or an exponential
backoff.
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import Any

import httpx

from posttrain.telemetry import get_tracer, inject_headers

from .executor import ExecRequest, ExecResult

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

RETRYABLE_STATUS = (429, 502, 503)


class SandboxUnavailable(RuntimeError):
    """The runner could not be reached, or stayed saturated, through every retry."""


class SandboxClient:
    """HTTP client of one runner (thread-safe: httpx.Client pools connections)."""

    def __init__(
        self,
        url: str,
        *,
        retries: int = 4,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        timeout_margin_s: float = 30.0,
    ) -> None:
        """``timeout_margin_s`` is added to each execution's own timeout for the HTTP read
        timeout (queueing and sandbox setup happen on top of the program's runtime)."""
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_margin_s = timeout_margin_s
        self._http = httpx.Client(base_url=self.url)

    def exec(
        self,
        command: list[str],
        *,
        stdin: str = "",
        timeout_s: float = 10.0,
        memory_mb: int = 512,
        network: str = "none",
        files: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        **limits: Any,
    ) -> ExecResult:
        """Run ``command`` in a fresh sandbox on the runner."""
        request = ExecRequest(command=command, stdin=stdin, timeout_s=timeout_s,
                              memory_mb=memory_mb, network=network,  # type: ignore[arg-type]
                              files=files or {}, env=env or {}, **limits)
        return self.run(request)

    def run(self, request: ExecRequest) -> ExecResult:
        """POST one request, retrying connection errors and back-pressure."""
        timeout = httpx.Timeout(request.timeout_s + self.timeout_margin_s, connect=5.0)
        with tracer.start_as_current_span("sandbox.client.exec"):
            last_problem = ""
            for attempt in range(self.retries + 1):
                try:
                    response = self._http.post("/v1/exec", json=request.to_dict(),
                                               headers=inject_headers(), timeout=timeout)
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    last_problem = f"{type(exc).__name__}: {exc}"
                    wait = self._backoff(attempt)
                else:
                    if response.status_code == 200:
                        return ExecResult.from_dict(response.json())
                    if response.status_code not in RETRYABLE_STATUS:
                        raise RuntimeError(
                            f"runner {self.url} refused the request "
                            f"({response.status_code}): {response.text[:500]}"
                        )
                    last_problem = f"HTTP {response.status_code}: {response.text[:200]}"
                    retry_after = response.headers.get("Retry-After", "")
                    wait = (float(retry_after) if retry_after.replace(".", "", 1).isdigit()
                            else self._backoff(attempt))
                if attempt < self.retries:
                    log.debug("runner attempt %d failed (%s); retrying in %.2f s",
                              attempt + 1, last_problem, wait)
                    time.sleep(wait)
        raise SandboxUnavailable(
            f"sandbox runner {self.url} failed {self.retries + 1} times; last: {last_problem}. "
            "Is `posttrain sandbox serve` running there?"
        )

    def _backoff(self, attempt: int) -> float:
        """Exponential, capped: 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, ... seconds by default."""
        return min(self.max_backoff_s, self.backoff_s * 2**attempt)

    def health(self) -> dict[str, Any]:
        response = self._http.get("/health", timeout=5.0)
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
