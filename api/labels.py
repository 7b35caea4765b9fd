"""Labels and annotations on the objects posttrain creates: the contract between the operator
(which writes them), the CLI (which finds pods and jobs by them) and the workloads (which read
some through the downward API). Kept here, below every component, so none imports another's
internals to learn a key."""

from __future__ import annotations

# Labels every child carries; selectors and the operator's caches key on them.
LABEL_COMPONENT = "posttrain.io/component"
LABEL_RUN = "posttrain.io/run"
LABEL_RANK = "posttrain.io/rank"
LABEL_GANG = "posttrain.io/gang"
LABEL_POOL = "posttrain.io/pool"
POOL_CLIENT_PREFIX = "client.posttrain.io/"
"""``client.posttrain.io/<pool>: "true"`` marks the pods a pool's NetworkPolicy admits."""
LABEL_TASK = "posttrain.io/task"
LABEL_ATTEMPT = "posttrain.io/attempt"
LABEL_SANDBOX_NETWORK = "posttrain.io/sandbox-network"
LABEL_WARM_POOL = "posttrain.io/warm-pool"
LABEL_COLOCATED_ROLLOUT = "posttrain.io/colocated-rollout"
"""``"true"`` on a trainer pod that runs its rollout replicas as sidecars: the run's
colocated NetworkPolicy selects it (and a pod without replicas, from a later gang, not)."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "posttrain-operator"}

# Values of LABEL_COMPONENT.
COMPONENT_TRAINER = "trainer"
COMPONENT_ROLLOUT = "rollout"
COMPONENT_SANDBOX = "sandbox"

ANNOTATION_INCARNATION = "posttrain.io/incarnation"
ANNOTATION_SPEC_HASH = "posttrain.io/spec-hash"
ANNOTATION_FILE_PREFIX = "posttrain.io/file."
ANNOTATION_WEIGHT_VERSION = "posttrain.io/weight-version"
# Where a sandbox pod's entrypoint stores its artifacts (read back when the pod finishes).
ANNOTATION_LOGS_URI = "posttrain.io/logs-uri"
ANNOTATION_SNAPSHOT_URI = "posttrain.io/snapshot-uri"
# A warm-pool pod's claim by a SandboxTask (written with a resourceVersion-guarded patch).
ANNOTATION_CLAIM = "posttrain.io/claim"
