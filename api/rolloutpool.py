"""RolloutPool: a scalable set of OpenAI-compatible inference servers (vLLM in clusters)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .base import CONDITIONS_FIELD, QUANTITY, ApiModel, Condition, ObjectMeta
from .modelref import HfTokenSecret, check_hf_token_secret, check_model_ref

PoolPhase = Literal["Pending", "Ready", "Degraded", "Updating"]


class SpeculativeDecoding(ApiModel):
    """vLLM speculative decoding (passed as --speculative-config)."""

    method: Literal["ngram", "eagle", "eagle3", "medusa", "mtp", "draft_model"] = "ngram"
    """Proposal method; draft_model needs draftModel."""
    num_speculative_tokens: int = Field(default=4, ge=1, le=32)
    """Tokens proposed per step."""
    draft_model: str | None = None
    """Draft model for method=draft_model/eagle."""


class EngineArgs(ApiModel):
    """Engine settings, mapped one-to-one onto `vllm serve` flags."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs per replica the model is sharded over (--tensor-parallel-size)."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length (--max-model-len); long-context RL raises it."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across a group's shared prompt (--enable-prefix-caching)."""
    enable_chunked_prefill: bool = True
    """Interleave long prefills with decodes (--enable-chunked-prefill)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Share of GPU memory vLLM may use (--gpu-memory-utilization)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Weights/activation dtype (--dtype); a TrainingRun on this pool publishes its weights in
    it (auto: in the trainer's own dtype)."""
    speculative: SpeculativeDecoding | None = None
    """Speculative decoding; off when absent."""
    extra_args: list[str] = Field(default_factory=list)
    """Further `vllm serve` flags, passed verbatim."""


class WeightUpdatePolicy(ApiModel):
    """How new policy weights published by the trainer reach the servers: always in place
    (each replica's front door loads a version between requests; see docs/rollout.md). There
    is no strategy to choose: restarting replicas for every weight version (once per step)
    would drop their KV cache and take minutes per version."""

    source_uri: str | None = None
    """Prefix where the trainer publishes weights/vNNNNNNNN (s3://...); replicas load the latest
    before reporting ready."""
    poll_seconds: float = Field(default=5.0, gt=0)
    """How often an idle replica checks for a newer version."""


class PoolResources(ApiModel):
    """Per-replica resources."""

    gpus: int = Field(default=1, ge=0, le=16)
    """nvidia.com/gpu per replica (>= tensorParallelSize for vLLM)."""
    cpu: str = Field(default="4", pattern=QUANTITY)
    memory: str = Field(default="32Gi", pattern=QUANTITY)
    node_selector: dict[str, str] = Field(default_factory=dict)
    weights_scratch: str = Field(default="40Gi", pattern=QUANTITY)
    """engine vllm: sizeLimit of the emptyDir where a replica stages each weight update before
    vLLM loads it (one version of the weights in the trainer's publish dtype, plus the one
    being replaced while it loads). A replica that outgrows it is evicted, not the node's disk
    filled."""
    ephemeral_storage: str = Field(default="80Gi", pattern=QUANTITY)
    """engine vllm: ephemeral-storage request and limit of the server container: the model the
    fetch step puts on the /models emptyDir, the weight staging above, and logs. The scheduler
    places a replica only on a node with that much local disk free."""


class PoolAutoscaling(ApiModel):
    """Scale the pool with the demand of the TrainingRuns that sample from it.

    The signal is what a short rollout pool costs a run: the fraction of its step time the
    trainer spent blocked waiting for rollouts (``status.rolloutWait.fraction`` of each
    Running TrainingRun whose trainer reads this pool; the highest one counts). The operator
    computes ``ceil(replicas * observed / target)`` as Kubernetes' HPA does, and writes it to
    ``spec.replicas`` through the scale subresource (docs/rollout.md, "Autoscaling").
    """

    # The apiserver checks the bounds too (CEL), so kubectl apply refuses them as the
    # operator and posttrain apply do, with the same message.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
                    "message": "autoscaling.minReplicas must be <= autoscaling.maxReplicas",
                    "fieldPath": ".minReplicas",
                }
            ]
        }
    )

    min_replicas: int = Field(default=1, ge=1, le=1024)
    """Fewest replicas. At least 1: a run measures its wait only while it samples, so a pool
    at zero would never see the demand that should bring it back."""
    max_replicas: int = Field(ge=1, le=1024)
    """Most replicas (the cost ceiling); required, as for an HPA."""
    target_rollout_wait_fraction: float = Field(default=0.1, gt=0, lt=1)
    """Wanted share of a training step spent waiting for rollouts (0.1: a tenth). Lower
    buys more replicas; 0 is not allowed (the formula divides by it; a pool that never
    makes a step wait is what maxReplicas is for)."""
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """No change while observed/target is within 1 +/- tolerance (HPA's default 0.1), so
    noise around the target does not resize the pool each resync."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=86_400)
    """A scale-down happens only after every recommendation for this long asked for fewer
    replicas, and then to the highest of them (HPA's scale-down window, default 300 s):
    replicas take minutes to load a model, so a short lull must not remove them."""

    @model_validator(mode="after")
    def _check(self) -> PoolAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.minReplicas ({self.min_replicas}) must be <= "
                f"autoscaling.maxReplicas ({self.max_replicas})"
            )
        return self


class RolloutPoolSpec(ApiModel):
    """Desired state of a RolloutPool."""

    model: str = Field(min_length=1)
    """Model served at start: packaged id, s3:// URI, pvc://claim/path (the operator mounts the
    claim read-only in the replicas), hf://ORG/NAME[@REVISION] (a Hugging Face Hub repository,
    downloaded by each replica) or HF-format local path."""
    hf_token_secret: HfTokenSecret | None = None
    """The Secret holding a Hugging Face token, for a private or gated hf:// model: the step
    that downloads it gets it as HF_TOKEN. Only with an hf:// model."""
    served_model_name: str | None = None
    """Name clients use in requests; defaults to the pool name."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Server replicas (the scale subresource writes this; with ``autoscaling`` the operator
    does, through the same subresource)."""
    autoscaling: PoolAutoscaling | None = None
    """Scale on the trainers' rollout wait between min and max replicas; absent: replicas
    stay what ``spec.replicas`` says (``kubectl scale``, or an HPA on the scale
    subresource)."""
    engine: Literal["vllm", "cpu"] = "vllm"
    """vllm on GPUs; cpu is posttrain's transformers engine (same HTTP contract) for dev."""
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    """Engine settings."""
    resources: PoolResources = Field(default_factory=PoolResources)
    """Per-replica resources."""
    weight_update: WeightUpdatePolicy = Field(default_factory=WeightUpdatePolicy)
    """Weight sync from the trainer."""
    image: str | None = None
    """Server image; defaults to the operator's configured vLLM (or posttrain) image."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible API."""

    @field_validator("model")
    @classmethod
    def _check_model(cls, model: str) -> str:
        return check_model_ref(model)  # a malformed pvc:// or hf:// reference is a spec error

    @model_validator(mode="after")
    def _check(self) -> RolloutPoolSpec:
        check_hf_token_secret(self.model, self.hf_token_secret)
        return self


class ReplicaWeights(ApiModel):
    """What one ready replica serves, as its front door answered the operator."""

    pod: str
    endpoint: str
    weight_version: int | None = None
    """None when the replica did not answer ``/v1/weights/version``."""


class AutoscalingStatus(ApiModel):
    """What the operator's autoscaler saw and decided (with ``spec.autoscaling`` only)."""

    rollout_wait_fraction: float | None = None
    """The signal used at the last decision: the highest wait fraction of the runs that
    sample from the pool (unset when none reports one measured since the last scale)."""
    signal_run: str | None = None
    """The TrainingRun that reported it."""
    desired_replicas: int | None = None
    """What the last decision asked for (spec.replicas once it scaled)."""
    reason: str | None = None
    """Why, as a fixed reason (ScaledUp, ScaledDown, ScaleDownPending, WithinTolerance,
    NoSignal, ScaleInProgress, AtLimit)."""
    message: str | None = None
    """The decision in words (the formula with its numbers)."""
    last_scale_time: datetime | None = None
    """When the operator last changed spec.replicas. A run's signal counts only when every
    step it averages started after this (steps measured on the old size say nothing of
    the new one)."""
    scale_down_pending_since: datetime | None = None
    """Since when every decision asked for fewer replicas (the stabilization window's
    start); unset when none is pending."""
    scale_down_pending_replicas: int | None = None
    """The highest replica count recommended since then: what the pool scales down to when
    the window has passed."""


class RolloutPoolStatus(ApiModel):
    """Observed state of a RolloutPool."""

    phase: PoolPhase | None = None
    conditions: list[Condition] = CONDITIONS_FIELD
    observed_generation: int | None = None
    replicas: int = 0
    """Pods that exist (scale subresource statusReplicasPath)."""
    ready_replicas: int = 0
    """Pods passing /health."""
    selector: str | None = None
    """Label selector of the pool's pods (scale subresource labelSelectorPath)."""
    weight_version: int | None = None
    """Weights version every ready replica serves (the lowest of replicaWeights; unset while
    a ready replica's version is unknown)."""
    replica_weights: list[ReplicaWeights] = Field(default_factory=list)
    """Each ready replica's served weight version, asked of its front door at every
    reconcile and resync."""
    replica_endpoints: list[str] = Field(default_factory=list)
    """Base URLs of the ready replicas (pod IP + port), sorted: the trainer publishes each
    weight version to every one of them and samples from them directly."""
    endpoint: str | None = None
    """In-cluster base URL of the pool's Service."""
    autoscaling: AutoscalingStatus | None = None
    """The autoscaler's signal and last decision (with spec.autoscaling only)."""


class RolloutPool(ApiModel):
    """A pool of inference servers the trainer samples from."""

    api_version: Literal["posttrain.io/v1alpha1"] = "posttrain.io/v1alpha1"
    kind: Literal["RolloutPool"] = "RolloutPool"
    metadata: ObjectMeta
    spec: RolloutPoolSpec
    status: RolloutPoolStatus = Field(default_factory=RolloutPoolStatus)
