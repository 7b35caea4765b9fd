"""OpenTelemetry spans and Prometheus metrics of every component, read in process:
spans from ``posttrain.telemetry.memory_exporter()``, metrics from prometheus_client's
REGISTRY. Each test drives the real component (bubblewrap sandbox, uvicorn rollout
server over HTTP, the operator against the real apiserver)."""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from posttrain.telemetry import get_tracer, memory_exporter

CliRunner = Any


@pytest.fixture
def spans() -> Iterator[Any]:
    """The in-memory exporter, emptied before and after the test."""
    exporter = memory_exporter()
    exporter.clear()
    yield exporter
    exporter.clear()


def finished(exporter: Any, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_sandbox_execution_span_and_metrics(spans: Any) -> None:
    from posttrain.sandboxes.executor import ExecRequest, Executor

    before = sample("posttrain_sandbox_executions_total", {"status": "ok"})
    executor = Executor()
    try:
        result = executor.run(ExecRequest(command=["python3", "-c", "print(6 * 7)"]))
    finally:
        executor.close()
    assert result.status == "ok" and result.stdout == "42\n"

    (span,) = finished(spans, "sandbox.exec")
    attributes = dict(span.attributes)
    assert attributes["sandbox.status"] == "ok"
    assert attributes["sandbox.exit_code"] == 0
    assert attributes["sandbox.network"] == "none"
    assert attributes["sandbox.duration_ms"] > 0
    assert "python3" in attributes["sandbox.command"]
    assert sample("posttrain_sandbox_executions_total", {"status": "ok"}) == before + 1
    assert sample("posttrain_sandbox_exec_seconds_count") >= 1


@pytest.mark.slow
def test_rollout_request_carries_trace_context_client_to_server(spans: Any, tmp_path: Path) -> None:
    import torch

    from posttrain.models import make_tiny_model
    from posttrain.rollout.client import RolloutClient
    from posttrain.rollout.protocol import SamplingParams
    from posttrain.rollout.server import ServerConfig, ServerThread

    torch.set_num_threads(1)
    server = ServerThread(ServerConfig(model=str(make_tiny_model(tmp_path / "tiny")))).start()
    client = RolloutClient([server.url], timeout_s=60)
    served_before = sample(
        "posttrain_rollout_requests_total", {"endpoint": "completions", "status": "200"}
    )
    try:
        with get_tracer("test").start_as_current_span("trainer.step") as step_span:
            groups = client.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=4, seed=0))
    finally:
        client.close()
        server.stop()
    assert len(groups) == 1 and len(groups[0]) == 2

    (client_span,) = finished(spans, "rollout.generate")
    (server_span,) = finished(spans, "rollout.completions")
    trace_id = step_span.get_span_context().trace_id
    assert client_span.context.trace_id == trace_id
    # The server span was started from the traceparent header (uvicorn runs it on another
    # thread, so only the propagated context can link it): same trace, client as parent.
    assert server_span.context.trace_id == trace_id
    assert server_span.parent is not None and server_span.parent.is_remote
    assert server_span.parent.span_id == client_span.context.span_id
    assert dict(server_span.attributes)["rollout.prompts"] == 1
    assert dict(server_span.attributes)["rollout.n"] == 2
    assert dict(client_span.attributes)["rollout.n"] == 2
    assert (
        sample("posttrain_rollout_requests_total", {"endpoint": "completions", "status": "200"})
        == served_before + 1
    )
    assert sample("posttrain_rollout_client_request_seconds_count") >= 1


@pytest.mark.cluster
def test_reconcile_span_metrics_and_what_the_user_sees(
    spans: Any, kcli: CliRunner, kube: Any, kubeconfig: Path, kubectl: Any, tmp_path: Path
) -> None:
    """The real operator reconciles a run applied with ``posttrain apply``; its span and
    counters exist, and the conditions/events it wrote show in both describe commands."""
    import yaml

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    reconciles_before = sample("posttrain_operator_reconciles_total", {"kind": "TrainingRun"})
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(kube.run_manifest("traced")))
    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(kube.namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint="127.0.0.1:9000",
    )
    with OperatorThread(config):
        assert kcli("apply", "-f", str(manifest)).code == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = kube.get_run("traced").get("status") or {}
            if status.get("phase") and status.get("conditions"):
                break
            time.sleep(0.2)
        described = kcli("describe", "tr", "traced")
    assert status.get("phase"), f"the operator never set a phase: {status}"

    reconciles = [
        s
        for s in finished(spans, "reconcile TrainingRun")
        if dict(s.attributes).get("posttrain.object") == "traced"
    ]
    assert reconciles, "no reconcile span for the run"
    assert dict(reconciles[0].attributes)["k8s.namespace.name"] == kube.namespace
    assert (
        sample("posttrain_operator_reconciles_total", {"kind": "TrainingRun"}) > reconciles_before
    )
    assert (
        sample("posttrain_operator_reconcile_duration_seconds_count", {"kind": "TrainingRun"}) >= 1
    )

    condition = status["conditions"][0]
    assert described.code == 0, described.err
    assert condition["reason"] in described.out
    assert f"Phase:        {status['phase']}" in described.out
    from_kubectl = kubectl("describe", "tr", "traced", "-n", kube.namespace).stdout
    assert condition["reason"] in from_kubectl


COMPONENT_METRIC_MODULES = {
    "operator": "posttrain.operator.metrics",
    "trainer": "posttrain.trainer.observe.step_metrics",
    "rollout": "posttrain.rollout.server",
    "rollout client": "posttrain.rollout.client",
    "sandboxes": "posttrain.sandboxes.executor",
    "storage": "posttrain.storage.metrics",
}


@pytest.mark.parametrize("component", sorted(COMPONENT_METRIC_MODULES))
def test_every_component_registers_posttrain_metrics(component: str) -> None:
    module = importlib.import_module(COMPONENT_METRIC_MODULES[component])
    from prometheus_client.metrics import MetricWrapperBase

    own = [v for v in vars(module).values() if isinstance(v, MetricWrapperBase)]
    assert own, f"{component} defines no module-level Prometheus metrics"
    registered = {m.name for m in REGISTRY.collect()}
    for metric in own:
        assert metric._name.startswith("posttrain_"), metric._name
        assert metric._name in registered or metric._name.removesuffix("_total") in registered


def test_a_taken_metrics_port_is_an_info_line_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Trainer pods serve /metrics; where pods are host processes (the dev node agent) the
    port may be taken, and the run must go on without metrics rather than fail. It is
    expected there, so INFO: a WARNING would ask the user to act on every dev run."""
    import socket

    from posttrain.telemetry import start_metrics_server

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("INFO", logger="posttrain.telemetry"):
            start_metrics_server(port)
    (record,) = [r for r in caplog.records if "cannot serve Prometheus metrics" in r.message]
    assert f":{port}" in record.message and record.levelname == "INFO"
