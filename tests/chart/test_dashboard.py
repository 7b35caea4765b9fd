"""Observability in a cluster, as the chart ships it: the Grafana dashboard queries only
metrics posttrain exports, PodMonitors scrape the ports the operator's pods really expose,
and the OTLP endpoint reaches the operator and (through its config) the pods it creates."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

from prometheus_client import REGISTRY

from posttrain.api import RolloutPool, TrainingRun
from posttrain.api import labels as api_labels
from posttrain.operator.rolloutpool import builders as pool_builders
from posttrain.operator.trainingrun import builders as run_builders
from posttrain.operator.trainingrun.evaluator import COMPONENT_EVALUATOR, build_evaluator_job

from .conftest import CHART_DIR, Render, by_kind, one
from .test_render import operator_config_from

DASHBOARD = CHART_DIR / "dashboards" / "posttrain.json"
# Every module that defines Prometheus metrics a pod of a run exports.
METRIC_MODULES = [
    "posttrain.trainer.observe.step_metrics",
    "posttrain.trainer.evaluation.heldout",
    "posttrain.trainer.evaluation.checkpoint_eval",
    "posttrain.trainer.data.rollouts",
    "posttrain.trainer.observe.audit",
    "posttrain.rollout.engine",
    "posttrain.rollout.server",
    "posttrain.rollout.client",
    "posttrain.sandboxes.executor",
    "posttrain.sandboxes.runner",
    "posttrain.sandboxes.verifiers",
    "posttrain.storage.metrics",
    "posttrain.operator.metrics",
]
MONITORING = ["monitoring.coreos.com/v1"]


def exported_series() -> set[str]:
    """Sample names posttrain's metrics expose (counters' _total, histograms' _bucket...)."""
    for module in METRIC_MODULES:
        importlib.import_module(module)
    return {name for name in REGISTRY._names_to_collectors if name.startswith("posttrain_")}


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def test_every_dashboard_query_uses_a_metric_posttrain_exports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = panel_exprs(dashboard)
    assert len(exprs) >= 10
    exported = exported_series()
    used = set()
    for title, expr in exprs:
        names = set(re.findall(r"\bposttrain_[a-z0-9_]+", expr))
        assert names, f"panel {title!r} queries no posttrain metric: {expr}"
        missing = names - exported
        assert not missing, f"panel {title!r} queries {sorted(missing)}, which nothing exports"
        used |= names
    # What the issue asks the dashboard to show is there.
    for needed in (
        "posttrain_trainer_reward_mean",
        "posttrain_trainer_eval_accuracy",
        "posttrain_trainer_staleness_steps",
        "posttrain_sandbox_exec_seconds_bucket",
    ):
        assert needed in used, needed
    titles = [p["title"] for p in dashboard["panels"]]
    assert "Worst 5 domains (train reward)" in titles and "Best 5 domains (train reward)" in titles


def test_dashboard_configmap_and_pod_monitors_render(render: Render) -> None:
    assert not by_kind(render(api_versions=MONITORING), "PodMonitor"), "off by default"
    objects = render(
        sets={
            "metrics.grafanaDashboard.enabled": "true",
            "metrics.podMonitors.enabled": "true",
            "operator.watchNamespaces[0]": "team-a",
        },
        api_versions=MONITORING,
    )
    dashboard = one(objects, "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["posttrain.json"]) == json.loads(DASHBOARD.read_text())
    monitors = {
        m["spec"]["selector"]["matchLabels"][api_labels.LABEL_COMPONENT]: m
        for m in by_kind(objects, "PodMonitor")
    }
    assert set(monitors) == {
        api_labels.COMPONENT_TRAINER,
        api_labels.COMPONENT_ROLLOUT,
        "sandbox-runner",
        COMPONENT_EVALUATOR,
    }
    for monitor in monitors.values():
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    # The ports they scrape are the ones the operator's builders give the pods.
    config = operator_config_from(one(objects, "ConfigMap", "-operator")["data"])
    run = TrainingRun.model_validate(
        {
            "metadata": {"name": "r", "namespace": "team-a", "uid": "u"},
            "spec": {
                "model": "m",
                "domains": [{"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}],
            },
        }
    )
    trainer = run_builders.build_trainer_pod(run, config, 0, 0)["spec"]["containers"][0]
    pool = RolloutPool.model_validate(
        {"metadata": {"name": "p", "namespace": "team-a", "uid": "u"}, "spec": {"model": "m"}}
    )
    rollout = pool_builders.build_rollout_deployment(pool, config)["spec"]["template"]["spec"][
        "containers"
    ][0]
    run.spec.evaluation.inline = False
    evaluator = build_evaluator_job(run, config)["spec"]["template"]["spec"]["containers"][0]
    for component, container in (
        (api_labels.COMPONENT_TRAINER, trainer),
        (api_labels.COMPONENT_ROLLOUT, rollout),
        (COMPONENT_EVALUATOR, evaluator),
    ):
        port = monitors[component]["spec"]["podMetricsEndpoints"][0]["port"]
        assert port in {p["name"] for p in container["ports"]}, component
    without = render(sets={"metrics.podMonitors.enabled": "true"})  # no prometheus-operator
    assert not by_kind(without, "PodMonitor")


def test_otlp_endpoint_reaches_the_operator_and_its_pods(render: Render) -> None:
    endpoint = "http://otel-collector.monitoring:4318"
    data = one(render(sets={"tracing.otlpEndpoint": endpoint}), "ConfigMap", "-operator")["data"]
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint  # the operator's own spans
    config = operator_config_from(data)
    run = TrainingRun.model_validate(
        {
            "metadata": {"name": "r", "namespace": "ns", "uid": "u"},
            "spec": {
                "model": "m",
                "domains": [{"name": "d", "dataset": "builtin:x", "verifier": {"kind": "exact"}}],
            },
        }
    )
    env = {
        e["name"]: e.get("value")
        for e in run_builders.build_trainer_pod(run, config, 0, 0)["spec"]["containers"][0]["env"]
    }
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in one(render(), "ConfigMap", "-operator")["data"]
