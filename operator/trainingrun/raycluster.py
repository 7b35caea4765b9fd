"""Pure builder of a TrainingRun's gang on KubeRay: one ``ray.io/v1`` RayCluster per
incarnation whose head and worker templates are the plain trainer pods (docs/operator.md,
"Multi-node with KubeRay").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from posttrain.api import TrainingRun
from posttrain.api.env import NODE_RANK, RANK
from posttrain.api.labels import (
    COMPONENT_TRAINER,
    LABEL_COMPONENT,
    LABEL_GANG,
    LABEL_RANK,
    LABEL_RUN,
)

from ..config import OperatorConfig
from ..shared.builders import BuildError, Manifest, child_metadata
from .builders import build_trainer_pod, pool_client_labels

RAY_API_VERSION = "ray.io/v1"
RAY_CLUSTER_PLURAL = "rayclusters"


# KubeRay leaves container commands alone with this annotation (it still exports its own
# `ray start` line as KUBERAY_GEN_RAY_START_CMD): ours starts Ray and then the trainer.
RAY_OVERWRITE_CMD_ANNOTATION = "ray.io/overwrite-container-cmd"
RAY_WORKER_GROUP = "workers"


# KubeRay labels every pod it creates with its node type (head / worker).
RAY_NODE_TYPE_LABEL = "ray.io/node-type"


# Workers pin their raylet to this port so a tcpSocket probe can check it.
RAY_WORKER_RAYLET_PORT = 6380


# On the head pod (rank 0): KubeRay deletes a pod of restartPolicy Never as soon as its Ray
# container has terminated, exit 0 included ("unable to restart due to its restart policy"),
# and replaces it; rank 0's exit is how the operator learns that the run succeeded or
# failed. This finalizer keeps the deleted head readable until the operator has seen its
# terminal phase (the Job controller's pod-tracking finalizer, for the same reason); the
# reconciler removes it (TrainingRunReconciler._release_heads).
HEAD_OUTCOME_FINALIZER = "posttrain.io/trainer-outcome"


def _ray_probes(port: int) -> dict[str, Any]:
    """readiness + liveness as tcpSocket checks of a Ray port.

    Ours on purpose: KubeRay injects probes only into containers without any, and its probes
    query the Ray dashboard agent, which the trainer image's plain ``ray`` (not
    ``ray[default]``) does not run; with restartPolicy Never a failing liveness probe would
    turn into a gang restart.
    """
    check = {"tcpSocket": {"port": port}}
    return {
        "readinessProbe": {**check, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {
            **check,
            "initialDelaySeconds": 30,
            "periodSeconds": 10,
            "failureThreshold": 12,
        },
    }


def ray_cluster_name(run_name: str, incarnation: int) -> str:
    """``<run>-g<incarnation>``: a recreated cluster never collides with a terminating one.

    >>> ray_cluster_name("demo", 3)
    'demo-g3'
    """
    return f"{run_name}-g{incarnation}"


def ray_head_host(run: TrainingRun, incarnation: int) -> str:
    """DNS name of the head Service KubeRay creates for the cluster (``<cluster>-head-svc``).

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> ray_head_host(_example_run(), 1)
    'demo-g1-head-svc.ns.svc'
    """
    cluster = ray_cluster_name(run.metadata.name, incarnation)
    return f"{cluster}-head-svc.{run.metadata.namespace}.svc"


def _pod_template(pod: Manifest, drop_env: tuple[str, ...] = ()) -> Manifest:
    """A trainer pod manifest turned into a RayCluster group template.

    Labels stay (KubeRay copies them onto the pods, so the operator's pod watch sees them);
    name, owner and the headless-Service hostname go (KubeRay names and owns its pods).
    """
    spec = json.loads(json.dumps(pod["spec"]))  # deep copy
    spec.pop("hostname", None)
    spec.pop("subdomain", None)
    container = spec["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] not in drop_env]
    metadata: dict[str, Any] = {"labels": dict(pod["metadata"]["labels"])}
    if pod["metadata"].get("annotations"):
        metadata["annotations"] = dict(pod["metadata"]["annotations"])
    return {"metadata": metadata, "spec": spec}


def build_ray_cluster(
    run: TrainingRun,
    config: OperatorConfig,
    incarnation: int,
    rollout_endpoints: Sequence[str] = (),
    rollout_dtype: str | None = None,
) -> Manifest:
    """One KubeRay RayCluster for a multi-node gang: a head group that runs Ray's GCS and then
    the trainer, and one worker group of ``nodes - 1`` Ray workers.

    The pods are today's trainer pods (image, env, S3 secret refs, resources, GPUs, /dev/shm,
    run.yaml, ServiceAccount, placement, restartPolicy Never), so the two paths differ only in
    who creates the pods. Workers share one template, so they carry no per-pod RANK: Ray
    assigns ranks to the trainer's actors. Autoscaling is off: a gang has a fixed size.
    """
    nodes = run.spec.resources.nodes
    if nodes < 2:
        raise BuildError(f"a RayCluster is only built for nodes > 1, got nodes={nodes}")
    host = ray_head_host(run, incarnation)
    head_pod = build_trainer_pod(
        run, config, incarnation, 0, rollout_endpoints, head_host=host, rollout_dtype=rollout_dtype
    )
    worker_pod = build_trainer_pod(
        run, config, incarnation, 1, rollout_endpoints, head_host=host, rollout_dtype=rollout_dtype
    )
    head = _pod_template(head_pod)
    head["metadata"]["finalizers"] = [HEAD_OUTCOME_FINALIZER]
    # KubeRay's head Service exposes the head container's ports: GCS and torch.distributed.
    head["spec"]["containers"][0]["ports"] = [
        {"name": "gcs-server", "containerPort": config.ray_port},
        {"name": "dist", "containerPort": config.trainer_master_port},
        *head_pod["spec"]["containers"][0].get("ports", []),  # the trainer's /metrics
    ]
    head["spec"]["containers"][0].update(_ray_probes(config.ray_port))
    worker = _pod_template(worker_pod, drop_env=(RANK, NODE_RANK))
    worker["metadata"]["labels"].pop(LABEL_RANK, None)
    worker_container = worker["spec"]["containers"][0]
    worker_container["command"] = [
        *worker_container["command"],
        f"--node-manager-port={RAY_WORKER_RAYLET_PORT}",
    ]
    worker_container.update(_ray_probes(RAY_WORKER_RAYLET_PORT))
    workers = nodes - 1
    labels = {
        LABEL_COMPONENT: COMPONENT_TRAINER,
        LABEL_RUN: run.metadata.name,
        LABEL_GANG: str(incarnation),
        **pool_client_labels(run),
    }
    return {
        "apiVersion": RAY_API_VERSION,
        "kind": "RayCluster",
        "metadata": child_metadata(
            run,
            ray_cluster_name(run.metadata.name, incarnation),
            labels,
            annotations={RAY_OVERWRITE_CMD_ANNOTATION: "true"},
        ),
        "spec": {
            "enableInTreeAutoscaling": False,
            "headGroupSpec": {"rayStartParams": {}, "template": head},
            "workerGroupSpecs": [
                {
                    "groupName": RAY_WORKER_GROUP,
                    "replicas": workers,
                    "minReplicas": workers,
                    "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": worker,
                }
            ],
        },
    }
