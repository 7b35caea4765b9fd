"""The operator -> pod contract: every environment variable one side writes and the other reads.

The operator writes a pod's environment from one of the models below (``model.to_env()``);
the process in the pod parses it once at its entry point (``Model.from_env()``) and passes the
typed model down. A name changed on one side only would fail silently at run time, so the
names live here, once: no other module of posttrain spells a ``POSTTRAIN_`` name
(tests/test_env_contract.py enforces it). The two stdlib-only entrypoints the operator ships
as source into foreign images (``sandboxes/task_entrypoint.py``,
``operator/warmpool/entrypoint.py``) cannot import this module; a test keeps their copies equal.

Torch's and Ray's own names (``MASTER_ADDR``, ``MASTER_PORT``, ``RAY_ADDRESS``) are in the
trainer's model too: the operator writes them and the trainer reads them, so they are part of
the same contract even though the libraries read them as well.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from posttrain.errors import UsageError

from .envnames import (
    BIN_DIR,
    CACHE,
    DEV_DIR,
    GANG,
    MASTER_ADDR,
    MASTER_PORT,
    NODE_RANK,
    NODES,
    NUM_THREADS,
    OPERATOR_KUBECONFIG,
    OPERATOR_PREFIX,
    OPERATOR_S3_ENDPOINT,
    OPERATOR_SANDBOX_ARTIFACTS_URI,
    POOL_NAME,
    RANK,
    RAY_ADDRESS,
    RAY_NODE_WAIT_S,
    RENDEZVOUS_TIMEOUT_S,
    ROLLOUT_DTYPE,
    ROLLOUT_ENDPOINTS,
    ROLLOUT_POOL,
    RUN_NAME,
    RUN_NAMESPACE,
    RUN_UID,
    S3_CA_BUNDLE,
    S3_CREDENTIAL_KEYS,
    S3_CREDENTIALS_DIR,
    S3_ENDPOINT,
    S3_REGION,
    S3_SECURE,
    SANDBOX_ATTEMPT,
    SANDBOX_LOG_LIMIT,
    SANDBOX_LOGS_URL,
    SANDBOX_RESTORE_URL,
    SANDBOX_RESULT_PATH,
    SANDBOX_RUNNER_URL,
    SANDBOX_SNAPSHOT_URL,
    SANDBOX_TASK,
    SANDBOX_TIMEOUT,
    SANDBOX_WORKDIR,
    VLLM_PYTHON,
    WARM_CLAIM_FILE,
    WARM_WORKDIR,
    WEIGHTS_POLL_SECONDS,
    WEIGHTS_SCRATCH,
    WEIGHTS_TOKEN,
    WEIGHTS_URI,
    WORLD_SIZE,
)

# The names, re-exported beside the models that write and parse them.
__all__ = [
    "BIN_DIR",
    "CACHE",
    "DEV_DIR",
    "GANG",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODES",
    "NODE_RANK",
    "NUM_THREADS",
    "OPERATOR_KUBECONFIG",
    "OPERATOR_PREFIX",
    "OPERATOR_S3_ENDPOINT",
    "OPERATOR_SANDBOX_ARTIFACTS_URI",
    "POOL_NAME",
    "RANK",
    "RAY_ADDRESS",
    "RAY_NODE_WAIT_S",
    "RENDEZVOUS_TIMEOUT_S",
    "ROLLOUT_DTYPE",
    "ROLLOUT_ENDPOINTS",
    "ROLLOUT_POOL",
    "RUN_NAME",
    "RUN_NAMESPACE",
    "RUN_UID",
    "S3_CA_BUNDLE",
    "S3_CREDENTIALS_DIR",
    "S3_CREDENTIAL_KEYS",
    "S3_ENDPOINT",
    "S3_REGION",
    "S3_SECURE",
    "SANDBOX_ATTEMPT",
    "SANDBOX_LOGS_URL",
    "SANDBOX_LOG_LIMIT",
    "SANDBOX_RESTORE_URL",
    "SANDBOX_RESULT_PATH",
    "SANDBOX_RUNNER_URL",
    "SANDBOX_SNAPSHOT_URL",
    "SANDBOX_TASK",
    "SANDBOX_TIMEOUT",
    "SANDBOX_WORKDIR",
    "VLLM_PYTHON",
    "WARM_CLAIM_FILE",
    "WARM_WORKDIR",
    "WEIGHTS_POLL_SECONDS",
    "WEIGHTS_SCRATCH",
    "WEIGHTS_TOKEN",
    "WEIGHTS_URI",
    "WORLD_SIZE",
    "PodEnv",
    "RolloutPoolEnv",
    "SandboxTaskEnv",
    "TrainerEnv",
    "WarmPoolEnv",
]


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
        ROLLOUT_ENDPOINTS,
        "the resolved pool's Service URL(s), a fallback for discovery; with "
        "rollout.colocated the sidecars' 127.0.0.1 URLs",
        [],
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
    cache: str | None = _env(CACHE, "where the model is fetched to (the pod's model volume)")


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
    """What the operator hands a warm pool's waiting pod (operator/warmpool/entrypoint.py)."""

    workdir: str = _env(WARM_WORKDIR, "where the claimed task's files are written", ...)
    claim_file: str = _env(WARM_CLAIM_FILE, "the downward-API file that holds the claim", ...)
