"""OperatorConfig: every knob of the operator in one validated model.

Loaded from ``POSTTRAIN_OPERATOR_*`` environment variables (what the Helm chart sets) and then
overridden by command-line flags, so a Deployment and a developer's shell configure the same
fields. Builders receive the config explicitly; nothing reads the environment twice.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from posttrain.api.env import OPERATOR_PREFIX
from posttrain.api.trainingrun import NCCL_ENV_NAME
from posttrain.errors import UsageError

ENV_PREFIX = OPERATOR_PREFIX
# The images `make images` builds and the Helm chart names by default (its appVersion is the
# tag): an operator started without the chart creates pods from the same four images.
DEFAULT_REGISTRY = "ghcr.io/posttrain"
IMAGE_TAG = "0.1.0"


class OperatorConfig(BaseModel):
    """What the operator needs to turn posttrain resources into pods (see docs/operator.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    trainer_image: str = f"{DEFAULT_REGISTRY}/trainer:{IMAGE_TAG}"
    """Image of trainer pods when a TrainingRun sets no resources.image (trainer/Dockerfile:
    posttrain[train,ray], the packaged model and benchmark data, bubblewrap)."""
    sandbox_image: str = f"{DEFAULT_REGISTRY}/sandbox:{IMAGE_TAG}"
    """Image of SandboxTask and warm-pool pods whose spec sets none (sandboxes/Dockerfile)."""
    sandbox_runner_image: str = f"{DEFAULT_REGISTRY}/sandbox:{IMAGE_TAG}"
    """Image of the sandbox runner the operator starts for runs with sandbox.mode runner and no
    runnerUrl (``posttrain sandbox serve`` with bubblewrap: sandboxes/Dockerfile)."""
    sandbox_init_image: str = f"{DEFAULT_REGISTRY}/sandbox:{IMAGE_TAG}"
    """Image whose ``cp`` (coreutils) copies task files into the writable workdir before the
    program; the sandbox image by default, so a cluster needs no image beyond the four."""
    rollout_cpu_image: str = f"{DEFAULT_REGISTRY}/trainer:{IMAGE_TAG}"
    """Image of RolloutPool replicas with engine=cpu (``posttrain serve``, in the trainer image)."""
    vllm_image: str = f"{DEFAULT_REGISTRY}/rollout:{IMAGE_TAG}"
    """Image of RolloutPool replicas with engine=vllm: vLLM plus posttrain (rollout/Dockerfile),
    whose front door ``posttrain rollout vllm-entry`` is the container command."""
    image_pull_policy: str = Field(default="IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    """imagePullPolicy of every container the operator creates."""
    image_pull_secrets: list[dict[str, str]] = Field(default_factory=list)
    """imagePullSecrets of every pod the operator creates, e.g. [{"name": "regcred"}]."""

    trainer_node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of trainer pods (a run's resources.nodeSelector is merged over it)."""
    trainer_tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of trainer pods (e.g. for tainted GPU nodes)."""
    trainer_affinity: dict[str, Any] = Field(default_factory=dict)
    """Affinity of trainer pods."""
    trainer_nccl: dict[str, str] = Field(default_factory=dict)
    """NCCL_* environment of every trainer gang pod (NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE,
    NCCL_DEBUG, ...): the cluster's network, known to the platform team, not to each run. A
    run's resources.nccl is set over it."""
    rollout_node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of rollout replicas (a pool's resources.nodeSelector is merged over it)."""
    rollout_tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of rollout replicas."""
    rollout_affinity: dict[str, Any] = Field(default_factory=dict)
    """Affinity of rollout replicas."""
    sandbox_runtime_class_name: str | None = None
    """RuntimeClass (gvisor, kata) of sandbox pods whose task sets none; None = the default."""
    log_level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    """Log level of the operator process."""

    s3_endpoint: str = ""
    """host:port of the S3 API (MinIO); passed to trainer pods as POSTTRAIN_S3_ENDPOINT."""
    s3_secure: bool = False
    """Use HTTPS for S3 (POSTTRAIN_S3_SECURE)."""
    s3_bucket: str = "posttrain"
    """Bucket for run artifacts: runs default to s3://<bucket>/runs/<namespace>/<name>."""
    s3_credentials_secret: str = "posttrain-s3"
    """Secret (in the run's namespace) with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY keys;
    trainer pods get them through secretKeyRef, never as literal values. Unused for runs and
    pools when ``s3_scoped_credentials`` is on (each gets its own Secret)."""
    s3_scoped_credentials: bool = False
    """Give each TrainingRun and RolloutPool credentials for its own prefixes only: a MinIO
    user and policy the operator creates with its own (root) credentials and revokes when the
    owner is deleted (storage/iam.py). Needs MinIO's admin API; the chart turns it on with its
    bundled MinIO. Off: pods get ``s3_credentials_secret``."""

    operator_namespace: str = ""
    """The namespace the operator's pods run in (the chart sets it): pools' NetworkPolicies
    admit the operator's pods from there. Empty (a laptop operator, not a pod): none."""
    namespaces: tuple[str, ...] = ()
    """Namespaces to watch; empty with all_namespaces=False means just ``default``."""
    all_namespaces: bool = False
    """Watch the whole cluster (needs the ClusterRole bound cluster-wide)."""
    kubeconfig: str | None = None
    """Kubeconfig file; None = in-cluster service account, else $KUBECONFIG / ~/.kube/config."""

    standalone: bool = False
    """Run without leader election (tests, a single replica): always working. Replicas > 1
    need leader election, or every one of them reconciles the same objects."""
    lease_name: str = Field(
        default="posttrain-operator", pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253
    )
    """The coordination.k8s.io Lease the replicas elect their leader on (only its holder
    works); it lives in :attr:`lease_namespace`."""
    identity: str = ""
    """This replica's name in the Lease (``holderIdentity``); must differ between replicas.
    Empty = the pod's name from ``POD_NAME`` (the chart sets it from the downward API), else
    ``<hostname>_<pid>``."""
    lease_duration_seconds: float = Field(default=15.0, gt=0)
    """How long a candidate waits, after it last saw the Lease change, before it takes over a
    holder that stopped renewing (client-go's LeaseDuration default; also the takeover time
    after a crash)."""
    lease_renew_deadline_seconds: float = Field(default=10.0, gt=0)
    """The holder stops working when it could not renew for this long (client-go's
    RenewDeadline); below the lease duration, so it stops before anyone may take over."""
    lease_retry_period_seconds: float = Field(default=2.0, gt=0)
    """How often every replica tries to acquire or renew the Lease (client-go's RetryPeriod)."""

    max_workers: int = Field(default=32, ge=1, le=512)
    """Threads of the operator's pool running the (synchronous) reconcilers and resyncs;
    also the HTTP connection pool size."""
    resync_seconds: float = Field(default=15.0, gt=0)
    """Period of the level-triggered resync (TTL expiry, deadlines, missed events)."""
    requeue_base_seconds: float = Field(default=1.0, gt=0)
    """Delay before the first retry of a failed reconcile of one object; it doubles with each
    consecutive failure of that object (1, 2, 4 ... s) and resets on success. 1 s: long
    enough for a refused write's cause (a conflict, a brief apiserver outage) to pass."""
    requeue_max_seconds: float = Field(default=60.0, gt=0)
    """Cap of that delay: a persistently failing object is retried once a minute (controller-
    runtime's per-item limiter caps at 1000 s; a minute keeps a fixed outage short)."""
    watch_server_timeout: int = Field(default=300, ge=10)
    """Seconds the apiserver keeps a watch open before the informer re-watches."""
    watch_client_timeout: int = Field(default=330, ge=10)
    """Client-side watch timeout; slightly above the server's so the server closes first."""
    request_timeout: float = Field(default=30.0, gt=0)
    """Timeout of single API requests (creates, patches)."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve Prometheus metrics on this port; 0 = off."""
    liveness_port: int = Field(default=0, ge=0, le=65535)
    """Port of the /healthz endpoint the liveness and readiness probes read (health.py, on
    the operator's event loop); 0 = off."""

    pod_metrics_port: int = Field(default=9090, ge=0, le=65535)
    """Port trainer pods (rank 0) serve Prometheus /metrics on, as container port "metrics"
    with prometheus.io/* annotations (rollout pods serve it on their API port); 0 = off."""
    otlp_endpoint: str = ""
    """OTLP endpoint (e.g. http://otel-collector.monitoring:4318) handed to trainer and rollout
    pods as OTEL_EXPORTER_OTLP_ENDPOINT, so their spans reach the same collector as the
    operator's; empty = none (spans stay in process)."""
    trainer_master_port: int = Field(default=29500, ge=1, le=65535)
    """torch.distributed MASTER_PORT of trainer gangs."""
    ray_port: int = Field(default=6379, ge=1, le=65535)
    """Ray GCS port of the head pod when nodes > 1."""
    kuberay: bool = True
    """Run multi-node TrainingRuns as a KubeRay RayCluster when the rayclusters.ray.io CRD is
    installed (checked through API discovery); False = always plain head + worker pods."""
    kuberay_discovery_seconds: float = Field(default=60.0, gt=0)
    """How long the answer "is KubeRay installed?" is cached before discovery is asked again."""
    kueue: bool = True
    """Admit TrainingRuns labelled kueue.x-k8s.io/queue-name through Kueue (a Workload per run,
    pods only once it is admitted) when Kueue's workloads.kueue.x-k8s.io/v1beta2 is served;
    False = ignore the label and start runs at once."""
    kueue_discovery_seconds: float = Field(default=60.0, gt=0)
    """How long the answer "is Kueue installed?" is cached before discovery is asked again."""
    shm_size: str = "8Gi"
    """sizeLimit of the /dev/shm memory emptyDir in trainer pods (NCCL, dataloaders)."""
    sandbox_workdir_size: str = "256Mi"
    """sizeLimit of the writable /workspace emptyDir of sandbox pods."""
    sandbox_artifacts_uri: str = Field(
        default="", pattern=r"^(s3://[a-z0-9][a-z0-9.-]+[a-z0-9](/.*)?)?$"
    )
    """s3://bucket/prefix where sandbox pods store their full log (status.logsUri) and, with
    spec.snapshot, a workdir tar (status.snapshotUri), through presigned URLs the operator
    signs with its own S3 credentials (POSTTRAIN_S3_* / AWS_* in its environment). Empty =
    off: no logsUri, and tasks asking for snapshot or restoreFrom fail as InvalidSpec."""
    sandbox_artifacts_egress: list[dict[str, Any]] = Field(default_factory=list)
    """NetworkPolicy egress rules added to the sandbox default-deny policy so sandbox pods can
    reach the object store and DNS (presigned URLs name the store by host) and nothing else,
    e.g. [{"to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app":
    "kube-dns"}}}], "ports": [{"port": 53, "protocol": "UDP"}]}, {"to": [{"ipBlock": {"cidr":
    "10.0.12.0/24"}}], "ports": [{"port": 9000}]}]. The chart derives them from its storage
    settings."""
    sandbox_upload_grace_seconds: int = Field(default=30, ge=1, le=3600)
    """Added to a storing pod's activeDeadlineSeconds: the program keeps its full
    timeoutSeconds and the entrypoint still has this long to upload after a timeout."""

    @field_validator("namespaces", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(ns for ns in (v.strip() for v in value.split(",")) if ns)
        return value

    @field_validator(
        "image_pull_secrets",
        "trainer_node_selector",
        "trainer_tolerations",
        "trainer_affinity",
        "trainer_nccl",
        "rollout_node_selector",
        "rollout_tolerations",
        "rollout_affinity",
        "sandbox_artifacts_egress",
        mode="before",
    )
    @classmethod
    def _json(cls, value: Any, info: ValidationInfo) -> Any:
        """Structured fields arrive from the environment as JSON ("null" = unset)."""
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except ValueError as exc:
                raise ValueError(f"{info.field_name} must be JSON, got {value!r}") from exc
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    @field_validator("trainer_nccl")
    @classmethod
    def _nccl_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in value if not NCCL_ENV_NAME.fullmatch(k))
        if bad:
            raise ValueError(f"trainer_nccl accepts only NCCL_* variable names, got {bad}")
        return value

    @field_validator("sandbox_runtime_class_name", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return value or None

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _lease_timings(self) -> OperatorConfig:
        if not (
            self.lease_retry_period_seconds
            < self.lease_renew_deadline_seconds
            < self.lease_duration_seconds
        ):
            raise ValueError(
                "leader election needs lease_retry_period_seconds < "
                "lease_renew_deadline_seconds < lease_duration_seconds, got "
                f"{self.lease_retry_period_seconds} / {self.lease_renew_deadline_seconds} / "
                f"{self.lease_duration_seconds}"
            )
        return self

    @property
    def lease_namespace(self) -> str:
        """Where the Lease lives: the operator's own namespace (the chart grants leases only
        there), else, for an operator outside the cluster, the first watched namespace
        (``default`` cluster-wide)."""
        return self.operator_namespace or (self.watched_namespaces or ("default",))[0]

    @property
    def lease_identity(self) -> str:
        """:attr:`identity`, else ``POD_NAME``, else ``<hostname>_<pid>``."""
        return (
            self.identity
            or os.environ.get("POD_NAME", "")
            or f"{socket.gethostname()}_{os.getpid()}"
        )

    @property
    def watched_namespaces(self) -> tuple[str, ...]:
        """Namespaces the informers watch (empty tuple = cluster-wide)."""
        if self.all_namespaces:
            return ()
        return self.namespaces or ("default",)


def load_config(env: Mapping[str, str] | None = None, **overrides: Any) -> OperatorConfig:
    """Build the config from ``POSTTRAIN_OPERATOR_<FIELD>`` variables, then ``overrides``.

    Overrides that are None are ignored, so argparse defaults do not mask the environment.

    >>> load_config({"POSTTRAIN_OPERATOR_NAMESPACES": "a,b"}, standalone=True).namespaces
    ('a', 'b')
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for name in OperatorConfig.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = env[key]
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return OperatorConfig(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise UsageError(
            f"invalid operator configuration ({problems}); fix the flag or the "
            f"{ENV_PREFIX}<FIELD> environment variable"
        ) from exc
