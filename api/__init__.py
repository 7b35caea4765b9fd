"""posttrain's API types (group posttrain.io, version v1alpha1).

Depends on pydantic only (plus yaml for manifests), so every component imports it
and none imports another's internals. The CRDs in crds/ are generated from here.
"""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.api (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.api":
    raise ImportError(
        f"import posttrain.api, not {__name__}: the top-level folders are posttrain's components"
    )

from .base import API_VERSION, GROUP, VERSION, ApiModel, Condition, ObjectMeta
from .manifests import load_manifest, load_manifests, parse_resource
from .rolloutpool import EngineArgs, RolloutPool, RolloutPoolSpec, RolloutPoolStatus
from .sandboxtask import SandboxTask, SandboxTaskSpec, SandboxTaskStatus
from .sandboxwarmpool import SandboxWarmPool, SandboxWarmPoolSpec, SandboxWarmPoolStatus
from .trainingrun import (
    AlgorithmSpec,
    AuditSpec,
    CheckpointPolicy,
    CurriculumSpec,
    DomainSpec,
    EnvironmentSpec,
    EvaluationSpec,
    ResumeFrom,
    RolloutSource,
    SandboxHealth,
    SandboxPolicy,
    StageSpec,
    StageStatus,
    TrainerResources,
    TrainingRun,
    TrainingRunSpec,
    TrainingRunStatus,
)
from .verifier import JudgeSpec, ModelEndpoint, RewardModelSpec, SecretKeyRef, VerifierSpec

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "AlgorithmSpec",
    "ApiModel",
    "AuditSpec",
    "CheckpointPolicy",
    "Condition",
    "CurriculumSpec",
    "DomainSpec",
    "EngineArgs",
    "EnvironmentSpec",
    "EvaluationSpec",
    "JudgeSpec",
    "ModelEndpoint",
    "ObjectMeta",
    "ResumeFrom",
    "RewardModelSpec",
    "RolloutPool",
    "RolloutPoolSpec",
    "RolloutPoolStatus",
    "RolloutSource",
    "SandboxHealth",
    "SandboxPolicy",
    "SandboxTask",
    "SandboxTaskSpec",
    "SandboxTaskStatus",
    "SandboxWarmPool",
    "SandboxWarmPoolSpec",
    "SandboxWarmPoolStatus",
    "SecretKeyRef",
    "StageSpec",
    "StageStatus",
    "TrainerResources",
    "TrainingRun",
    "TrainingRunSpec",
    "TrainingRunStatus",
    "VerifierSpec",
    "load_manifest",
    "load_manifests",
    "parse_resource",
]
