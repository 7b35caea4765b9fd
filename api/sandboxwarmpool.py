"""SandboxWarmPool: N idle, ready sandbox pods that SandboxTasks claim instead of a cold start.

Modelled on kubernetes-sigs/agent-sandbox's SandboxWarmPool/SandboxClaim: the pool's
controller keeps ``spec.replicas`` restricted sandbox pods running a waiting entrypoint; a
SandboxTask with ``spec.warmPoolRef`` adopts one (an atomic label patch) and hands it the
program through the pod's own annotations, so a claim costs one pod patch instead of a pod
create, a schedule and a container start. ``kubectl scale sandboxwarmpool/<name>`` works
through the scale subresource.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import CONDITIONS_FIELD, ApiModel, Condition, ObjectMeta
from .sandboxtask import SandboxResources


class SandboxWarmPoolSpec(ApiModel):
    """Desired state of a SandboxWarmPool: how many idle pods, and what they look like."""

    replicas: int = Field(default=1, ge=0, le=1000)
    """Idle pods to keep ready; claimed pods leave the pool and are replaced."""
    image: str | None = Field(default=None, min_length=1)
    """Image of the pooled pods; it must have python3 (the waiting entrypoint is Python).
    Unset = the operator's sandbox image, as for SandboxTasks. A task is served from the pool
    only when the image it runs in is the same."""
    resources: SandboxResources = Field(default_factory=SandboxResources)
    """Limits of each pooled pod; a task must ask for exactly these to be served from it."""
    network: Literal["none", "egress"] = "none"
    """none: the namespace's default-deny NetworkPolicy isolates the pods; egress: outbound."""
    runtime_class_name: str | None = None
    """RuntimeClass of the pooled pods (gvisor, kata); None = the operator's default."""


class SandboxWarmPoolStatus(ApiModel):
    """Observed state of a SandboxWarmPool."""

    replicas: int = 0
    """Idle pods that exist or are being created (ready or still starting)."""
    ready_replicas: int = 0
    """Idle pods that are running and ready to be claimed."""
    claimed: int = 0
    """Pods claimed from this pool that still exist (they now belong to their task)."""
    selector: str | None = None
    """Label selector of the idle pods (for the scale subresource and HPA)."""
    observed_generation: int | None = None
    conditions: list[Condition] = CONDITIONS_FIELD


class SandboxWarmPool(ApiModel):
    """A pool of pre-created, ready sandbox pods."""

    api_version: Literal["posttrain.io/v1alpha1"] = "posttrain.io/v1alpha1"
    kind: Literal["SandboxWarmPool"] = "SandboxWarmPool"
    metadata: ObjectMeta
    spec: SandboxWarmPoolSpec = Field(default_factory=SandboxWarmPoolSpec)
    status: SandboxWarmPoolStatus = Field(default_factory=SandboxWarmPoolStatus)
