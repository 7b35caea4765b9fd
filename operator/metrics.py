"""Prometheus metrics of the operator (module-level, served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter(
    "posttrain_operator_reconciles_total", "Reconciles run, by resource kind.", ["kind"]
)
RECONCILE_ERRORS = Counter(
    "posttrain_operator_reconcile_errors_total", "Reconciles that raised, by resource kind.",
    ["kind"],
)
RECONCILE_SECONDS = Histogram(
    "posttrain_operator_reconcile_duration_seconds", "Wall time of one reconcile, by kind.",
    ["kind"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
CHILDREN_CREATED = Counter(
    "posttrain_operator_children_created_total",
    "Child objects created (not adopted), by parent kind and child kind.",
    ["parent", "child"],
)
CHILDREN_ADOPTED = Counter(
    "posttrain_operator_children_adopted_total",
    "Creates that found the child already there (restart or cache lag) and adopted it.",
    ["parent", "child"],
)
