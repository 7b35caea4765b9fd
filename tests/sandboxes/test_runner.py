"""The runner server over real HTTP (uvicorn), its client, back-pressure, tracing, metrics,
its limits against clients, and the ``posttrain sandbox exec`` JSON contract through a
subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from posttrain.cli import main
from posttrain.httplimits import HttpLimits, uvicorn_options
from posttrain.sandboxes.client import SandboxClient, SandboxUnavailable
from posttrain.sandboxes.executor import Executor
from posttrain.sandboxes.protocol import ExecLimits
from posttrain.sandboxes.runner import RunnerApp, create_app, parse_exec_request
from posttrain.sandboxes.verifiers import verify
from posttrain.telemetry import get_tracer, inject_headers, memory_exporter


@contextlib.contextmanager
def running_server(
    concurrency: int,
    max_queue: int,
    keep_alive_s: int = 5,
    executor: Executor | None = None,
    stack: tuple[str, str] = ("auto", "auto"),
    http: HttpLimits | None = None,
) -> Iterator[str]:
    """A real uvicorn server on a free port, in a thread, configured as ``serve`` configures
    it; yields its base URL. ``stack`` is uvicorn's (loop, http): "auto" takes uvloop and
    httptools when installed."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # As `posttrain sandbox serve` runs it: two pre-started sandboxes per slot.
    executor = executor or Executor(warm_pool=2 * concurrency)
    app = create_app(executor, concurrency=concurrency, max_queue=max_queue, http=http)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=keep_alive_s,
            loop=stack[0],
            **uvicorn_options(app.http, stack[1]),
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "runner did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        executor.close()


@pytest.fixture(scope="module")
def runner_url() -> Iterator[str]:
    # The pure-Python stack (no uvloop/httptools), as on a machine without those extras;
    # the other servers here take the fast stack when it is installed.
    with running_server(concurrency=2, max_queue=16, stack=("asyncio", "h11")) as url:
        yield url


def test_hundred_concurrent_executions_all_return(runner_url: str) -> None:
    with SandboxClient(runner_url, retries=20, backoff_s=0.05) as client:
        with ThreadPoolExecutor(max_workers=100) as pool:
            results = list(
                pool.map(lambda i: client.exec(["python3", "-c", f"print({i} * 2)"]), range(100))
            )
        assert [r.status for r in results] == ["ok"] * 100
        assert [r.stdout for r in results] == [f"{i * 2}\n" for i in range(100)]
        assert client.health()["running"] == 0


def test_metrics_and_trace_context(runner_url: str) -> None:
    tracer = get_tracer("test")
    with tracer.start_as_current_span("trainer.step") as parent:
        response = httpx.post(
            f"{runner_url}/v1/exec",
            headers=inject_headers(),
            json={"command": ["sh", "-c", "exit 7"]},
            timeout=30,
        )
    assert response.status_code == 200
    assert response.json()["status"] == "error" and response.json()["exit_code"] == 7
    trace_id = parent.get_span_context().trace_id
    spans = {
        s.name: s for s in memory_exporter().get_finished_spans() if s.context.trace_id == trace_id
    }
    assert {"sandbox.runner.exec", "sandbox.exec"} <= set(spans)
    assert spans["sandbox.exec"].attributes["sandbox.exit_code"] == 7
    assert spans["sandbox.exec"].attributes["sandbox.status"] == "error"
    metrics = httpx.get(f"{runner_url}/metrics").text
    assert "posttrain_sandbox_exec_seconds_bucket" in metrics
    assert 'posttrain_sandbox_executions_total{status="error"}' in metrics
    assert "posttrain_sandbox_runner_queue_depth" in metrics


def test_bad_requests_get_422_with_the_reason(runner_url: str) -> None:
    response = httpx.post(f"{runner_url}/v1/exec", json={"command": "ls", "timeout_s": 5})
    assert response.status_code == 422
    assert "command must be a non-empty list" in response.json()["error"]


def test_full_queue_answers_429_and_client_reports_it() -> None:
    with running_server(concurrency=1, max_queue=0) as url, ThreadPoolExecutor(2) as pool:
        slow = pool.submit(
            httpx.post, f"{url}/v1/exec", json={"command": ["sleep", "1"]}, timeout=30
        )
        time.sleep(0.3)
        refused = httpx.post(f"{url}/v1/exec", json={"command": ["true"]}, timeout=30)
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        with pytest.raises(SandboxUnavailable, match="HTTP 429"):
            SandboxClient(url, retries=0).exec(["true"])
        assert slow.result().json()["status"] == "ok"


def test_client_retries_connection_errors_then_explains() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=r"failed 3 times.*ConnectError"):
        SandboxClient(dead, retries=2, backoff_s=0.05).exec(["true"])
    assert time.monotonic() - started >= 0.15  # it backed off between attempts


def test_unknown_routes_wrong_methods_and_huge_bodies_are_refused(runner_url: str) -> None:
    missing = httpx.get(f"{runner_url}/v2/exec")
    assert missing.status_code == 404 and "POST /v1/exec" in missing.json()["error"]
    wrong = httpx.get(f"{runner_url}/v1/exec")
    assert wrong.status_code == 405 and "GET is not allowed" in wrong.json()["error"]
    assert wrong.headers["allow"] == "POST"
    not_json = httpx.post(f"{runner_url}/v1/exec", content=b"{oops")
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]
    small = create_app(concurrency=1, max_queue=1, http=HttpLimits(max_body_bytes=1000))
    huge = post_in_process(small, {"command": ["true"], "files": {"big.txt": "x" * 2000}})
    assert huge.status_code == 413 and "limit of 1000 bytes" in huge.json()["error"]


def post_in_process(app: RunnerApp, body: object, raw: bytes | None = None) -> httpx.Response:
    """POST /v1/exec to ``app`` in this process (no socket): for requests refused before
    anything runs."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://runner") as client:
            if raw is not None:
                return await client.post("/v1/exec", content=raw)
            return await client.post("/v1/exec", json=body)

    return asyncio.run(post())


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("max_processes", 10**9, "limit of 256 (posttrain sandbox serve --max-processes)"),
        ("memory_mb", 8192, "limit of 1024 (posttrain sandbox serve --max-memory-mb)"),
        ("timeout_s", 601, "limit of 600 (posttrain sandbox serve --max-timeout-s)"),
        ("cpu_time_s", 10**6, "limit of 601 (posttrain sandbox serve --max-timeout-s)"),
        ("workdir_mb", 513, "limit of 512 (posttrain sandbox serve --max-workdir-mb)"),
        ("max_file_mb", 10**6, "limit of 512 (posttrain sandbox serve --max-file-mb)"),
        ("max_output_bytes", 1 << 30, "(posttrain sandbox serve --max-output-bytes)"),
        ("network", "host", "--allow-host-network"),
    ],
)
def test_requests_over_the_runner_limits_are_400_naming_field_and_limit(
    field: str, value: object, named: str
) -> None:
    app = create_app(concurrency=1, max_queue=1, exec_limits=ExecLimits(max_memory_mb=1024))
    response = post_in_process(app, {"command": ["true"], field: value})
    assert response.status_code == 400, response.text
    assert f"{field}=" in response.json()["error"] and named in response.json()["error"]


def test_malformed_bodies_are_4xx_not_500() -> None:
    app = create_app(concurrency=1, max_queue=1)
    deep = post_in_process(app, None, raw=b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400 and "not valid JSON" in deep.json()["error"]
    nested = b'{"command": ["true"], "env": ' + b"[" * 900 + b"]" * 900 + b"}"
    inner = post_in_process(app, None, raw=nested)
    assert inner.status_code == 422 and "env has the wrong type" in inner.json()["error"]
    assert len(inner.json()["error"]) < 300  # the nested value is quoted shortened
    wrong_type = post_in_process(app, {"command": ["true"], "cpu_time_s": "5"})
    assert wrong_type.status_code == 422 and "cpu_time_s" in wrong_type.json()["error"]


def test_host_network_needs_the_flag_and_caps_are_the_flags() -> None:
    body = json.dumps({"command": ["true"], "network": "host", "memory_mb": 2048}).encode()
    request, _ = parse_exec_request(body, ExecLimits(allow_host_network=True))
    assert request.network == "host"
    assert main(["sandbox", "serve", "--max-memory-mb", "0"]) == 2  # refused before serving


def test_slow_clients_are_cut_off() -> None:
    limits = HttpLimits(body_timeout_s=0.5, header_timeout_s=0.5)
    with running_server(1, 1, http=limits, stack=("asyncio", "h11")) as url:
        port = int(url.rsplit(":", 1)[1])
        for request in (
            b"POST /v1/exec HTTP/1.1\r\nHost: r\r\n",  # headers that never finish
            b"POST /v1/exec HTTP/1.1\r\nHost: r\r\nContent-Length: 99\r\n\r\n{",  # no body
        ):
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(request)
                answer = b""
                while chunk := sock.recv(65536):  # until the server closes
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert time.monotonic() - started < 3


def test_client_keeps_one_connection_alive_per_concurrent_caller(runner_url: str) -> None:
    with SandboxClient(runner_url) as client:
        for i in range(5):
            assert client.exec(["sh", "-c", f"echo {i}"]).stdout == f"{i}\n"
        assert client.health()["status"] == "ok"
        assert client.connections.opened == 1  # six requests, one TCP connection
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda i: client.exec(["echo", str(i)]), range(30)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(30)]
        assert client.connections.opened <= 3  # at most one per thread, then reused


def test_client_replaces_a_connection_the_server_closed_without_a_retry() -> None:
    # retries=0: a stale keep-alive connection must not cost an attempt.
    with (
        running_server(concurrency=1, max_queue=4, keep_alive_s=1) as url,
        SandboxClient(url, retries=0) as client,
    ):
        assert client.exec(["echo", "one"]).stdout == "one\n"
        time.sleep(1.5)  # the server closes the idle connection after 1 s
        assert client.exec(["echo", "two"]).stdout == "two\n"
        assert client.connections.opened == 2


def test_warm_pool_refills_under_concurrent_load() -> None:
    executor = Executor(warm_pool=3)
    with running_server(concurrency=3, max_queue=64, executor=executor) as url:
        exporter = memory_exporter()
        exporter.clear()
        with (
            SandboxClient(url, retries=10, backoff_s=0.05) as client,
            ThreadPoolExecutor(max_workers=6) as pool,
        ):
            results = list(pool.map(lambda i: client.exec(["echo", str(i)]), range(60)))
            assert [r.stdout for r in results] == [f"{i}\n" for i in range(60)]
            warm = [
                s.attributes["sandbox.warm"]
                for s in exporter.get_finished_spans()
                if s.name == "sandbox.exec"
            ]
            assert len(warm) == 60
            # Refilled off the request path: most executions found a pre-started sandbox.
            assert sum(warm) >= 30, f"only {sum(warm)} of 60 executions were warm"
            assert client.health()["running"] == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert 'posttrain_sandbox_warm_pool_takes_total{result="hit"}' in metrics
        assert executor.pool is not None
        deadline = time.monotonic() + 10
        while len(executor.pool._ready) < 3:  # back to full once the burst is over
            assert time.monotonic() < deadline, f"pool stuck at {len(executor.pool._ready)}"
            time.sleep(0.02)


def test_verifier_runs_through_the_runner(runner_url: str) -> None:
    with SandboxClient(runner_url) as client:
        result = verify(
            "unit_tests",
            "```python\ndef sq(x):\n    return x * x\n```",
            {"tests": "from solution import sq\nassert sq(3) == 9\nassert sq(2) == 5"},
            executor=client,
        )
    assert result.reward == 0.5


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "posttrain", "sandbox", "exec", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_prints_exactly_one_json_object() -> None:
    done = cli(
        "--timeout",
        "5",
        "--",
        "python3",
        "-c",
        "import sys; print(sys.stdin.read().upper()); sys.exit(3)",
        stdin="hello",
    )
    assert done.returncode == 0, done.stderr  # the sandbox worked; the program failed
    assert len(done.stdout.strip().splitlines()) == 1
    payload = json.loads(done.stdout)
    assert set(payload) == {"status", "exit_code", "stdout", "stderr", "duration_ms", "reason"}
    assert payload["status"] == "error" and payload["exit_code"] == 3
    assert payload["stdout"] == "HELLO\n" and isinstance(payload["duration_ms"], float)

    timed_out = json.loads(cli("--timeout", "0.5", "--", "sleep", "10").stdout)
    assert timed_out["status"] == "timeout" and timed_out["exit_code"] is None
    truncated = json.loads(
        cli(
            "--max-output-bytes",
            "100",
            "--memory-mb",
            "128",
            "--",
            "python3",
            "-c",
            "print('y' * 1000); x = bytearray(1 << 30)",
        ).stdout
    )
    assert truncated["status"] == "oom"
    assert "[truncated by sandbox: 901 more bytes]" in truncated["stdout"]


def test_cli_usage_errors_exit_2() -> None:
    missing = cli()
    assert missing.returncode == 2 and "no command given" in missing.stderr
    bad = cli("--memory-mb", "4", "--", "true")
    assert bad.returncode == 2 and "memory_mb must be >= 32" in bad.stderr


def test_serve_command_runs_a_warm_runner() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "posttrain",
            "sandbox",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--concurrency",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = SandboxClient(
            f"http://127.0.0.1:{port}", retries=100, backoff_s=0.1, max_backoff_s=0.2
        )
        # The retries cover the server's start-up (connection refused until it listens).
        result = client.exec(["sh", "-c", "echo served; exit 5"])
        assert (result.status, result.exit_code, result.stdout) == ("error", 5, "served\n")
        assert client.health()["concurrency"] == 1
    finally:
        server.terminate()
        _, stderr = server.communicate(timeout=30)
    assert "sandbox runner on 127.0.0.1" in stderr
