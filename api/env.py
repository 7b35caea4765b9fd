"""Environment variables one component sets and another reads: the names live here, once.

The operator puts these on the pods it builds (operator/builders.py, sandbox_runner.py); the
trainer, the rollout discovery and the sandbox runner read them. A name changed on one side
only would fail silently at run time, so both sides import it from here.
"""

from __future__ import annotations

from typing import Final

# Trainer pods.
ROLLOUT_ENDPOINTS: Final = "POSTTRAIN_ROLLOUT_ENDPOINTS"  # comma-separated rollout URLs
ROLLOUT_POOL: Final = "POSTTRAIN_ROLLOUT_POOL"  # spec.rollout.pool: discover its replicas
# The pool's serving dtype (bfloat16, float16, float32): the trainer publishes weights in it.
ROLLOUT_DTYPE: Final = "POSTTRAIN_ROLLOUT_DTYPE"
RUN_NAME: Final = "POSTTRAIN_RUN_NAME"  # the TrainingRun (status reports, discovery)
RUN_NAMESPACE: Final = "POSTTRAIN_RUN_NAMESPACE"
SANDBOX_RUNNER_URL: Final = "POSTTRAIN_SANDBOX_RUNNER_URL"  # the run's own sandbox runner
NODES: Final = "POSTTRAIN_NODES"  # nodes of a multi-node gang
NODE_RANK: Final = "POSTTRAIN_NODE_RANK"  # this pod's node rank in the gang

# vLLM rollout pods.
WEIGHTS_SCRATCH: Final = "POSTTRAIN_WEIGHTS_SCRATCH"  # where weight updates are staged
