"""The names of every environment variable the operator sets and its pods read.

No imports of ours or pydantic's: a command line that needs a name for its ``--help`` imports
this module and nothing heavy. :mod:`posttrain.api.env` re-exports the names with the typed
models that write and parse them.
"""

from __future__ import annotations

from typing import Final

# ------------------------------------------------------------------ trainer pods
RUN_NAME: Final = "POSTTRAIN_RUN_NAME"  # the TrainingRun (status reports, discovery)
RUN_NAMESPACE: Final = "POSTTRAIN_RUN_NAMESPACE"
RUN_UID: Final = "POSTTRAIN_RUN_UID"  # metadata.uid: one incarnation of a run's name
NODES: Final = "POSTTRAIN_NODES"  # nodes of a multi-node gang (overrides spec.resources.nodes)
NODE_RANK: Final = "POSTTRAIN_NODE_RANK"  # this pod's node rank in the gang
GANG: Final = "POSTTRAIN_GANG"  # the gang's incarnation (restarts): names its rendezvous
MASTER_ADDR: Final = "MASTER_ADDR"  # torch's static rendezvous: rank 0's host
MASTER_PORT: Final = "MASTER_PORT"
WORLD_SIZE: Final = "WORLD_SIZE"  # torch's: the gang's node count at the pod level
RANK: Final = "RANK"  # torch's: the node rank at the pod level (torchrun rewrites it per rank)
RAY_ADDRESS: Final = "RAY_ADDRESS"  # a RayCluster gang: the head's GCS
ROLLOUT_ENDPOINTS: Final = "POSTTRAIN_ROLLOUT_ENDPOINTS"  # comma-separated rollout URLs
ROLLOUT_POOL: Final = "POSTTRAIN_ROLLOUT_POOL"  # spec.rollout.pool: discover its replicas
# The pool's serving dtype (bfloat16, float16, float32): the trainer publishes weights in it.
ROLLOUT_DTYPE: Final = "POSTTRAIN_ROLLOUT_DTYPE"
SANDBOX_RUNNER_URL: Final = "POSTTRAIN_SANDBOX_RUNNER_URL"  # the run's own sandbox runner
RENDEZVOUS_TIMEOUT_S: Final = "POSTTRAIN_RENDEZVOUS_TIMEOUT_S"  # a user's knob, not the operator's
RAY_NODE_WAIT_S: Final = "POSTTRAIN_RAY_NODE_WAIT_S"  # how long the Ray driver waits for nodes

# ------------------------------------------------------------------ storage (any pod, the CLI)
S3_ENDPOINT: Final = "POSTTRAIN_S3_ENDPOINT"  # host:port, or a URL whose scheme sets TLS
S3_SECURE: Final = "POSTTRAIN_S3_SECURE"
S3_CA_BUNDLE: Final = "POSTTRAIN_S3_CA_BUNDLE"
S3_REGION: Final = "POSTTRAIN_S3_REGION"
S3_CREDENTIALS_DIR: Final = "POSTTRAIN_S3_CREDENTIALS_DIR"  # a mounted Secret: accesskey, secretkey
S3_CREDENTIAL_KEYS: Final = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")

# ------------------------------------------------------------------ rollout pool replicas
POOL_NAME: Final = "POSTTRAIN_POOL_NAME"
WEIGHTS_URI: Final = "POSTTRAIN_WEIGHTS_URI"  # prefix the replica polls for weight versions
WEIGHTS_POLL_SECONDS: Final = "POSTTRAIN_WEIGHTS_POLL_SECONDS"
WEIGHTS_SCRATCH: Final = "POSTTRAIN_WEIGHTS_SCRATCH"  # where a vLLM replica stages weights
# Pool replicas and the trainers of runs that name the pool: the pool's weight token, which
# POST /v1/weights/load requires (rollout/auth.py). From the Secret <pool>-weights-token
# (a secretKeyRef, so no field of the models here).
WEIGHTS_TOKEN: Final = "POSTTRAIN_WEIGHTS_TOKEN"
CACHE: Final = "POSTTRAIN_CACHE"  # where models are converted/downloaded (default ~/.cache)
NUM_THREADS: Final = "POSTTRAIN_NUM_THREADS"  # the CPU engine's torch threads
VLLM_PYTHON: Final = "POSTTRAIN_VLLM_PYTHON"  # the interpreter of a laptop's vLLM environment

# ------------------------------------------------------------------ sandbox pods
# Read by sandboxes/task_entrypoint.py and operator/warmpool/entrypoint.py (stdlib only, copies).
SANDBOX_TASK: Final = "POSTTRAIN_SANDBOX_TASK"
SANDBOX_ATTEMPT: Final = "POSTTRAIN_SANDBOX_ATTEMPT"
SANDBOX_WORKDIR: Final = "POSTTRAIN_SANDBOX_WORKDIR"
SANDBOX_RESULT_PATH: Final = "POSTTRAIN_SANDBOX_RESULT_PATH"
SANDBOX_TIMEOUT: Final = "POSTTRAIN_SANDBOX_TIMEOUT"
SANDBOX_LOG_LIMIT: Final = "POSTTRAIN_SANDBOX_LOG_LIMIT"
SANDBOX_LOGS_URL: Final = "POSTTRAIN_SANDBOX_LOGS_URL"
SANDBOX_SNAPSHOT_URL: Final = "POSTTRAIN_SANDBOX_SNAPSHOT_URL"
SANDBOX_RESTORE_URL: Final = "POSTTRAIN_SANDBOX_RESTORE_URL"
WARM_WORKDIR: Final = "POSTTRAIN_WORKDIR"  # a warm pool pod's workdir
WARM_CLAIM_FILE: Final = "POSTTRAIN_CLAIM_FILE"  # the downward-API file with the claim

# ------------------------------------------------------------------ the operator and dev tools
OPERATOR_PREFIX: Final = "POSTTRAIN_OPERATOR_"  # OperatorConfig's fields (the Helm chart)
OPERATOR_KUBECONFIG: Final = "POSTTRAIN_OPERATOR_KUBECONFIG"
OPERATOR_S3_ENDPOINT: Final = "POSTTRAIN_OPERATOR_S3_ENDPOINT"
OPERATOR_SANDBOX_ARTIFACTS_URI: Final = "POSTTRAIN_OPERATOR_SANDBOX_ARTIFACTS_URI"
DEV_DIR: Final = "POSTTRAIN_DEV_DIR"  # `posttrain dev up`'s state
BIN_DIR: Final = "POSTTRAIN_BIN_DIR"  # the dev environment's downloaded binaries
