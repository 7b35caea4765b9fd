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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Imported on first use (PEP 562): `posttrain.api.env` (names only) is imported by command
# lines whose --help must not load pydantic and every model with it.
_LAZY = {
    "API_VERSION": "base",
    "AlgorithmSpec": "trainingrun",
    "ApiModel": "base",
    "AuditSpec": "trainingrun",
    "CheckpointPolicy": "trainingrun",
    "Condition": "base",
    "CurriculumSpec": "trainingrun",
    "DomainSpec": "trainingrun",
    "EngineArgs": "rolloutpool",
    "EnvironmentSpec": "trainingrun",
    "EvaluationSpec": "trainingrun",
    "ResumeFrom": "trainingrun",
    "GROUP": "base",
    "JudgeSpec": "verifier",
    "ModelEndpoint": "verifier",
    "ObjectMeta": "base",
    "RewardModelSpec": "verifier",
    "RolloutPool": "rolloutpool",
    "RolloutPoolSpec": "rolloutpool",
    "RolloutPoolStatus": "rolloutpool",
    "RolloutSource": "trainingrun",
    "SandboxHealth": "trainingrun",
    "SandboxPolicy": "trainingrun",
    "SandboxTask": "sandboxtask",
    "SandboxTaskSpec": "sandboxtask",
    "SandboxTaskStatus": "sandboxtask",
    "SandboxWarmPool": "sandboxwarmpool",
    "SandboxWarmPoolSpec": "sandboxwarmpool",
    "SandboxWarmPoolStatus": "sandboxwarmpool",
    "SecretKeyRef": "verifier",
    "StageSpec": "trainingrun",
    "StageStatus": "trainingrun",
    "TrainerResources": "trainingrun",
    "TrainingRun": "trainingrun",
    "TrainingRunSpec": "trainingrun",
    "TrainingRunStatus": "trainingrun",
    "VERSION": "base",
    "VerifierSpec": "verifier",
    "load_manifest": "manifests",
    "load_manifests": "manifests",
    "parse_resource": "manifests",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


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
