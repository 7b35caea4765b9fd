"""The trainer's client for a pool of OpenAI-compatible rollout servers.

It speaks only ``/v1/completions`` with token-id prompts and ``return_tokens_as_token_ids``
so that the exact sampled token ids and their logprobs come back -- re-tokenising text
would silently break importance ratios -- and so that it works unchanged on vLLM.

Each prompt is one HTTP request (carrying ``n``): the servers batch concurrent requests
themselves, and per-prompt requests make balancing and retries fine-grained. A request that
fails on one replica (connection error, timeout, 5xx) is retried with exponential backoff
on the replica with the fewest requests in flight, excluding the one that just failed while
another is available. ``max_in_flight`` bounds concurrent requests per endpoint; callers
block when every endpoint is full (back-pressure instead of an unbounded queue).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client import Counter, Histogram

from posttrain.rollout.auth import auth_headers
from posttrain.rollout.protocol import (
    WEIGHT_VERSION_HEADER,
    Completion,
    SamplingParams,
    parse_token_id,
)
from posttrain.telemetry import get_tracer, inject_headers

__all__ = ["Completion", "RolloutClient", "RolloutError", "SamplingParams"]

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

CLIENT_REQUESTS = Counter(
    "posttrain_rollout_client_requests_total", "Rollout HTTP requests", ["endpoint", "outcome"]
)
CLIENT_RETRIES = Counter("posttrain_rollout_client_retries_total", "Retried rollout requests")
CLIENT_LATENCY = Histogram(
    "posttrain_rollout_client_request_seconds",
    "Latency of one rollout request as the trainer sees it",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)


class RolloutError(RuntimeError):
    """A rollout request failed on every replica it was tried on."""


class _Retryable(Exception):
    """Connection error, timeout or 5xx: worth trying again, preferably elsewhere."""


class _Endpoint:
    def __init__(self, url: str, max_in_flight: int) -> None:
        self.url = url.rstrip("/")
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.failures = 0  # consecutive
        self.cooldown_until = 0.0  # monotonic time before which new requests skip this one
        self.last_picked = 0  # pick counter value when last chosen (round-robin tie-break)

    def record_failure(self) -> None:
        self.failures += 1
        self.cooldown_until = time.monotonic() + min(30.0, 0.5 * 2 ** (self.failures - 1))

    def record_success(self) -> None:
        self.failures = 0
        self.cooldown_until = 0.0


class RolloutClient:
    """Sample from (and push weights to) a set of rollout servers. Thread-safe."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        max_in_flight: int = 4,
        model: str | None = None,
        discover: Callable[[], list[str]] | None = None,
    ) -> None:
        """``discover`` (e.g. :meth:`posttrain.rollout.discovery.PoolDiscovery.ready_endpoints`)
        is asked for the current replicas before every weight load, so a version reaches
        every ready replica, not the set the client started with."""
        if not endpoints:
            raise ValueError("RolloutClient needs at least one endpoint URL")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self._endpoints = [_Endpoint(url, max_in_flight) for url in endpoints]
        self._max_in_flight = max_in_flight
        self.discover = discover
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._model = model
        self._slots = threading.Condition()
        # Weight loads and joiner catch-ups one at a time, so a replica added while a new
        # version is being published cannot end up on the previous one.
        self._loading = threading.RLock()
        self.loaded: tuple[str, int] | None = None  # (uri, version) of the last full load
        # Each replica's answer to the last /v1/weights/load (load_seconds, phases): what a
        # publish logs as where the replicas' time went.
        self.last_load_replies: dict[str, dict[str, Any]] = {}
        # How long a load waits for a listed replica that cannot be reached to answer or
        # to leave the pool (a crashed pod is replaced, or dropped by the operator, in this;
        # a sidecar of the trainer pod restarted by its kubelet is back).
        self.rejoin_wait_s = max(timeout_s, 600.0)
        self._picks = 0
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_in_flight * len(endpoints) + 8),
        )
        self._pool = ThreadPoolExecutor(
            max_workers=max_in_flight * len(endpoints), thread_name_prefix="rollout-client"
        )

    @property
    def urls(self) -> list[str]:
        """The endpoint base URLs (the trainer checks whether they are all on this host)."""
        return [endpoint.url for endpoint in self._endpoints]

    def set_endpoints(self, urls: list[str]) -> list[str]:
        """Replace the endpoint set (a pool's ready replicas changed); returns the new URLs.

        Endpoints that stay keep their load and failure state; requests in flight on a
        removed one finish (or fail over) as usual. Concurrency stays at what the client
        was sized for: more replicas add places to send work, not threads.
        """
        wanted = [u.rstrip("/") for u in urls]
        if not wanted:
            raise ValueError("set_endpoints needs at least one URL")
        with self._slots:
            current = {e.url: e for e in self._endpoints}
            self._endpoints = [current.get(u) or _Endpoint(u, self._max_in_flight)
                               for u in wanted]  # fmt: skip
            self._slots.notify_all()
        added = [u for u in wanted if u not in current]
        if added or len(current) != len(wanted):
            log.info("rollout endpoints now %s (added %s)", ", ".join(wanted), added or "none")
        return added

    # ------------------------------------------------------------------ sampling

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        """One list of ``params.n`` completions per prompt, in prompt order."""
        params.validate()
        with tracer.start_as_current_span("rollout.generate") as span:
            span.set_attribute("rollout.prompts", len(prompt_token_ids))
            span.set_attribute("rollout.n", params.n)
            carrier = inject_headers()
            futures = [
                self._pool.submit(self._complete_one, index, ids, params, carrier)
                for index, ids in enumerate(prompt_token_ids)
            ]
            return [f.result() for f in futures]

    def _complete_one(
        self, index: int, token_ids: list[int], params: SamplingParams, headers: dict[str, str]
    ) -> list[Completion]:
        body: dict[str, Any] = {
            "prompt": token_ids,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            **params.to_request_fields(),
        }
        if self._model:
            body["model"] = self._model
        response = self._post("/v1/completions", body, headers)
        return parse_completions(response, index, params.n)

    def chat(
        self,
        messages: list[dict[str, str]],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """``n`` assistant replies to a conversation (the server applies the chat template)."""
        params = params or SamplingParams()
        params.validate()
        body: dict[str, Any] = {
            "messages": messages,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            **params.to_request_fields(),
        }
        if self._model:
            body["model"] = self._model
        with tracer.start_as_current_span("rollout.chat"):
            response = self._post("/v1/chat/completions", body, inject_headers())
        version = int(response.get("weight_version", -1))
        completions = []
        for choice in sorted(response["choices"], key=lambda c: c["index"]):
            content = (choice.get("logprobs") or {}).get("content") or []
            token_ids = choice.get("token_ids") or [parse_token_id(c["token"]) for c in content]
            completions.append(
                Completion(
                    prompt_index=0,
                    text=choice["message"]["content"],
                    token_ids=list(token_ids),
                    logprobs=[float(c["logprob"]) for c in content],
                    finish_reason=choice.get("finish_reason") or "stop",
                    weight_version=int(choice.get("weight_version", version)),
                )
            )
        return completions

    # ------------------------------------------------------------------ weights / health

    def load_weights(self, uri: str, version: int, *, stream: bool | None = None) -> None:
        """Make every endpoint serve ``version``; raises RolloutError naming the failures.

        ``stream`` is passed to each vLLM replica (``WeightLoadRequest.stream``: stream a
        full ``s3://`` version into the engine as it downloads, download it first, or let
        the replica choose when None).

        A replica that could not be reached (or answered 5xx: still starting) is retried
        every 2 s until it answers, up to :attr:`rejoin_wait_s`: a fixed endpoint (a
        sidecar of the trainer pod that its kubelet is restarting) gets that long to come
        back. With ``discover``, one that has left the pool's ready set meanwhile (it
        crashed or is being replaced) no longer fails the load: it pulls the latest
        committed version when it rejoins (pull on join), and :meth:`catch_up` brings it to
        this version before it gets work. A replica that *refuses* the version (HTTP 4xx:
        a digest mismatch, a missing file) fails the load at once.
        """
        with self._loading:
            self._refresh_endpoints()
            with tracer.start_as_current_span("rollout.load_weights") as span:
                span.set_attribute("weights.version", version)
                self.last_load_replies = {}
                failures = self._load_on(list(self._endpoints), uri, version, stream)
                started = time.monotonic()
                next_log = started
                while failures:
                    refused = {u: e for u, e in failures.items() if not isinstance(e, _Retryable)}
                    waited = time.monotonic() - started
                    if refused or waited > self.rejoin_wait_s:
                        break
                    time.sleep(2.0)
                    self._drop_departed(failures, version)
                    retry = [e for e in self._endpoints if e.url in failures]
                    if retry and time.monotonic() >= next_log:
                        log.info("retrying weights v%d on %s, unreachable (%.0fs of %.0fs): %s",
                                 version, [e.url for e in retry], waited, self.rejoin_wait_s,
                                 {e.url: str(failures[e.url])[:120] for e in retry})  # fmt: skip
                        next_log = time.monotonic() + 30.0
                    if retry:
                        failures = self._load_on(retry, uri, version, stream)
                if failures:
                    reasons = {u: str(e) for u, e in failures.items()}
                    raise RolloutError(f"loading weights v{version} from {uri} failed on {reasons}")
                self.loaded = (uri, version)

    def _drop_departed(self, failures: dict[str, Exception], version: int) -> None:
        """With ``discover``: forget the failures of replicas no longer in the ready set
        (they pull the latest version when they rejoin). Fixed endpoints stay."""
        if self.discover is None:
            return
        ready = set(self._refresh_endpoints())
        for url in [u for u in failures if u not in ready]:
            log.warning("replica %s left the pool while loading weights v%d (%s); it loads "
                        "the latest version when it rejoins", url, version,
                        failures.pop(url))  # fmt: skip

    def transfer_weights(
        self, version: int, updates: Iterable[dict[str, Any]], device: str = "cpu"
    ) -> None:
        """Make every endpoint serve ``version`` by direct transfer (vLLM replicas on this
        trainer's host or GPU node, ``POST /v1/weights/transfer``): ``start`` on all, then
        each of ``updates`` (vLLM's packed update info, one bucket each) to all at once --
        the next bucket is produced only once every endpoint has read this one, which is
        what lets the producer reuse its staging buffer -- then ``finish``. ``device``
        (``cpu`` | ``cuda``) is where the staging buffers live: a replica whose transfer
        backend cannot map them refuses ``start``.

        Any failure aborts the session on every endpoint that started it (each goes back
        to the weights it held, or restarts) and raises RolloutError naming the failures;
        an endpoint without the route (the CPU engine, a replica without a transfer
        backend) fails ``start`` with nothing changed, so the caller can fall back to a
        load. Answers to ``finish`` land in :attr:`last_load_replies`.
        """
        with self._loading:
            self._refresh_endpoints()
            endpoints = list(self._endpoints)
            self.last_load_replies = {}
            with tracer.start_as_current_span("rollout.transfer_weights") as span:
                span.set_attribute("weights.version", version)
                started, failed = self._transfer_step(endpoints, version, "start",
                                                      {"device": device})  # fmt: skip
                if failed:
                    self._transfer_step(started, version, "abort")
                    raise RolloutError(f"weight transfer v{version} could not start on {failed}")
                try:
                    # One bucket in flight while the producer packs the next into its other
                    # buffer; it refills a buffer only after that buffer's step came back.
                    in_flight: _Step | None = None
                    for info in updates:
                        if in_flight is not None:
                            in_flight.check()
                        in_flight = _Step(self, endpoints, version, "update",
                                          {"update_info": info})  # fmt: skip
                    if in_flight is not None:
                        in_flight.check()
                except BaseException:
                    if in_flight is not None:  # the abort must not overtake it
                        in_flight.thread.join()
                    self._transfer_step(endpoints, version, "abort")
                    raise
                _, failed = self._transfer_step(endpoints, version, "finish")
                if failed:
                    raise RolloutError(f"weight transfer v{version} did not finish on {failed}")

    def _transfer_step(
        self, endpoints: list[_Endpoint], version: int, op: str, extra: dict[str, Any] | None = None
    ) -> tuple[list[_Endpoint], dict[str, str]]:
        """POST one transfer step to ``endpoints`` in parallel: those that took it, and
        why the others did not (by URL)."""
        carrier = {**inject_headers(), **auth_headers()}
        body: dict[str, Any] = {"version": version, "op": op, **(extra or {})}
        done: list[_Endpoint] = []
        failed: dict[str, str] = {}

        def step(endpoint: _Endpoint) -> None:
            try:
                reply = self._post_to(endpoint, "/v1/weights/transfer", body, carrier,
                                      timeout_s=max(self._timeout_s, 600.0))  # fmt: skip
            except Exception as exc:
                failed[endpoint.url] = str(exc)
                return
            done.append(endpoint)
            if op == "finish":
                self.last_load_replies[endpoint.url] = reply

        threads = [threading.Thread(target=step, args=(e,)) for e in endpoints]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return done, failed

    def catch_up(self, urls: list[str]) -> list[str]:
        """Bring replicas that joined since the last load to the last loaded version, then
        sample from them too; returns the URLs now in use.

        A replica pulls the latest committed version before it reports ready, but the
        trainer may publish again between that pull and the moment it shows up here; with
        ``maxPolicyLag: 0`` one batch from it would then be stale. Loading the trainer's
        current version first closes that gap. A joiner that fails the load is left out
        (the next call retries it).
        """
        wanted = [u.rstrip("/") for u in urls]
        with self._loading:
            known = {e.url for e in self._endpoints}
            joiners = [u for u in wanted if u not in known]
            if joiners and self.loaded is not None:
                uri, version = self.loaded
                failures = self._load_on(
                    [_Endpoint(u, self._max_in_flight) for u in joiners], uri, version
                )
                for url, exc in failures.items():
                    log.warning("new replica %s did not load weights v%d yet: %s", url,
                                version, exc)  # fmt: skip
                wanted = [u for u in wanted if u not in failures]
            if wanted and sorted(wanted) != sorted(known):
                self.set_endpoints(wanted)
            return self.urls

    def _refresh_endpoints(self) -> list[str]:
        """Ask ``discover`` for the ready replicas and use them (the last known set when it
        fails or answers nothing); returns the URLs in use."""
        if self.discover is not None:
            try:
                urls = self.discover()
            except Exception as exc:  # keep the last known replicas; the load still happens
                log.warning("rollout endpoint discovery failed before a weight load: %s", exc)
            else:
                if urls:
                    self.set_endpoints(urls)
        return self.urls

    def _load_on(
        self, endpoints: list[_Endpoint], uri: str, version: int, stream: bool | None = None
    ) -> dict[str, Exception]:
        """POST the load to ``endpoints`` in parallel; the failures by URL."""
        carrier = {**inject_headers(), **auth_headers()}  # the pool's weight token
        failures: dict[str, Exception] = {}
        body: dict[str, Any] = {"uri": uri, "version": version}
        if stream is not None:  # servers from before the field refuse unknown fields
            body["stream"] = stream

        def load(endpoint: _Endpoint) -> None:
            try:
                self.last_load_replies[endpoint.url] = self._post_to(
                    endpoint,
                    "/v1/weights/load",
                    body,
                    carrier,
                    timeout_s=max(self._timeout_s, 600.0),
                )
            except Exception as exc:
                failures[endpoint.url] = exc

        threads = [threading.Thread(target=load, args=(e,)) for e in endpoints]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return failures

    def weight_versions(self) -> dict[str, int]:
        """Each endpoint's served version (-1 when unreachable)."""
        versions = {}
        for endpoint in self._endpoints:
            try:
                response = self._http.get(f"{endpoint.url}/v1/weights/version", timeout=10)
                response.raise_for_status()
                versions[endpoint.url] = int(response.json()["weight_version"])
            except (httpx.HTTPError, KeyError, ValueError):
                versions[endpoint.url] = -1
        return versions

    def health(self) -> dict[str, bool]:
        result = {}
        for endpoint in self._endpoints:
            try:
                result[endpoint.url] = (
                    self._http.get(f"{endpoint.url}/health", timeout=10).status_code == 200
                )
            except httpx.HTTPError:
                result[endpoint.url] = False
        return result

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Block until every endpoint answers /health 200 (raises TimeoutError otherwise)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.health()
            if all(status.values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout endpoints not healthy after {timeout_s}s: {status}")
            time.sleep(0.5)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _acquire(self, avoid: set[str]) -> _Endpoint:
        """Block until an eligible endpoint has a free slot; take the least loaded.

        Eligible: not in ``avoid`` (it just failed this request) and not cooling down after
        failures. A retry therefore waits for a slot on a healthy replica instead of going
        straight back to a dead one; a cooled-down replica gets traffic again as a probe.
        Only when nothing is eligible do we fall back to the rest.
        """
        with self._slots:
            while True:
                now = time.monotonic()
                eligible = [
                    e for e in self._endpoints if e.url not in avoid and e.cooldown_until <= now
                ]
                if not eligible:
                    eligible = [e for e in self._endpoints if e.url not in avoid] or list(
                        self._endpoints
                    )
                free = [e for e in eligible if e.in_flight < e.max_in_flight]
                if free:
                    # Least in flight; ties go round-robin (least recently picked).
                    best = min(free, key=lambda e: (e.in_flight, e.last_picked))
                    self._picks += 1
                    best.last_picked = self._picks
                    best.in_flight += 1
                    return best
                self._slots.wait(timeout=0.5)  # also re-checks as cooldowns expire

    def _release(self, endpoint: _Endpoint) -> None:
        with self._slots:
            endpoint.in_flight -= 1
            self._slots.notify()

    def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
        """POST with balancing and retries; the failed replica is avoided on the next try."""
        avoid: set[str] = set()
        last_error: Exception | None = None
        for attempt in range(self._max_retries + 1):
            endpoint = self._acquire(avoid)
            try:
                return self._post_to(endpoint, path, body, headers)
            except _Retryable as exc:
                last_error = exc
            finally:
                self._release(endpoint)  # before the backoff sleep: don't hold a slot idle
            avoid.add(endpoint.url)
            if len(avoid) == len(self._endpoints):
                avoid = {endpoint.url}  # every replica failed once: rotate, skip the latest
            if attempt == self._max_retries:
                break
            CLIENT_RETRIES.inc()
            delay = min(8.0, 0.2 * 2**attempt) * (0.5 + random.random())
            log.warning(
                "rollout %s on %s failed (attempt %d/%d): %s; retrying in %.2fs",
                path,
                endpoint.url,
                attempt + 1,
                self._max_retries + 1,
                last_error,
                delay,
            )
            time.sleep(delay)
        raise RolloutError(
            f"{path} failed after {self._max_retries + 1} attempts across "
            f"{[e.url for e in self._endpoints]}: {last_error}"
        )

    def _post_to(
        self,
        endpoint: _Endpoint,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        started = time.monotonic()
        try:
            response = self._http.post(
                f"{endpoint.url}{path}",
                json=body,
                headers=headers,
                timeout=timeout_s or self._timeout_s,
            )
        except httpx.TransportError as exc:  # connect/read errors and timeouts
            endpoint.record_failure()
            CLIENT_REQUESTS.labels(endpoint.url, "transport_error").inc()
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        CLIENT_LATENCY.observe(time.monotonic() - started)
        if response.status_code >= 500:
            endpoint.record_failure()
            CLIENT_REQUESTS.labels(endpoint.url, "5xx").inc()
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            CLIENT_REQUESTS.labels(endpoint.url, "4xx").inc()
            raise RolloutError(
                f"{endpoint.url}{path} rejected the request (HTTP {response.status_code}): "
                f"{response.text[:500]}"
            )
        endpoint.record_success()
        CLIENT_REQUESTS.labels(endpoint.url, "ok").inc()
        payload = response.json()
        if "weight_version" not in payload and WEIGHT_VERSION_HEADER in response.headers:
            payload["weight_version"] = int(response.headers[WEIGHT_VERSION_HEADER])
        return payload


class _Step:
    """One transfer step running on every endpoint in the background; :meth:`check` waits
    for it and raises RolloutError naming the endpoints that failed."""

    def __init__(
        self, client: RolloutClient, endpoints: list[_Endpoint], version: int, op: str,
        extra: dict[str, Any],
    ) -> None:  # fmt: skip
        self.version = version
        self.failed: dict[str, str] = {}

        def run() -> None:
            _, self.failed = client._transfer_step(endpoints, version, op, extra)

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def check(self) -> None:
        self.thread.join()
        if self.failed:
            raise RolloutError(f"weight transfer v{self.version} failed on {self.failed}")


def parse_completions(response: dict[str, Any], prompt_index: int, n: int) -> list[Completion]:
    """Turn one ``/v1/completions`` response (one prompt, ``n`` choices) into Completions.

    Token ids come from the vLLM ``token_id:N`` strings; ``weight_version`` from the choice,
    else the body (vLLM itself reports none: -1).

    >>> r = {"choices": [{"index": 0, "text": "hi", "finish_reason": "length",
    ...      "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5]}}],
    ...      "weight_version": 3}
    >>> parse_completions(r, 0, 1)[0].token_ids
    [5]
    """
    choices = sorted(response["choices"], key=lambda c: c["index"])
    if len(choices) != n:
        raise RolloutError(f"expected {n} choices, the server returned {len(choices)}")
    version = int(response.get("weight_version", -1))
    completions = []
    for choice in choices:
        logprobs = choice.get("logprobs") or {}
        tokens = logprobs.get("tokens")
        if tokens is None:
            raise RolloutError("server returned no logprobs; it must honour logprobs=0")
        completions.append(
            Completion(
                prompt_index=prompt_index,
                text=choice["text"],
                token_ids=[parse_token_id(t) for t in tokens],
                logprobs=[float(lp) for lp in logprobs["token_logprobs"]],
                finish_reason=choice.get("finish_reason") or "stop",
                weight_version=int(choice.get("weight_version", version)),
            )
        )
    return completions
