"""Prometheus metrics of the operator (module-level, served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter(
    "posttrain_operator_reconciles_total", "Reconciles run, by resource kind.", ["kind"]
)
RECONCILE_ERRORS = Counter(
    "posttrain_operator_reconcile_errors_total",
    "Reconciles that raised, by resource kind.",
    ["kind"],
)
REQUEUES = Counter(
    "posttrain_operator_requeues_total",
    "Retries scheduled after a failed reconcile (exponential backoff per object; one pending "
    "retry per object), by resource kind.",
    ["kind"],
)
RECONCILE_SECONDS = Histogram(
    "posttrain_operator_reconcile_duration_seconds",
    "Wall time of one reconcile, by kind.",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
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
WARM_POOL_CLAIMS = Counter(
    "posttrain_operator_warm_pool_claims_total",
    "First attempts of SandboxTasks with spec.warmPoolRef, by outcome: claimed (an idle pod "
    "was adopted), empty (no idle ready pod: cold pod), mismatch (the pool's template differs: "
    "cold pod), missing (no such pool: cold pod).",
    ["result"],
)
WARM_POOL_CLAIM_CONFLICTS = Counter(
    "posttrain_operator_warm_pool_claim_conflicts_total",
    "Claim patches the apiserver refused because the pod changed first (409); the claim "
    "moved on to the next idle pod.",
)
WARM_POOL_CLAIM_SECONDS = Histogram(
    "posttrain_operator_warm_pool_claim_duration_seconds",
    "Wall time of a successful claim (picking an idle pod + the claim patch).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)
SANDBOX_ARTIFACT_URLS = Counter(
    "posttrain_operator_sandbox_artifact_urls_total",
    "Sandbox attempts given presigned URLs to store their log (and snapshot) in object storage.",
)
