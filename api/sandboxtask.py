"""SandboxTask: run untrusted model output in an isolated pod and score it."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .base import (
    CONDITIONS_FIELD,
    DNS_LABEL,
    QUANTITY,
    ApiModel,
    Condition,
    ObjectMeta,
)

TaskPhase = Literal["Pending", "Running", "Succeeded", "Failed"]


class SandboxResources(ApiModel):
    """Limits of the sandbox pod (requests = limits: sandboxes are Guaranteed QoS)."""

    cpu: str = Field(default="1", pattern=QUANTITY)
    memory: str = Field(default="512Mi", pattern=QUANTITY)
    ephemeral_storage: str = Field(default="1Gi", pattern=QUANTITY)
    """Caps what the program can write to disk."""


class SandboxTaskSpec(ApiModel):
    """Desired state of a SandboxTask."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.command) && size(self.command) > 0) || "
                    "(has(self.files) && size(self.files) > 0)",
                    "message": "one of command or files is required",
                }
            ]
        }
    )

    image: str | None = Field(default=None, min_length=1)
    """Container image the untrusted program runs in; unset = the operator's sandbox image (the
    chart's ``images.sandbox``: Python 3.11 and bubblewrap, sandboxes/Dockerfile)."""
    command: list[str] = Field(default_factory=list, max_length=256)
    """Entrypoint and arguments; with files only, defaults to running main.py."""
    files: dict[str, str] = Field(default_factory=dict)
    """Files written into the writable workdir before the command runs (name -> content)."""
    stdin: str | None = None
    """Text piped to the command."""
    timeout_seconds: int = Field(default=60, ge=1, le=86400)
    """Wall-clock deadline per attempt (pod activeDeadlineSeconds)."""
    resources: SandboxResources = Field(default_factory=SandboxResources)
    network: Literal["none", "egress"] = "none"
    """none: a default-deny NetworkPolicy isolates the pod; egress allows outbound traffic."""
    retries: int = Field(default=0, ge=0, le=10)
    """Attempts after the first when the sandbox itself fails (not when the program fails)."""
    snapshot: bool = False
    """Tar the workdir to object storage after the run (status.snapshotUri), for replay and
    rollback."""
    restore_from: str | None = Field(
        default=None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/.+", max_length=1024
    )
    """s3:// URI of a workdir snapshot (another task's status.snapshotUri) unpacked into the
    workdir before the program starts (spec.files are written over it): failure replay."""
    runtime_class_name: str | None = None
    """RuntimeClass for stronger isolation (gvisor, kata)."""
    warm_pool_ref: str | None = Field(default=None, pattern=DNS_LABEL, max_length=63)
    """Name of a SandboxWarmPool in this namespace: the first attempt claims one of its idle
    ready pods when the pool's image, resources, network and runtimeClassName equal this
    task's; otherwise (pool empty, missing or different) a cold pod is created."""
    ttl_seconds_after_finished: int | None = Field(default=3600, ge=0)
    """Delete the finished task (and its pod) after this long; absent = keep."""

    @model_validator(mode="after")
    def _check(self) -> SandboxTaskSpec:
        if not self.command and not self.files:
            raise ValueError("one of command or files is required")
        return self


class SandboxTaskStatus(ApiModel):
    """Observed state of a SandboxTask."""

    phase: TaskPhase | None = None
    conditions: list[Condition] = CONDITIONS_FIELD
    observed_generation: int | None = None
    attempts: int = 0
    """Pods created so far (1 + retries used)."""
    pod_name: str | None = None
    exit_code: int | None = None
    reward: float | None = None
    """The ``reward`` of the JSON result the program wrote to /dev/termination-log; without
    one, 1 when it exited 0 and 0 otherwise."""
    duration_ms: float | None = None
    logs_uri: str | None = None
    """Where stdout/stderr were stored (s3://...)."""
    snapshot_uri: str | None = None
    """Where the workdir tar was stored when spec.snapshot (s3://...); restoreFrom takes it."""
    reason: str | None = None
    """Why the sandbox ended: Completed, Timeout, OOMKilled, Error, ..."""
    warm_pool: str | None = None
    """The SandboxWarmPool whose idle pod ran this task; absent = a cold pod."""
    start_time: datetime | None = None
    completion_time: datetime | None = None


class SandboxTask(ApiModel):
    """One isolated execution of untrusted output."""

    api_version: Literal["posttrain.io/v1alpha1"] = "posttrain.io/v1alpha1"
    kind: Literal["SandboxTask"] = "SandboxTask"
    metadata: ObjectMeta
    spec: SandboxTaskSpec
    status: SandboxTaskStatus = Field(default_factory=SandboxTaskStatus)
