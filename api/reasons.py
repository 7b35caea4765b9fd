"""Condition types, phases and reason constants: the fixed vocabulary of status conditions.

Reasons are CamelCase constants (metav1.Condition grammar) that machines switch on and that
appear as Kubernetes Event reasons, so they live in one module and are never built from
strings at the call site. Beside the Condition model (base.py): the operator writes them,
clients (``posttrain get/describe``, dashboards) switch on them.
"""

from __future__ import annotations

from typing import Final


class ConditionType:
    """Condition types the operator writes."""

    READY: Final = "Ready"
    SUSPENDED: Final = "Suspended"
    SUCCEEDED: Final = "Succeeded"
    FAILED: Final = "Failed"
    SANDBOX_AVAILABLE: Final = "SandboxAvailable"
    """TrainingRun: whether the trainer's sandbox performs executions (from status.sandbox)."""
    ROLLOUT_AVAILABLE: Final = "RolloutAvailable"
    """TrainingRun: whether the trainer found a ready replica of its pool (status.rollout)."""


class Reason:
    """Condition and Event reasons, shared by all three kinds."""

    # TrainingRun
    PODS_CREATED: Final = "PodsCreated"
    PODS_PENDING: Final = "PodsPending"
    RUNNING: Final = "Running"
    SUSPENDED: Final = "Suspended"
    RESUMED: Final = "Resumed"
    NOT_SUSPENDED: Final = "NotSuspended"
    GANG_RESTART: Final = "GangRestart"
    BACKOFF_LIMIT_EXCEEDED: Final = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED: Final = "DeadlineExceeded"
    TRAINER_SUCCEEDED: Final = "TrainerSucceeded"
    STORAGE_DELETED: Final = "StorageDeleted"
    # TrainingRun and RolloutPool: scoped storage credentials could not be minted (retried).
    STORAGE_CREDENTIALS_FAILED: Final = "StorageCredentialsFailed"
    STORAGE_KEPT: Final = "StorageKept"
    RAY_CLUSTER_CREATED: Final = "RayClusterCreated"
    RAY_CLUSTER_PENDING: Final = "RayClusterPending"
    SANDBOX_WORKING: Final = "SandboxWorking"
    SANDBOX_UNAVAILABLE: Final = "SandboxUnavailable"
    WAITING_FOR_ADMISSION: Final = "WaitingForAdmission"  # Kueue has not admitted the Workload
    ADMITTED: Final = "Admitted"
    EVICTED: Final = "Evicted"  # Kueue took the admission back (preemption, deactivation)
    MANAGED_ELSEWHERE: Final = "ManagedElsewhere"  # spec.managedBy names another controller
    # rollout.colocated names a RolloutPool that does not exist (retried until it does).
    ROLLOUT_POOL_NOT_FOUND: Final = "RolloutPoolNotFound"
    # RolloutPool
    DEPLOYMENT_CREATED: Final = "DeploymentCreated"
    DEPLOYMENT_UPDATED: Final = "DeploymentUpdated"
    REPLICAS_READY: Final = "ReplicasReady"
    REPLICAS_UNAVAILABLE: Final = "ReplicasUnavailable"
    ROLLING_UPDATE: Final = "RollingUpdate"
    SCALED_TO_ZERO: Final = "ScaledToZero"
    # A pool replica's init step could not fetch spec.model (the message names the URI).
    NO_READY_REPLICA: Final = "NoReadyReplica"  # the trainer waits for its RolloutPool
    MODEL_UNAVAILABLE: Final = "ModelUnavailable"
    # A pool replica's server keeps exiting (the message has its last words).
    REPLICA_CRASH_LOOP: Final = "ReplicaCrashLooping"
    # RolloutPool autoscaling decisions (status.autoscaling.reason; Events for the first three)
    SCALED_UP: Final = "ScaledUp"
    SCALED_DOWN: Final = "ScaledDown"
    SCALE_DOWN_PENDING: Final = "ScaleDownPending"
    WITHIN_TOLERANCE: Final = "WithinTolerance"
    NO_SIGNAL: Final = "NoSignal"
    SCALE_IN_PROGRESS: Final = "ScaleInProgress"
    AT_LIMIT: Final = "AtLimit"
    # SandboxTask
    POD_RUNNING: Final = "PodRunning"
    COMPLETED: Final = "Completed"
    PROGRAM_FAILED: Final = "ProgramFailed"
    SANDBOX_RETRY: Final = "SandboxRetry"
    SANDBOX_FAILED: Final = "SandboxFailed"
    TTL_EXPIRED: Final = "TTLExpired"
    WARM_POOL_NOT_FOUND: Final = "WarmPoolNotFound"
    WARM_POOL_MISMATCH: Final = "WarmPoolMismatch"
    # SandboxWarmPool
    WARM_PODS_CREATED: Final = "WarmPodsCreated"
    WARM_PODS_DELETED: Final = "WarmPodsDeleted"
    WARM_POOL_READY: Final = "IdlePodsReady"
    WARM_POOL_FILLING: Final = "IdlePodsStarting"
    # Any kind
    INVALID_SPEC: Final = "InvalidSpec"
    RECONCILE_ERROR: Final = "ReconcileError"


class SandboxExitReason:
    """Values of SandboxTask status.reason (why the program ended)."""

    COMPLETED: Final = "Completed"
    ERROR: Final = "Error"
    TIMEOUT: Final = "Timeout"
    OOM_KILLED: Final = "OOMKilled"
    SANDBOX_FAILED: Final = "SandboxFailed"
