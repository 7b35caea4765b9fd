"""A TrainingRun's identity, below its builders, the evaluator and the sandbox runner: child
names, where its run.yaml is mounted, its storage prefix and resume source (plus the example
run the docstrings use).
"""

from __future__ import annotations

from posttrain.api import TrainingRun

from ..config import OperatorConfig
from ..shared.builders import BuildError

RUN_CONFIG_PATH = "/etc/posttrain/run.yaml"
RUN_CONFIG_KEY = "run.yaml"


def run_storage_uri(run: TrainingRun, config: OperatorConfig) -> str:
    """Where this TrainingRun *object* keeps its checkpoints, weights, trajectories and
    reports: spec.checkpoint.storageUri as given, else ``s3://<bucket>/runs/<ns>/<name>/<uid>``.

    Checkpoints belong to the object that wrote them (metadata.uid): a run deleted and created
    again under the same name gets a new uid, so a new directory, and starts fresh unless its
    spec.resumeFrom says otherwise, while every restart of the same object resumes. A
    storageUri the user gives is theirs to keep per run; the trainer refuses to resume, unasked,
    another object's checkpoints found there. Every run the operator reads comes from the
    apiserver, which always sets a uid.

    >>> run_storage_uri(_example_run(), OperatorConfig(s3_bucket="b"))
    's3://b/runs/ns/demo/u-1'
    """
    if run.spec.checkpoint.storage_uri:
        return run.spec.checkpoint.storage_uri
    if not run.metadata.uid:
        raise BuildError(f"TrainingRun {run.metadata.name} has no metadata.uid to key its storage")
    return f"s3://{config.s3_bucket}/runs/{run.metadata.namespace}/{run.metadata.name}/{run.metadata.uid}"


def resume_source_uri(run: TrainingRun, config: OperatorConfig) -> str | None:
    """What spec.resumeFrom names, as a storage URI the trainer reads: a checkpoint or run
    storage as given, or for ``run: NAME`` the default storage root of that name, under which
    the trainer takes the newest checkpoint of any earlier object (not its own).

    >>> from posttrain.api import ResumeFrom
    >>> run = _example_run()
    >>> run.spec.resume_from = ResumeFrom(run="older")
    >>> resume_source_uri(run, OperatorConfig(s3_bucket="b"))
    's3://b/runs/ns/older'
    """
    source = run.spec.resume_from
    if source is None:
        return None
    if source.checkpoint is not None:
        return source.checkpoint
    return f"s3://{config.s3_bucket}/runs/{run.metadata.namespace}/{source.run}"


def trainer_names(run: TrainingRun) -> dict[str, str]:
    """Names of the run's long-lived children (one of each per run)."""
    name = run.metadata.name
    return {
        "config": f"{name}-config",
        "service_account": f"{name}-trainer",
        "role": f"{name}-trainer",
        "head_service": f"{name}-head",
        "colocated_policy": f"{name}-colocated-rollout",
    }


def trainer_pod_name(run_name: str, incarnation: int, rank: int) -> str:
    """``<run>-g<incarnation>-<rank>``: a new gang never collides with a terminating one.

    >>> trainer_pod_name("demo", 2, 0)
    'demo-g2-0'
    """
    return f"{run_name}-g{incarnation}-{rank}"


def _example_run() -> TrainingRun:
    """A minimal run for doctests."""
    return TrainingRun.model_validate(
        {
            "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1"},
            "spec": {
                "model": "smollm2-135m-instruct",
                "domains": [
                    {"name": "math", "dataset": "builtin:arith", "verifier": {"kind": "numeric"}}
                ],
            },
        }
    )
