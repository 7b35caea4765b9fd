"""Builder for a run's separate evaluator: ``evaluation.inline: false`` → a Job ``<run>-evaluator``.

With ``inline: false`` the trainer never evaluates (with hundreds of domains a held-out
pass takes longer than a step, and every rank would wait for it); something else must
score the checkpoints, or the run's eval matrix, plots and audits stay empty. So the operator
starts ``posttrain eval-checkpoints --watch`` for the run: it scores the base model as step
0, then each checkpoint the trainer commits to the run's storage, on its own CPU rollout
server, and writes ``reports/eval/`` under the run's prefix (what ``posttrain report
s3://...`` renders), until the final checkpoint (``maxSteps``) is scored.

A Job, not a Deployment: the evaluator finishes when the last checkpoint is scored, and a
Deployment would restart it forever. Not a plain pod either: a crashed evaluator should be
restarted (``restartPolicy: OnFailure``), and a restarted one skips the steps whose results
are already in storage. It is owned by the run (deleted with it) and does not count against
the run's ``backoffLimit``: an evaluator failure never fails training. It reads the same
``<run>-config`` ConfigMap the trainer pods mount, so it scores exactly the spec's domains.
It holds no ServiceAccount token (it talks only to S3), and passes Pod Security
"restricted" as the trainer pods do (uid 10001, its own /tmp and HOME).
"""

from __future__ import annotations

import posixpath
from typing import Any

from posttrain.api import TrainingRun

from ..config import OperatorConfig
from ..shared.builders import (
    METRICS_PORT_NAME,
    WORKSPACE_HF_HOME,
    child_metadata,
    hf_model_env,
    mount_model_claim,
    otlp_env,
    resources,
    run_as_posttrain_user,
    s3_env,
    schedule,
    scrape_annotations,
)
from .names import RUN_CONFIG_PATH, run_storage_uri, trainer_names

Manifest = dict[str, Any]

COMPONENT_EVALUATOR = "evaluator"
# Restarts of a crashed evaluator before the Job gives up (each resumes where it stopped).
EVALUATOR_BACKOFF_LIMIT = 6
# How often the evaluator looks for a newly committed checkpoint.
EVALUATOR_POLL_SECONDS = 30


def needs_evaluator(run: TrainingRun) -> bool:
    """``evaluation.inline: false``: the trainer does not evaluate, the evaluator does.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> needs_evaluator(run)
    False
    >>> run.spec.evaluation.inline = False
    >>> needs_evaluator(run)
    True
    """
    return not run.spec.evaluation.inline


def evaluator_name(run: TrainingRun) -> str:
    """``<run>-evaluator``.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> evaluator_name(_example_run())
    'demo-evaluator'
    """
    return f"{run.metadata.name}-evaluator"


def evaluator_command(run: TrainingRun, config: OperatorConfig) -> list[str]:
    """``posttrain eval-checkpoints`` on the run's config and storage, watching.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> " ".join(evaluator_command(_example_run(), OperatorConfig(s3_bucket="b")))
    'posttrain eval-checkpoints /etc/posttrain/run.yaml --storage s3://b/runs/ns/demo/u-1 --out /workspace --watch --poll-seconds 30 --metrics-port 9090'
    """
    command = [
        "posttrain", "eval-checkpoints", RUN_CONFIG_PATH,
        "--storage", run_storage_uri(run, config),
        "--out", "/workspace",
        "--watch", "--poll-seconds", str(EVALUATOR_POLL_SECONDS),
    ]  # fmt: skip
    if config.pod_metrics_port:
        command += ["--metrics-port", str(config.pod_metrics_port)]
    return command


def build_evaluator_job(run: TrainingRun, config: OperatorConfig) -> Manifest:
    """The run's evaluator Job (see the module docstring for why each choice).

    Its resources are ``evaluation.resources``, else the trainer's CPU and memory per node;
    no GPU: it serves one model copy on CPU (its own rollout server) and holds one checkpoint
    at a time.
    """
    from posttrain.api.labels import LABEL_COMPONENT, LABEL_RUN

    res = run.spec.resources
    labels = {LABEL_COMPONENT: COMPONENT_EVALUATOR, LABEL_RUN: run.metadata.name}
    container: Manifest = {
        "name": "evaluator",
        "image": res.image or config.trainer_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": evaluator_command(run, config),
        "env": [
            *s3_env(config),
            *otlp_env(config, "posttrain-evaluator", run),
            # It loads the base model too: an hf:// one is downloaded onto /workspace.
            *hf_model_env(run.spec.model, WORKSPACE_HF_HOME, run.spec.hf_token_secret),
        ],
        "resources": resources(
            run.spec.evaluation.resources.cpu or res.cpu,
            run.spec.evaluation.resources.memory or res.memory,
        ),
        "volumeMounts": [
            {
                "name": "run-config",
                "mountPath": posixpath.dirname(RUN_CONFIG_PATH),
                "readOnly": True,
            },
            {"name": "workspace", "mountPath": "/workspace"},
        ],
    }
    template_meta: Manifest = {"labels": dict(labels)}
    if config.pod_metrics_port:
        container["ports"] = [{"name": METRICS_PORT_NAME, "containerPort": config.pod_metrics_port}]
        template_meta["annotations"] = scrape_annotations(config.pod_metrics_port)
    pod_spec: Manifest = {
        "restartPolicy": "OnFailure",
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [
            {"name": "run-config", "configMap": {"name": trainer_names(run)["config"]}},
            {"name": "workspace", "emptyDir": {}},
        ],
    }
    mount_model_claim(run.spec.model, pod_spec, [container])  # it scores the base model too
    run_as_posttrain_user(pod_spec)  # Pod Security "restricted", as the trainer pods
    schedule(
        pod_spec,
        config,
        config.trainer_node_selector,
        res.node_selector,
        config.trainer_tolerations,
        config.trainer_affinity,
    )
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": child_metadata(run, evaluator_name(run), labels),
        "spec": {
            "backoffLimit": EVALUATOR_BACKOFF_LIMIT,
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }


def build_evaluator_children(run: TrainingRun, config: OperatorConfig) -> list[Manifest]:
    """What ``evaluation.inline: false`` adds to the run's children (else nothing)."""
    return [build_evaluator_job(run, config)] if needs_evaluator(run) else []
