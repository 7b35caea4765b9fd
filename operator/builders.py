"""Pure builders: posttrain resources + OperatorConfig -> the child objects' manifests (dicts).

Nothing here talks to the apiserver, so unit tests (and ``kubectl apply --dry-run``) can check
every field of every child. Names are deterministic (``<task>-<attempt>``,
``<run>-g<incarnation>-<rank>``) so a restarted operator adopts what it already created
instead of duplicating it.
"""

from __future__ import annotations

import json
import math
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from posttrain.api import GROUP, RolloutPool, SandboxTask, TrainingRun, TrainingRunSpec
from posttrain.api.env import (
    NODE_RANK,
    RANK,
    S3_CREDENTIAL_KEYS,
    S3_ENDPOINT,
    S3_SECURE,
    WEIGHTS_SCRATCH,
    WEIGHTS_TOKEN,
    RolloutPoolEnv,
    SandboxTaskEnv,
    TrainerEnv,
)
from posttrain.api.labels import (
    ANNOTATION_FILE_PREFIX,
    ANNOTATION_LOGS_URI,
    ANNOTATION_SNAPSHOT_URI,
    ANNOTATION_SPEC_HASH,
    COMPONENT_ROLLOUT,
    COMPONENT_SANDBOX,
    COMPONENT_TRAINER,
    LABEL_ATTEMPT,
    LABEL_COMPONENT,
    LABEL_GANG,
    LABEL_POOL,
    LABEL_RANK,
    LABEL_RUN,
    LABEL_SANDBOX_NETWORK,
    LABEL_TASK,
    MANAGED_BY,
    POOL_CLIENT_PREFIX,
)
from posttrain.api.modelref import PVC_MODEL_VOLUME, HfTokenSecret, is_hf_ref, parse_pvc_ref

from . import sandbox_runner

# BuildError is what every builder raises; its callers catch it as builders.BuildError.
from .common import BuildError as BuildError
from .common import (
    apply_sandbox_runtime,
    child_metadata,
    resources,
    schedule,
    spec_hash,
)
from .config import OperatorConfig

Manifest = dict[str, Any]

RUN_CONFIG_PATH = "/etc/posttrain/run.yaml"
RUN_CONFIG_KEY = "run.yaml"
SANDBOX_WORKDIR = "/workspace"
SANDBOX_FILES_DIR = "/sandbox/files"
SANDBOX_STDIN_FILE = ".stdin"
SANDBOX_NETWORK_POLICY = "posttrain-sandbox-default-deny"
SANDBOX_ENTRYPOINT_DIR = "/sandbox/entrypoint"
SANDBOX_ENTRYPOINT_KEY = "entrypoint.py"
NOBODY_UID = 65534


# ---------------------------------------------------------------- TrainingRun


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


def mount_model_claim(model: str, pod_spec: Manifest, containers: Sequence[Manifest]) -> None:
    """``model`` = ``pvc://CLAIM/PATH``: the claim, read-only, at ``/mnt/pvc/CLAIM`` in each of
    ``containers`` (those that resolve the model; ``posttrain.models`` reads it there).
    Read-only because every replica and every run may share one claim of base models.

    >>> spec = {"containers": [{"name": "c"}]}
    >>> mount_model_claim("pvc://models/smollm2", spec, spec["containers"])
    >>> spec["volumes"], spec["containers"][0]["volumeMounts"]
    ([{'name': 'model-pvc', 'persistentVolumeClaim': {'claimName': 'models', 'readOnly': True}}], [{'name': 'model-pvc', 'mountPath': '/mnt/pvc/models', 'readOnly': True}])
    """
    try:
        ref = parse_pvc_ref(model)
    except ValueError as exc:
        raise BuildError(str(exc)) from exc
    if ref is None:
        return
    pod_spec.setdefault("volumes", []).append(
        {
            "name": PVC_MODEL_VOLUME,
            "persistentVolumeClaim": {"claimName": ref.claim, "readOnly": True},
        }
    )
    for container in containers:
        container.setdefault("volumeMounts", []).append(
            {"name": PVC_MODEL_VOLUME, "mountPath": ref.mount_path, "readOnly": True}
        )


# The Hugging Face cache of the trainer pods and the evaluator: on their writable /workspace
# emptyDir (the trainer image's own HF_HOME, made explicit for any image).
WORKSPACE_HF_HOME = "/workspace/.cache/huggingface"


def hf_model_env(model: str, hf_home: str, token: HfTokenSecret | None) -> list[Manifest]:
    """``model`` = ``hf://ORG/NAME[@REVISION]``: what a container that downloads it needs.
    The Hub on (``HF_HUB_OFFLINE=0``; posttrain keeps it off otherwise, and the pod's cache
    starts empty, so naming an hf:// model is the opt-in), the Hugging Face cache
    (``HF_HOME``) on a writable volume, and the spec's token Secret as ``HF_TOKEN`` (a
    secretKeyRef, never a literal). Nothing for any other model.

    >>> [e["name"] for e in hf_model_env("s3://b/m", "/x", None)]
    []
    >>> hf_model_env("hf://org/m", "/models/huggingface", HfTokenSecret(name="hf"))
    [{'name': 'HF_HOME', 'value': '/models/huggingface'}, {'name': 'HF_HUB_OFFLINE', 'value': '0'}, {'name': 'HF_TOKEN', 'valueFrom': {'secretKeyRef': {'name': 'hf', 'key': 'HF_TOKEN'}}}]
    """
    if not is_hf_ref(model):
        return []
    env: list[Manifest] = [
        {"name": "HF_HOME", "value": hf_home},
        {"name": "HF_HUB_OFFLINE", "value": "0"},
    ]
    if token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    return env


def trainer_names(run: TrainingRun) -> dict[str, str]:
    """Names of the run's long-lived children (one of each per run)."""
    name = run.metadata.name
    return {
        "config": f"{name}-config",
        "service_account": f"{name}-trainer",
        "role": f"{name}-trainer",
        "head_service": f"{name}-head",
    }


def trainer_pod_name(run_name: str, incarnation: int, rank: int) -> str:
    """``<run>-g<incarnation>-<rank>``: a new gang never collides with a terminating one.

    >>> trainer_pod_name("demo", 2, 0)
    'demo-g2-0'
    """
    return f"{run_name}-g{incarnation}-{rank}"


def render_run_config(run: TrainingRun, config: OperatorConfig) -> str:
    """The run.yaml the trainer reads: the TrainingRun itself, its storage (this object's)
    and resumeFrom (a URI) made explicit."""
    from posttrain.api import ResumeFrom

    wire = run.model_copy(deep=True)
    wire.spec.checkpoint.storage_uri = run_storage_uri(run, config)
    source = resume_source_uri(run, config)
    wire.spec.resume_from = ResumeFrom(checkpoint=source) if source else None
    body = {
        "apiVersion": wire.api_version,
        "kind": wire.kind,
        "metadata": {"name": run.metadata.name, "namespace": run.metadata.namespace},
        "spec": wire.spec.to_wire(),
    }
    return yaml.safe_dump(body, sort_keys=False)


def build_run_config_map(run: TrainingRun, config: OperatorConfig) -> Manifest:
    """ConfigMap holding run.yaml, mounted read-only at /etc/posttrain in every trainer pod."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(
            run,
            trainer_names(run)["config"],
            {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: run.metadata.name},
        ),
        "data": {RUN_CONFIG_KEY: render_run_config(run, config)},
    }


def build_trainer_rbac(run: TrainingRun) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding: the trainer may get/patch only its own run's status.

    resourceNames pins the Role to this one TrainingRun, so a compromised trainer cannot
    touch other runs (the Role's rules come from rbac.TRAINER_RULES, one source of truth).
    """
    from .rbac import CREATE_ONLY_RESOURCES, TRAINER_RULES

    names = trainer_names(run)
    labels = {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: run.metadata.name}
    rules = [
        rule
        if set(rule["resources"]) <= set(CREATE_ONLY_RESOURCES)
        else {**rule, "resourceNames": [run.metadata.name]}
        for rule in TRAINER_RULES
    ]
    rules += sandbox_runner.trainer_rbac_rules(run)  # task mode: SandboxTasks of the namespace
    pools = [p for p in trainer_pools(run.spec) if p]
    if pools:
        # Read the pools' status.replicaEndpoints (rollout.discovery), those pools only.
        rules.append({"apiGroups": [GROUP], "resources": ["rolloutpools"], "verbs": ["get"],
                      "resourceNames": pools})  # fmt: skip
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": child_metadata(run, names["service_account"], labels),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": child_metadata(run, names["role"], labels),
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": child_metadata(run, names["role"], labels),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": names["role"],
            },
            "subjects": [
                {
                    "kind": "ServiceAccount",
                    "name": names["service_account"],
                    "namespace": run.metadata.namespace,
                }
            ],
        },
    ]


def build_head_service(run: TrainingRun, config: OperatorConfig, incarnation: int) -> Manifest:
    """Headless Service resolving to rank 0 of gang ``incarnation`` (MASTER_ADDR: torchrun's
    rendezvous) for nodes > 1.

    It publishes not-ready addresses, so its selector names the gang: a rank 0 of the previous
    gang that is still terminating would otherwise resolve too, and the new gang's workers
    could rendezvous with it. The operator moves the selector to each new gang before its pods
    exist.

    >>> build_head_service(_example_run(), OperatorConfig(), 2)["spec"]["selector"]["posttrain.io/gang"]
    '2'
    """
    name = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            run,
            trainer_names(run)["head_service"],
            {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: name},
        ),
        "spec": {
            "clusterIP": "None",
            # Workers must resolve the head before it is Ready (rendezvous happens first).
            "publishNotReadyAddresses": True,
            "selector": {
                LABEL_COMPONENT: COMPONENT_TRAINER,
                LABEL_RUN: name,
                LABEL_RANK: "0",
                LABEL_GANG: str(incarnation),
            },
            "ports": [
                {"name": "dist", "port": config.trainer_master_port},
                {"name": "ray", "port": config.ray_port},
            ],
        },
    }


def nccl_env(run: TrainingRun, config: OperatorConfig) -> list[dict[str, str]]:
    """The operator's NCCL settings (the chart's trainer.nccl) with the run's
    resources.nccl set over them, sorted by name so the pod spec is stable.

    >>> run = _example_run()
    >>> run.spec.resources.nccl = {"NCCL_DEBUG": "INFO"}
    >>> nccl_env(run, OperatorConfig(trainer_nccl={"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"}))
    [{'name': 'NCCL_DEBUG', 'value': 'INFO'}, {'name': 'NCCL_IB_DISABLE', 'value': '1'}]
    """
    merged = {**config.trainer_nccl, **run.spec.resources.nccl}
    return [{"name": key, "value": merged[key]} for key in sorted(merged)]


def s3_env(config: OperatorConfig) -> list[dict[str, Any]]:
    """S3 endpoint as plain env, credentials only through secretKeyRef (never literal)."""
    env: list[dict[str, Any]] = [
        {"name": S3_ENDPOINT, "value": config.s3_endpoint},
        {"name": S3_SECURE, "value": "true" if config.s3_secure else "false"},
    ]
    for key in S3_CREDENTIAL_KEYS:
        env.append(
            {
                "name": key,
                "valueFrom": {"secretKeyRef": {"name": config.s3_credentials_secret, "key": key}},
            }
        )
    return env


def build_trainer_pod(
    run: TrainingRun,
    config: OperatorConfig,
    incarnation: int,
    rank: int,
    rollout_endpoints: Sequence[str] = (),
    head_host: str | None = None,
    rollout_dtype: str | None = None,
) -> Manifest:
    """One pod of the trainer gang: node ``rank`` of ``spec.resources.nodes``.

    Pods rather than a batch/v1 Job: restarts, gang restarts and suspend are counted by the
    operator against spec.backoffLimit, and a Job's own backoff would count them twice.
    restartPolicy Never: a failed pod is a gang failure the operator handles as a whole.

    Plain gang: every pod runs ``posttrain run``, which is torchrun's agent for the node's
    ranks (one per GPU, or engine.cpuRanks); the static rendezvous at rank 0's head Service
    (``MASTER_ADDR:MASTER_PORT``) orders the nodes by ``POSTTRAIN_NODE_RANK``.
    ``head_host`` (the RayCluster path, KubeRay's head Service) makes rank 0 a Ray head
    running the trainer as the Ray driver and the other pods Ray workers.
    ``rollout_dtype`` is the pool's serving dtype (:func:`pool_serving_dtype`): the trainer
    publishes weights in it, so replicas read no more bytes than they keep.
    """
    name = run.metadata.name
    nodes = run.spec.resources.nodes
    res = run.spec.resources
    on_ray = head_host is not None and nodes > 1
    head = head_host or f"{trainer_names(run)['head_service']}.{run.metadata.namespace}.svc"
    master_addr = head if nodes > 1 else "127.0.0.1"
    train = ["posttrain", "run", RUN_CONFIG_PATH, "--out", "/workspace"]
    serves_metrics = bool(config.pod_metrics_port) and (nodes == 1 or rank == 0)
    if serves_metrics:  # rank 0's pod (on a RayCluster, Ray workers run `ray start`)
        train += ["--metrics-port", str(config.pod_metrics_port)]
    if not on_ray:
        command = train
    elif rank == 0:
        # The head runs Ray's GCS and then the trainer, which drives the workers through Ray.
        command = [
            "sh", "-c",
            f"ray start --head --port={config.ray_port} --num-cpus={ray_num_cpus(run)} "
            "--disable-usage-stats && exec " + " ".join(train),
        ]  # fmt: skip
    else:
        command = ["ray", "start", f"--address={head}:{config.ray_port}",
                   f"--num-cpus={ray_num_cpus(run)}", "--block"]  # fmt: skip
    # spec.rollout.pool resolved by the operator: the Service URL as a fallback, and the
    # pool's name, whose status.replicaEndpoints the trainer follows (its Role may get that
    # one pool) so each weight version reaches every ready replica.
    resolved_pool = bool(rollout_endpoints) and not run.spec.rollout.endpoints
    contract = TrainerEnv(
        run_name=name,
        run_namespace=run.metadata.namespace,
        run_uid=run.metadata.uid,
        master_addr=master_addr,
        master_port=config.trainer_master_port,
        world_size=nodes,
        rank=rank,
        node_rank=rank,
        gang=incarnation,
        sandbox_runner_url=sandbox_runner.own_runner_url(run),
        rollout_endpoints=list(rollout_endpoints) if resolved_pool else [],
        rollout_pool=run.spec.rollout.pool if resolved_pool else None,
        rollout_dtype=rollout_dtype if resolved_pool else None,
        ray_address=f"{head}:{config.ray_port}" if on_ray else None,
    )
    env: list[dict[str, Any]] = [
        *contract.to_env(),
        *s3_env(config),
        *otlp_env(config, "posttrain-trainer", run),
        *hf_model_env(run.spec.model, WORKSPACE_HF_HOME, run.spec.hf_token_secret),
        *nccl_env(run, config),
    ]
    if resolved_pool and run.spec.rollout.pool:
        # Optional: a pool created after the run starts the trainer without it, and its
        # loads are then refused with a 401 that says why.
        env.append(weights_token_env(run.spec.rollout.pool, optional=True))
    env += scorer_key_env(run.spec)  # judges' and reward models' API keys
    labels = {
        LABEL_COMPONENT: COMPONENT_TRAINER,
        LABEL_RUN: name,
        LABEL_RANK: str(rank),
        LABEL_GANG: str(incarnation),
        **pool_client_labels(run),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "serviceAccountName": trainer_names(run)["service_account"],
        "containers": [
            {
                "name": "trainer",
                "image": res.image or config.trainer_image,
                "imagePullPolicy": config.image_pull_policy,
                "command": command,
                "env": env,
                "resources": resources(res.cpu, res.memory, res.gpus_per_node),
                "volumeMounts": [
                    {
                        "name": "run-config",
                        "mountPath": posixpath.dirname(RUN_CONFIG_PATH),
                        "readOnly": True,
                    },
                    {"name": "dshm", "mountPath": "/dev/shm"},
                    {"name": "workspace", "mountPath": "/workspace"},
                ],
            }
        ],
        "volumes": [
            {"name": "run-config", "configMap": {"name": trainer_names(run)["config"]}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
            {"name": "workspace", "emptyDir": {}},
        ],
    }
    mount_model_claim(run.spec.model, pod_spec, pod_spec["containers"])
    if nodes > 1:
        # Stable DNS for each rank through the headless Service.
        pod_spec["hostname"] = f"rank-{rank}"
        pod_spec["subdomain"] = trainer_names(run)["head_service"]
    schedule(
        pod_spec,
        config,
        config.trainer_node_selector,
        res.node_selector,
        config.trainer_tolerations,
        config.trainer_affinity,
    )
    sandbox_runner.apply_local_sandbox_context(run, pod_spec)
    if run.spec.active_deadline_seconds:
        pod_spec["activeDeadlineSeconds"] = run.spec.active_deadline_seconds
    annotations = None
    if serves_metrics:
        pod_spec["containers"][0]["ports"] = [
            {"name": METRICS_PORT_NAME, "containerPort": config.pod_metrics_port}
        ]
        annotations = scrape_annotations(config.pod_metrics_port)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(
            run, trainer_pod_name(name, incarnation, rank), labels, annotations=annotations
        ),
        "spec": pod_spec,
    }


METRICS_PORT_NAME = "metrics"  # the trainer's /metrics port (a PodMonitor selects it by name)


def scrape_annotations(port: int) -> dict[str, str]:
    """The prometheus.io/* annotations annotation-based scrapers (and many Helm-installed
    Prometheus setups) use; the chart's PodMonitors select the named port instead.

    >>> scrape_annotations(9090)["prometheus.io/port"]
    '9090'
    """
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }


def otlp_env(
    config: OperatorConfig, service: str, owner: TrainingRun | RolloutPool
) -> list[dict[str, str]]:
    """OTEL_* variables that send a child's spans where the operator's go (none when the
    operator has no OTLP endpoint configured).

    >>> otlp_env(OperatorConfig(), "posttrain-trainer", None)  # type: ignore[arg-type]
    []
    """
    if not config.otlp_endpoint:
        return []
    attributes = (
        f"k8s.namespace.name={owner.metadata.namespace},"
        f"posttrain.{owner.kind.lower()}={owner.metadata.name}"
    )
    return [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": config.otlp_endpoint},
        {"name": "OTEL_SERVICE_NAME", "value": service},
        {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": attributes},
    ]


def build_trainer_gang(
    run: TrainingRun, config: OperatorConfig, incarnation: int
) -> list[Manifest]:
    """All pods of one gang incarnation, rank 0 first."""
    return [
        build_trainer_pod(run, config, incarnation, rank)
        for rank in range(run.spec.resources.nodes)
    ]


# ---------------------------------------------------------------- TrainingRun on KubeRay

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


def ray_num_cpus(run: TrainingRun) -> int:
    """The CPUs a Ray node of the run declares: the pod's CPU rounded up, and at least one
    per rank on the node (Ray Train asks one CPU per rank worker).

    Passed explicitly, as KubeRay's own generated start command does: left to itself Ray
    truncates a fractional cgroup quota, so a ``500m`` pod would declare 0 CPUs and the
    rank workers would wait for resources that never come.

    >>> run = _example_run()
    >>> run.spec.resources.cpu, run.spec.resources.gpus_per_node = "500m", 0
    >>> ray_num_cpus(run)
    1
    >>> run.spec.resources.cpu, run.spec.resources.gpus_per_node = "2500m", 8
    >>> ray_num_cpus(run)
    8
    """
    res = run.spec.resources
    cpu = res.cpu
    cores = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    ranks = res.gpus_per_node if res.gpus_per_node > 0 else run.spec.engine.cpu_ranks
    return max(math.ceil(cores), ranks, 1)


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


# ---------------------------------------------------------------- RolloutPool


def pool_selector(pool_name: str) -> dict[str, str]:
    return {LABEL_COMPONENT: COMPONENT_ROLLOUT, LABEL_POOL: pool_name}


def selector_string(labels: dict[str, str]) -> str:
    """The label selector in string form (the scale subresource's labelSelectorPath wants it).

    >>> selector_string({"b": "2", "a": "1"})
    'a=1,b=2'
    """
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def trainer_pools(spec: TrainingRunSpec) -> list[str]:
    """RolloutPools whose replicas the trainer reads: the rollout pool (unless explicit
    endpoints replace it), then the judges' and reward models' pools, each once.

    >>> from posttrain.api import TrainingRunSpec
    >>> judge = {"kind": "judge", "judge": {"pool": "judge", "rubric": "{answer}"}}
    >>> trainer_pools(TrainingRunSpec.model_validate({"model": "m", "rollout": {"pool": "p"},
    ...     "domains": [{"name": "d", "dataset": "builtin:arithmetic", "verifier": judge}]}))
    ['p', 'judge']
    """
    pools = [spec.rollout.pool] if spec.rollout.pool and not spec.rollout.endpoints else []
    pools += [e.pool for e in spec.model_scorers() if e.pool]
    return list(dict.fromkeys(pools))


def scorer_key_env(spec: TrainingRunSpec) -> list[Manifest]:
    """The judges' and reward models' API keys: each ``apiKeySecret`` as its ``apiKeyEnv``
    (a secretKeyRef, never a literal).

    >>> from posttrain.api import TrainingRunSpec
    >>> judge = {"kind": "judge", "judge": {"url": "https://api.example.com/v1",
    ...     "rubric": "{answer}", "apiKeyEnv": "JUDGE_KEY",
    ...     "apiKeySecret": {"name": "judge", "key": "token"}}}
    >>> scorer_key_env(TrainingRunSpec.model_validate({"model": "m",
    ...     "domains": [{"name": "d", "dataset": "builtin:arithmetic", "verifier": judge}]}))
    [{'name': 'JUDGE_KEY', 'valueFrom': {'secretKeyRef': {'name': 'judge', 'key': 'token'}}}]
    """
    env: dict[str, Manifest] = {}
    for endpoint in spec.model_scorers():
        ref = endpoint.api_key_secret
        if ref is not None and endpoint.api_key_env is not None:
            env[endpoint.api_key_env] = {
                "name": endpoint.api_key_env,
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
    return list(env.values())


def pool_endpoint(pool: RolloutPool) -> str:
    """In-cluster base URL of the pool's Service."""
    return f"http://{pool.metadata.name}.{pool.metadata.namespace}.svc:{pool.spec.port}"


def pool_serving_dtype(pool: RolloutPool) -> str | None:
    """The dtype the pool's replicas hold their weights in, when the spec fixes it.

    A trainer publishing fp32 master weights to a bf16 pool moves twice the bytes each step
    and every replica casts them down anyway, so the trainer publishes in this dtype. vLLM
    serves ``engineArgs.dtype``; ``auto`` is decided by vLLM from the model's config, which
    the operator does not read: None (the trainer publishes in its own compute dtype). The
    cpu engine holds float32 whatever it is sent and takes any dtype: None too (the
    trainer's compute dtype is never more bytes than float32).

    >>> from posttrain.api import RolloutPool
    >>> def pool(**spec):
    ...     return RolloutPool.model_validate({"metadata": {"name": "p"},
    ...                                        "spec": {"model": "m", **spec}})
    >>> pool_serving_dtype(pool(engineArgs={"dtype": "bfloat16"}))
    'bfloat16'
    >>> pool_serving_dtype(pool()), pool_serving_dtype(pool(engine="cpu"))
    (None, None)
    """
    if pool.spec.engine != "vllm":
        return None
    dtype = pool.spec.engine_args.dtype
    return None if dtype == "auto" else dtype


# A vLLM pool pod's init container resolves spec.model into this volume (emptyDir), and the
# server starts from the link: vLLM never sees a packaged id or an s3:// URI. An hf:// model's
# Hugging Face cache is on it too (the link points into it), also for the cpu engine, whose
# server downloads the model itself.
MODEL_VOLUME = "models"
MODEL_MOUNT = "/models"
MODEL_LINK = f"{MODEL_MOUNT}/current"
POOL_HF_HOME = f"{MODEL_MOUNT}/huggingface"
# Where a vLLM replica stages weight updates (POSTTRAIN_WEIGHTS_SCRATCH), a sized emptyDir.
WEIGHTS_SCRATCH_VOLUME = "weights-scratch"
WEIGHTS_SCRATCH_MOUNT = "/var/lib/posttrain/weights"
WEIGHTS_SCRATCH_ENV = WEIGHTS_SCRATCH


def model_fetch_command(pool: RolloutPool) -> list[str]:
    """The init step that puts spec.model on the pod's volume (fails naming the URI)."""
    return ["posttrain", "rollout", "fetch-model", "--model", pool.spec.model, "--link", MODEL_LINK]


def rollout_command(pool: RolloutPool) -> list[str]:
    """The server argv: vLLM behind posttrain's front door, or ``posttrain serve`` for cpu.

    The front door (``posttrain rollout vllm-entry``) is the entrypoint, not ``vllm serve``:
    it serves the pod's port, stamps each response with its weight version, loads weights
    on ``/v1/weights/load`` and pulls the latest committed version before it reports ready.
    vLLM itself listens on 127.0.0.1 at a free port (``--internal-port 0``), so its
    dev-mode ``/collective_rpc`` is unreachable from other pods.
    """
    spec = pool.spec
    served = spec.served_model_name or pool.metadata.name
    if spec.engine == "cpu":
        # Bind the pod IP, not 0.0.0.0: probes and the Service reach the pod IP either way, and
        # on a node whose pods share the host network (the dev node agent) replicas then do
        # not fight over one port.
        return [
            "posttrain", "serve", "--model", spec.model, "--host", "$(POD_IP)",
            "--port", str(spec.port), "--served-model-name", served,
        ]  # fmt: skip
    engine_args = spec.engine_args.model_dump(mode="json", exclude_none=True)
    return [
        "posttrain", "rollout", "vllm-entry", "--model", MODEL_LINK,
        "--host", "$(POD_IP)", "--port", str(spec.port), "--internal-port", "0",
        "--served-model-name", served,
        "--engine-args", json.dumps(engine_args, sort_keys=True, separators=(",", ":")),
    ]  # fmt: skip


def build_rollout_deployment(pool: RolloutPool, config: OperatorConfig) -> Manifest:
    """The pool's Deployment: replicas from spec, /health readiness, surge-only rollouts.

    maxUnavailable 0 + maxSurge 1: a weight-version or image rollout adds a new replica before
    removing an old one, so sampling capacity never drops during training.
    """
    spec = pool.spec
    name = pool.metadata.name
    labels = pool_selector(name)
    image = spec.image or (config.rollout_cpu_image if spec.engine == "cpu" else config.vllm_image)
    # Trainers publish weights to S3 and ask every replica to load them (POST
    # /v1/weights/load with an s3:// URI), so replicas need the S3 endpoint and credentials
    # even when they do not poll a weight source themselves.
    polls = bool(spec.weight_update.source_uri)
    contract = RolloutPoolEnv(
        pool_name=name,
        weights_uri=spec.weight_update.source_uri if polls else None,
        weights_poll_seconds=spec.weight_update.poll_seconds if polls else None,
    )
    env: list[dict[str, Any]] = [
        *contract.to_env(),
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Only the token's holders may load weights (the reconciler creates the Secret first).
        weights_token_env(name, optional=False),
    ]
    if config.s3_endpoint:
        env += s3_env(config)
    env += otlp_env(config, "posttrain-rollout", pool)
    gpus = spec.resources.gpus if spec.engine == "vllm" else 0
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": rollout_command(pool),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port}],
        # A replica that exits (bad weights, a model that will not load) leaves its last
        # log lines as the termination message the pool's status reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": resources(spec.resources.cpu, spec.resources.memory, gpus),
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        # Model loading can take minutes; don't let liveness kill a replica that is loading.
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 180,
        },
    }
    pod_spec: dict[str, Any] = {"containers": [container]}
    # An hf:// model: the Hub, the cache and the token for whichever container downloads it.
    hf_env = hf_model_env(spec.model, POOL_HF_HOME, spec.hf_token_secret)
    mount = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}
    if spec.engine == "vllm":
        model_env = [*env, *RolloutPoolEnv(cache=MODEL_MOUNT).to_env()]
        # Weight updates are staged on a declared volume, not in the container's /tmp: its
        # sizeLimit and the container's ephemeral-storage bound what a replica may write, so
        # an oversized update evicts that replica instead of filling the node's disk.
        container["env"] = [
            *model_env,
            {"name": WEIGHTS_SCRATCH_ENV, "value": WEIGHTS_SCRATCH_MOUNT},
        ]
        container["volumeMounts"] = [
            mount,
            {"name": WEIGHTS_SCRATCH_VOLUME, "mountPath": WEIGHTS_SCRATCH_MOUNT},
        ]
        container["resources"] = resources(
            spec.resources.cpu,
            spec.resources.memory,
            gpus,
            ephemeral_storage=spec.resources.ephemeral_storage,
        )
        pod_spec["volumes"] = [
            {"name": MODEL_VOLUME, "emptyDir": {}},
            {
                "name": WEIGHTS_SCRATCH_VOLUME,
                "emptyDir": {"sizeLimit": spec.resources.weights_scratch},
            },
        ]
        pod_spec["initContainers"] = [{
            "name": "fetch-model",
            "image": image,
            "imagePullPolicy": config.image_pull_policy,
            "command": model_fetch_command(pool),
            "env": [*model_env, *hf_env],  # the server only reads /models/current
            "volumeMounts": [mount],
            # Its stderr line ("cannot fetch model s3://...: ...") becomes the termination
            # message the operator puts in the pool's Ready condition.
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }]  # fmt: skip
    elif hf_env:  # the cpu server resolves spec.model itself: the cache on a volume of its own
        container["env"] = [*env, *hf_env]
        container["volumeMounts"] = [mount]
        pod_spec["volumes"] = [{"name": MODEL_VOLUME, "emptyDir": {}}]
    mount_model_claim(
        spec.model, pod_spec, [container, *pod_spec.get("initContainers", [])]
    )  # the fetch-model step links /models/current into the claim: both need it
    if gpus or spec.engine == "vllm":
        # vLLM's engine core talks to its workers through shared memory (160 MiB of ring
        # buffers on CPU too) and the runtime's /dev/shm is 64 MiB: memory-backed, counted
        # against the pod's memory limit, which sizes it.
        pod_spec.setdefault("volumes", []).append(
            {"name": "dshm", "emptyDir": {"medium": "Memory"}}
        )
        container.setdefault("volumeMounts", []).append({"name": "dshm", "mountPath": "/dev/shm"})
    schedule(
        pod_spec,
        config,
        config.rollout_node_selector,
        spec.resources.node_selector,
        config.rollout_tolerations,
        config.rollout_affinity,
    )
    # Both engines serve Prometheus /metrics on the API port (vLLM's own metrics, or ours).
    template = {
        "metadata": {
            "labels": {**MANAGED_BY, **labels},
            "annotations": scrape_annotations(spec.port),
        },
        "spec": pod_spec,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(
            pool, name, labels, annotations={ANNOTATION_SPEC_HASH: spec_hash(template)}
        ),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": template,
        },
    }


def build_rollout_service(pool: RolloutPool) -> Manifest:
    """ClusterIP Service in front of the pool's ready replicas (the OpenAI API port)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(pool, pool.metadata.name, pool_selector(pool.metadata.name)),
        "spec": {
            "selector": pool_selector(pool.metadata.name),
            "ports": [{"name": "http", "port": pool.spec.port, "targetPort": "http"}],
        },
    }


def pool_client_labels(run: TrainingRun) -> dict[str, str]:
    """``client.posttrain.io/<pool>: "true"`` for each pool the run's pods call (judges'
    included): those pools' NetworkPolicies admit them.

    >>> run = _example_run()
    >>> pool_client_labels(run)
    {}
    >>> run.spec.rollout.pool = "gen"
    >>> pool_client_labels(run)
    {'client.posttrain.io/gen': 'true'}
    """
    return {f"{POOL_CLIENT_PREFIX}{pool}": "true" for pool in trainer_pools(run.spec)}


def build_pool_network_policy(pool: RolloutPool, config: OperatorConfig) -> Manifest:
    """Who may reach a pool's replicas: the pods of runs that name the pool (labelled by
    :func:`pool_client_labels`) and the operator (which asks each replica for its weight
    version). Sampling and ``/v1/weights/load`` share the port, so this narrows who can try;
    the weight token decides who succeeds (rollout/auth.py)."""
    name = pool.metadata.name
    sources: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {f"{POOL_CLIENT_PREFIX}{name}": "true"}}}
    ]
    if config.operator_namespace:
        sources.append(
            {
                "namespaceSelector": {
                    "matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}
                },
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(pool, name, pool_selector(name)),
        "spec": {
            "podSelector": {"matchLabels": pool_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": sources, "ports": [{"port": pool.spec.port}]}],
        },
    }


def pool_token_secret_name(pool_name: str) -> str:
    """The Secret holding a pool's weight token (rollout/auth.py).

    >>> pool_token_secret_name("dev-pool")
    'dev-pool-weights-token'
    """
    return f"{pool_name}-weights-token"


def build_pool_token_secret(pool: RolloutPool) -> Manifest:
    """The pool's weight token: a fresh random value, created once (a reconcile that finds
    the Secret keeps it), collected with the pool. Only the pool's replicas and the trainers
    of runs that sample from the pool get it (a secretKeyRef in their pod specs)."""
    import secrets

    name = pool_token_secret_name(pool.metadata.name)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(pool, name, pool_selector(pool.metadata.name)),
        "type": "Opaque",
        "stringData": {"token": secrets.token_urlsafe(32)},
    }


def weights_token_env(pool_name: str, *, optional: bool) -> Manifest:
    """``$POSTTRAIN_WEIGHTS_TOKEN`` from the pool's token Secret."""
    ref = {"name": pool_token_secret_name(pool_name), "key": "token", "optional": optional}
    return {"name": WEIGHTS_TOKEN, "valueFrom": {"secretKeyRef": ref}}


# ---------------------------------------------------------------- SandboxTask


def restricted_container_context() -> Manifest:
    """The container securityContext of every pod that runs untrusted code (cold sandbox
    pods, their init container, warm-pool pods): Pod Security "restricted" and then some."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NOBODY_UID,
        "runAsGroup": NOBODY_UID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def restricted_pod_context() -> Manifest:
    """The pod securityContext that goes with :func:`restricted_container_context`."""
    return {
        "runAsNonRoot": True,
        "runAsUser": NOBODY_UID,
        "runAsGroup": NOBODY_UID,
        "fsGroup": NOBODY_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sandbox_pod_name(task_name: str, attempt: int) -> str:
    """``<task>-<attempt>``, attempts counted from 1.

    >>> sandbox_pod_name("t", 2)
    't-2'
    """
    return f"{task_name}-{attempt}"


def check_file_name(name: str) -> str:
    normalised = posixpath.normpath(name)
    if (
        not name
        or name.startswith("/")
        or normalised.startswith("..")
        or normalised != name
        or name.startswith(".")
    ):
        raise BuildError(
            f"files key {name!r} is not a plain relative path; use names like 'main.py' or "
            "'tests/test_main.py' (no leading '/' or '.', no '..')"
        )
    return name


@dataclass(frozen=True)
class SandboxArtifacts:
    """Where one sandbox attempt stores its artifacts: s3:// URIs for the status and the
    presigned URLs (one object each, short-lived) the pod's entrypoint uses instead of
    credentials."""

    logs_uri: str
    logs_url: str
    snapshot_uri: str | None = None
    snapshot_url: str | None = None
    restore_url: str | None = None


def sandbox_artifact_key(prefix: str, task: SandboxTask, attempt: int, name: str) -> str:
    """Object key of one attempt's artifact: ``<prefix>/<ns>/<task>/<attempt>/<name>``.

    The namespace comes first, so restoreFrom can be limited to the task's own namespace.

    >>> t = SandboxTask.model_validate({"metadata": {"name": "t", "namespace": "ns"},
    ...                                 "spec": {"command": ["true"]}})
    >>> sandbox_artifact_key("sandboxes", t, 2, "logs.txt")
    'sandboxes/ns/t/2/logs.txt'
    """
    parts = [prefix.strip("/"), task.metadata.namespace, task.metadata.name, str(attempt), name]
    return "/".join(p for p in parts if p)


def sandbox_entrypoint_source() -> str:
    """The stdlib-only entrypoint shipped into storing sandbox pods."""
    from posttrain.sandboxes import task_entrypoint

    return Path(task_entrypoint.__file__).read_text()


def sandbox_entrypoint_config_map_name() -> str:
    """``posttrain-sandbox-entrypoint-<hash>``: a new operator version with a changed
    entrypoint gets a new ConfigMap, never mutating the one running pods mount."""
    return f"posttrain-sandbox-entrypoint-{spec_hash(sandbox_entrypoint_source())[:10]}"


def build_sandbox_entrypoint_config_map(namespace: str) -> Manifest:
    """One ConfigMap per namespace with the entrypoint (no owner: shared by all tasks)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": sandbox_entrypoint_config_map_name(),
            "namespace": namespace,
            "labels": {**MANAGED_BY, LABEL_COMPONENT: COMPONENT_SANDBOX},
        },
        "data": {SANDBOX_ENTRYPOINT_KEY: sandbox_entrypoint_source()},
    }


def _store_artifacts(
    contract: SandboxTaskEnv,
    task: SandboxTask,
    annotations: dict[str, str],
    artifacts: SandboxArtifacts,
) -> SandboxTaskEnv:
    """Hand the entrypoint the presigned URLs (the contract) and record their URIs."""
    annotations[ANNOTATION_LOGS_URI] = artifacts.logs_uri
    snapshot_url = None
    if artifacts.snapshot_url and artifacts.snapshot_uri:
        annotations[ANNOTATION_SNAPSHOT_URI] = artifacts.snapshot_uri
        snapshot_url = artifacts.snapshot_url
    return contract.model_copy(
        update={
            "workdir": SANDBOX_WORKDIR,
            "timeout_seconds": task.spec.timeout_seconds,
            "logs_url": artifacts.logs_url,
            "snapshot_url": snapshot_url,
            "restore_url": artifacts.restore_url or None,
        }
    )


def build_sandbox_pod(
    task: SandboxTask,
    config: OperatorConfig,
    attempt: int,
    artifacts: SandboxArtifacts | None = None,
) -> Manifest:
    """An isolated, Guaranteed-QoS pod for one attempt of ``task``.

    Files travel in pod annotations and reach the program through a downward-API volume
    copied into the writable workdir by an init container: no ConfigMap per task, so a
    burst of tasks costs one create per task. The program ends by writing a JSON result
    {"exit_code", "reward", "duration_ms", "reason"} to /dev/termination-log; without one
    the operator scores by exit code.

    With ``artifacts`` the program runs under the stdlib-only entrypoint
    (sandboxes/task_entrypoint.py, mounted from a shared ConfigMap) that restores, keeps the
    log, snapshots and uploads through presigned URLs: the pod holds no S3 credentials.
    """
    spec = task.spec
    name = task.metadata.name
    annotations: dict[str, str] = {}
    items: list[dict[str, Any]] = []
    files = dict(spec.files)
    if spec.stdin is not None:
        files[SANDBOX_STDIN_FILE] = spec.stdin
    for index, (file_name, content) in enumerate(sorted(files.items())):
        if file_name != SANDBOX_STDIN_FILE:
            check_file_name(file_name)
        key = f"{ANNOTATION_FILE_PREFIX}{index}"
        annotations[key] = content
        items.append(
            {"path": file_name, "fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}
        )
    command = list(spec.command) or ["python", "main.py"]
    if spec.stdin is not None:
        # Pods have no stdin pipe; the shell redirects the stdin file into the program.
        command = [
            "sh",
            "-c",
            f'exec "$@" < {SANDBOX_WORKDIR}/{SANDBOX_STDIN_FILE}',
            "sandbox",
            *command,
        ]
    restricted = restricted_container_context()
    res = spec.resources
    workdir_mount = {"name": "workdir", "mountPath": SANDBOX_WORKDIR}
    contract = SandboxTaskEnv(task=name, attempt=attempt)
    if artifacts is not None:
        # The program runs under the entrypoint, which reads the URLs from the contract.
        contract = _store_artifacts(contract, task, annotations, artifacts)
        command = ["python3", f"{SANDBOX_ENTRYPOINT_DIR}/{SANDBOX_ENTRYPOINT_KEY}", "--", *command]
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": SANDBOX_WORKDIR},
        {"name": "TMPDIR", "value": SANDBOX_WORKDIR},
        *contract.to_env(),
    ]
    containers: list[dict[str, Any]] = [
        {
            "name": "sandbox",
            "image": spec.image or config.sandbox_image,
            "imagePullPolicy": config.image_pull_policy,
            "command": command,
            "workingDir": SANDBOX_WORKDIR,
            "env": env,
            "resources": resources(res.cpu, res.memory, ephemeral_storage=res.ephemeral_storage),
            "securityContext": restricted,
            "terminationMessagePath": "/dev/termination-log",
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "volumeMounts": [workdir_mount],
        }
    ]
    init_containers: list[dict[str, Any]] = []
    volumes: list[dict[str, Any]] = [
        {"name": "workdir", "emptyDir": {"sizeLimit": config.sandbox_workdir_size}}
    ]
    if items:
        top_level = sorted({f.split("/", 1)[0] for f in files})
        init_containers.append(
            {
                "name": "files",
                "image": config.sandbox_init_image,
                "imagePullPolicy": config.image_pull_policy,
                # -L: downward-API files are symlinks into a timestamped dir; copy contents.
                "command": [
                    "cp",
                    "-rL",
                    *(f"{SANDBOX_FILES_DIR}/{t}" for t in top_level),
                    SANDBOX_WORKDIR + "/",
                ],
                "resources": resources("100m", "32Mi", ephemeral_storage="16Mi"),
                "securityContext": restricted,
                "volumeMounts": [
                    workdir_mount,
                    {"name": "files", "mountPath": SANDBOX_FILES_DIR, "readOnly": True},
                ],
            }
        )
        volumes.append({"name": "files", "downwardAPI": {"items": items}})
    network = "egress" if spec.network == "egress" else "none"
    labels = {
        LABEL_COMPONENT: COMPONENT_SANDBOX,
        LABEL_TASK: name,
        LABEL_ATTEMPT: str(attempt),
        LABEL_SANDBOX_NETWORK: network,
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "activeDeadlineSeconds": spec.timeout_seconds,
        "terminationGracePeriodSeconds": 1,
        "securityContext": restricted_pod_context(),
        "containers": containers,
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if artifacts is not None:
        containers[0]["volumeMounts"].append(
            {"name": "entrypoint", "mountPath": SANDBOX_ENTRYPOINT_DIR, "readOnly": True}
        )
        volumes.append(
            {
                "name": "entrypoint",
                "configMap": {"name": sandbox_entrypoint_config_map_name(), "defaultMode": 0o444},
            }
        )
        # The program keeps its full timeoutSeconds (the entrypoint enforces it); the pod's
        # deadline leaves the entrypoint time to upload after a timeout.
        pod_spec["activeDeadlineSeconds"] = (
            spec.timeout_seconds + config.sandbox_upload_grace_seconds
        )
    apply_sandbox_runtime(pod_spec, spec.runtime_class_name, config)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(task, sandbox_pod_name(name, attempt), labels, annotations),
        "spec": pod_spec,
    }


def build_sandbox_network_policy(namespace: str, egress: Sequence[dict[str, Any]] = ()) -> Manifest:
    """One default-deny NetworkPolicy per namespace for every sandbox pod with network=none.

    It selects by label, so it is created once per namespace (not per task) and has no
    owner: it outlives any single task. ``egress`` (OperatorConfig.sandbox_artifacts_egress)
    is the one exception: the object store the entrypoint uploads artifacts to.
    """
    policy: Manifest = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": SANDBOX_NETWORK_POLICY,
            "namespace": namespace,
            "labels": dict(MANAGED_BY),
        },
        "spec": {
            "podSelector": {
                "matchLabels": {LABEL_COMPONENT: COMPONENT_SANDBOX, LABEL_SANDBOX_NETWORK: "none"}
            },
            # Both types with no rules: nothing in, nothing out (not even DNS).
            "policyTypes": ["Ingress", "Egress"],
        },
    }
    if egress:
        policy["spec"]["egress"] = [dict(rule) for rule in egress]
    return policy


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
