"""The operator -> pod contract: every environment variable one side writes and the other reads.

The operator writes a pod's environment from one of the models below (``model.to_env()``);
the process in the pod parses it once at its entry point (``Model.from_env()``) and passes the
typed model down. A name changed on one side only would fail silently at run time, so the
names live here, once: no other module of posttrain spells a ``POSTTRAIN_`` name
(tests/test_env_contract.py enforces it). The two stdlib-only entrypoints the operator ships
as source into foreign images (``sandboxes/task_entrypoint.py``,
``operator/warm_entrypoint.py``) cannot import this module; a test keeps their copies equal.

Torch's and Ray's own names (``MASTER_ADDR``, ``MASTER_PORT``, ``RAY_ADDRESS``) are in the
trainer's model too: the operator writes them and the trainer reads them, so they are part of
the same contract even though the libraries read them as well.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from posttrain.errors import UsageError

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
# Read by sandboxes/task_entrypoint.py and operator/warm_entrypoint.py (stdlib only, copies).
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


def _text(value: Any) -> str:
    """A field's value as the environment spells it.

    >>> _text(True), _text(3), _text(["http://a", "http://b"]), _text(0.5)
    ('true', '3', 'http://a,http://b', '0.5')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value)
    return str(value)


class PodEnv(BaseModel):
    """A typed environment: each field's ``validation_alias`` is its variable's name.

    Unset and empty variables both mean "not given" (the field's default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True)

    @classmethod
    def variable(cls, field: str) -> str:
        """The environment variable of ``field``."""
        alias = cls.model_fields[field].validation_alias
        assert isinstance(alias, str), f"{cls.__name__}.{field} has no variable name"
        return alias

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """Parse the variables this model names (``os.environ`` by default), once.

        A malformed value fails here, naming the variable, its value and what it must be.
        """
        environ = os.environ if environ is None else environ
        given: dict[str, str] = {}
        for field in cls.model_fields:
            name = cls.variable(field)
            value = environ.get(name, "").strip()
            if value:
                given[name] = value
        try:
            return cls.model_validate(given)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                name = str(error["loc"][0]) if error["loc"] else cls.__name__
                shown = f"={given[name]!r}" if name in given else " (unset)"
                problems.append(f"${name}{shown}: {error['msg']}")
            raise UsageError(
                f"the environment the operator sets ({cls.__name__}, posttrain/api/env.py) is "
                f"malformed: {'; '.join(problems)}"
            ) from None

    def to_env(self) -> list[dict[str, str]]:
        """The pod's ``env`` entries, in field order; unset (None, empty) fields are left out."""
        entries = []
        for field in type(self).model_fields:
            value = getattr(self, field)
            if value is None or value == [] or value == "":
                continue
            entries.append({"name": type(self).variable(field), "value": _text(value)})
        return entries


def _env(name: str, description: str, default: Any = None) -> Any:
    """A field read from and written to the variable ``name``."""
    return Field(default, validation_alias=name, description=description)


class TrainerEnv(PodEnv):
    """What the operator hands a trainer pod: run identity, place in the gang, endpoints.

    Every field is optional: ``posttrain run`` on a laptop has none of them.

    >>> env = TrainerEnv(run_name="r1", run_namespace="ns", node_rank=1, gang=2)
    >>> [e["name"] for e in env.to_env()]
    ['POSTTRAIN_RUN_NAME', 'POSTTRAIN_RUN_NAMESPACE', 'POSTTRAIN_NODE_RANK', 'POSTTRAIN_GANG']
    >>> TrainerEnv.from_env({e["name"]: e["value"] for e in env.to_env()}) == env
    True
    >>> TrainerEnv.from_env({"POSTTRAIN_ROLLOUT_ENDPOINTS": "http://a, http://b,"}).rollout_endpoints
    ['http://a', 'http://b']
    >>> TrainerEnv.from_env({"POSTTRAIN_NODE_RANK": "one"})
    Traceback (most recent call last):
    ...
    posttrain.errors.UsageError: the environment the operator sets (TrainerEnv, posttrain/api/env.py) is malformed: $POSTTRAIN_NODE_RANK='one': Input should be a valid integer, unable to parse string as an integer
    """

    run_name: str | None = _env(RUN_NAME, "the TrainingRun: status reports, pool discovery")
    run_namespace: str | None = _env(RUN_NAMESPACE, "the run's namespace")
    run_uid: str | None = _env(RUN_UID, "the run's metadata.uid, when the operator knows it")
    master_addr: str | None = _env(MASTER_ADDR, "rank 0's host (127.0.0.1 for one node)")
    master_port: int | None = _env(MASTER_PORT, "the static rendezvous port")
    world_size: int | None = _env(WORLD_SIZE, "torch's pod-level WORLD_SIZE: the gang's nodes")
    rank: int | None = _env(RANK, "torch's pod-level RANK: the node rank")
    node_rank: int = _env(NODE_RANK, "this pod's node rank in the gang", 0)
    gang: int = _env(GANG, "the gang's incarnation: restarts count up, rendezvous ids use it", 0)
    nodes: int | None = _env(NODES, "nodes of the gang; overrides spec.resources.nodes")
    sandbox_runner_url: str | None = _env(SANDBOX_RUNNER_URL, "the run's own sandbox runner")
    rollout_endpoints: list[str] = _env(
        ROLLOUT_ENDPOINTS, "the resolved pool's Service URL(s), a fallback for discovery", []
    )
    rollout_pool: str | None = _env(ROLLOUT_POOL, "spec.rollout.pool: its replicas are followed")
    rollout_dtype: str | None = _env(ROLLOUT_DTYPE, "the pool's serving dtype")
    ray_address: str | None = _env(RAY_ADDRESS, "a RayCluster gang's head (host:port)")
    rendezvous_timeout_s: int | None = _env(
        RENDEZVOUS_TIMEOUT_S, "seconds the rendezvous waits for every node (a user's knob)"
    )
    ray_node_wait_s: float | None = _env(
        RAY_NODE_WAIT_S, "seconds the Ray driver waits for its worker nodes (a user's knob)"
    )

    @field_validator("rollout_endpoints", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [url.strip() for url in value.split(",") if url.strip()]
        return value


class RolloutPoolEnv(PodEnv):
    """What the operator hands a rollout replica (``posttrain serve`` / ``rollout vllm-entry``).

    >>> RolloutPoolEnv.from_env({"POSTTRAIN_WEIGHTS_POLL_SECONDS": "5"}).weights_poll_seconds
    5.0
    """

    pool_name: str | None = _env(POOL_NAME, "the RolloutPool")
    weights_uri: str | None = _env(WEIGHTS_URI, "prefix with published weights (vNNNNNNNN/)")
    weights_poll_seconds: float | None = _env(WEIGHTS_POLL_SECONDS, "poll period, 0 = never")
    cache: str | None = _env(CACHE, "where the model is fetched to (the vLLM engine's volume)")


class SandboxTaskEnv(PodEnv):
    """What the operator hands a sandbox pod: the task and, with artifacts, where they go.

    sandboxes/task_entrypoint.py reads the artifact variables (with its own copy of the names).
    """

    task: str = _env(SANDBOX_TASK, "the SandboxTask", ...)
    attempt: int = _env(SANDBOX_ATTEMPT, "the attempt, from 1", 1)
    workdir: str | None = _env(SANDBOX_WORKDIR, "the program's writable workdir")
    timeout_seconds: int | None = _env(SANDBOX_TIMEOUT, "the program's wall clock")
    logs_url: str | None = _env(SANDBOX_LOGS_URL, "presigned PUT for the log")
    snapshot_url: str | None = _env(SANDBOX_SNAPSHOT_URL, "presigned PUT for the workdir tar")
    restore_url: str | None = _env(SANDBOX_RESTORE_URL, "presigned GET of a workdir to restore")


class WarmPoolEnv(PodEnv):
    """What the operator hands a warm pool's waiting pod (operator/warm_entrypoint.py)."""

    workdir: str = _env(WARM_WORKDIR, "where the claimed task's files are written", ...)
    claim_file: str = _env(WARM_CLAIM_FILE, "the downward-API file that holds the claim", ...)
