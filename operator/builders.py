"""Pure builders: posttrain resources + OperatorConfig -> the child objects' manifests (dicts).

Nothing here talks to the apiserver, so unit tests (and ``kubectl apply --dry-run``) can check
every field of every child. Names are deterministic (``<task>-<attempt>``,
``<run>-g<incarnation>-<rank>``) so a restarted operator adopts what it already created
instead of duplicating it.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Sequence
from typing import Any

import yaml

from posttrain.api import RolloutPool, SandboxTask, TrainingRun

from .config import OperatorConfig

Manifest = dict[str, Any]

# Labels every child carries; selectors and the operator's caches key on them.
LABEL_COMPONENT = "posttrain.io/component"
LABEL_RUN = "posttrain.io/run"
LABEL_RANK = "posttrain.io/rank"
LABEL_GANG = "posttrain.io/gang"
LABEL_POOL = "posttrain.io/pool"
LABEL_TASK = "posttrain.io/task"
LABEL_ATTEMPT = "posttrain.io/attempt"
LABEL_SANDBOX_NETWORK = "posttrain.io/sandbox-network"
MANAGED_BY = {"app.kubernetes.io/managed-by": "posttrain-operator"}

COMPONENT_TRAINER = "trainer"
COMPONENT_ROLLOUT = "rollout"
COMPONENT_SANDBOX = "sandbox"

ANNOTATION_INCARNATION = "posttrain.io/incarnation"
ANNOTATION_SPEC_HASH = "posttrain.io/spec-hash"
ANNOTATION_FILE_PREFIX = "posttrain.io/file."
ANNOTATION_WEIGHT_VERSION = "posttrain.io/weight-version"

RUN_CONFIG_PATH = "/etc/posttrain/run.yaml"
RUN_CONFIG_KEY = "run.yaml"
SANDBOX_WORKDIR = "/workspace"
SANDBOX_FILES_DIR = "/sandbox/files"
SANDBOX_STDIN_FILE = ".stdin"
SANDBOX_NETWORK_POLICY = "posttrain-sandbox-default-deny"
NOBODY_UID = 65534


class BuildError(ValueError):
    """The spec cannot be turned into a valid child object; the message says what to fix."""


# ---------------------------------------------------------------- shared helpers


def owner_reference(owner: TrainingRun | RolloutPool | SandboxTask) -> dict[str, Any]:
    """The controller ownerReference pointing at ``owner`` (GC deletes children with it).

    blockOwnerDeletion lets foreground deletion wait for the children; it needs the
    ``<plural>/finalizers`` update permission that rbac.OPERATOR_RULES grants.
    """
    if not owner.metadata.uid:
        raise BuildError(f"{owner.kind} {owner.metadata.name} has no uid; build children from "
                         "the object read back from the apiserver")
    return {
        "apiVersion": owner.api_version,
        "kind": owner.kind,
        "name": owner.metadata.name,
        "uid": owner.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    owner: TrainingRun | RolloutPool | SandboxTask,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": owner.metadata.namespace,
        "labels": {**MANAGED_BY, **labels},
        "ownerReferences": [owner_reference(owner)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def spec_hash(obj: Any) -> str:
    """A short stable digest of a JSON-able object (detects template drift without diffing).

    >>> spec_hash({"a": 1}) == spec_hash({"a": 1}) != spec_hash({"a": 2})
    True
    """
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _resources(
    cpu: str, memory: str, gpus: int = 0, ephemeral_storage: str | None = None
) -> dict[str, Any]:
    """requests = limits (Guaranteed QoS); GPUs and ephemeral-storage only when asked for.

    >>> _resources("1", "1Gi", gpus=2)["limits"]["nvidia.com/gpu"]
    '2'
    """
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if ephemeral_storage:
        limits["ephemeral-storage"] = ephemeral_storage
    if gpus > 0:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def _schedule(
    pod_spec: dict[str, Any],
    config: OperatorConfig,
    default_selector: dict[str, str],
    selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    affinity: dict[str, Any],
) -> None:
    """Placement from the operator's defaults, the resource's nodeSelector winning per key."""
    merged = {**default_selector, **selector}
    if merged:
        pod_spec["nodeSelector"] = merged
    if tolerations:
        pod_spec["tolerations"] = [dict(t) for t in tolerations]
    if affinity:
        pod_spec["affinity"] = dict(affinity)
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in config.image_pull_secrets]


# ---------------------------------------------------------------- TrainingRun


def run_storage_uri(run: TrainingRun, config: OperatorConfig) -> str:
    """Where the run's checkpoints and trajectories live.

    >>> run_storage_uri(_example_run(), OperatorConfig(s3_bucket="b"))
    's3://b/runs/ns/demo'
    """
    return run.spec.checkpoint.storage_uri or (
        f"s3://{config.s3_bucket}/runs/{run.metadata.namespace}/{run.metadata.name}"
    )


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
    """The run.yaml the trainer reads: the TrainingRun itself, storage made explicit."""
    wire = run.model_copy(deep=True)
    wire.spec.checkpoint.storage_uri = run_storage_uri(run, config)
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
            run, trainer_names(run)["config"],
            {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: run.metadata.name},
        ),
        "data": {RUN_CONFIG_KEY: render_run_config(run, config)},
    }


def build_trainer_rbac(run: TrainingRun) -> list[Manifest]:
    """ServiceAccount + Role + RoleBinding: the trainer may get/patch only its own run's status.

    resourceNames pins the Role to this one TrainingRun, so a compromised trainer cannot
    touch other runs (the Role's rules come from rbac.TRAINER_RULES, one source of truth).
    """
    from .rbac import TRAINER_RULES

    names = trainer_names(run)
    labels = {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: run.metadata.name}
    rules = [{**rule, "resourceNames": [run.metadata.name]} for rule in TRAINER_RULES]
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


def build_head_service(run: TrainingRun, config: OperatorConfig) -> Manifest:
    """Headless Service resolving to rank 0 (MASTER_ADDR and the Ray head) for nodes > 1."""
    name = run.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(
            run, trainer_names(run)["head_service"],
            {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: name},
        ),
        "spec": {
            "clusterIP": "None",
            # Workers must resolve the head before it is Ready (rendezvous happens first).
            "publishNotReadyAddresses": True,
            "selector": {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: name, LABEL_RANK: "0"},
            "ports": [
                {"name": "dist", "port": config.trainer_master_port},
                {"name": "ray", "port": config.ray_port},
            ],
        },
    }


def _s3_env(config: OperatorConfig) -> list[dict[str, Any]]:
    """S3 endpoint as plain env, credentials only through secretKeyRef (never literal)."""
    env: list[dict[str, Any]] = [
        {"name": "POSTTRAIN_S3_ENDPOINT", "value": config.s3_endpoint},
        {"name": "POSTTRAIN_S3_SECURE", "value": "true" if config.s3_secure else "false"},
    ]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
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
) -> Manifest:
    """One pod of the trainer gang (rank 0 trains; ranks > 0 are Ray workers).

    Pods rather than a batch/v1 Job: restarts, gang restarts and suspend are counted by the
    operator against spec.backoffLimit, and a Job's own backoff would count them twice.
    restartPolicy Never: a failed pod is a gang failure the operator handles as a whole.
    """
    name = run.metadata.name
    nodes = run.spec.resources.nodes
    res = run.spec.resources
    head = f"{trainer_names(run)['head_service']}.{run.metadata.namespace}.svc"
    master_addr = head if nodes > 1 else "127.0.0.1"
    train = ["posttrain", "run", RUN_CONFIG_PATH, "--out", "/workspace"]
    if nodes == 1:
        command = train
    elif rank == 0:
        # The head runs Ray's GCS and then the trainer, which drives the workers through Ray.
        command = [
            "sh", "-c",
            f"ray start --head --port={config.ray_port} --disable-usage-stats && exec "
            + " ".join(train),
        ]  # fmt: skip
    else:
        command = ["ray", "start", f"--address={head}:{config.ray_port}", "--block"]
    env: list[dict[str, Any]] = [
        {"name": "POSTTRAIN_RUN_NAME", "value": name},
        {"name": "POSTTRAIN_RUN_NAMESPACE", "value": run.metadata.namespace},
        {"name": "MASTER_ADDR", "value": master_addr},
        {"name": "MASTER_PORT", "value": str(config.trainer_master_port)},
        {"name": "WORLD_SIZE", "value": str(nodes)},
        {"name": "RANK", "value": str(rank)},
        {"name": "POSTTRAIN_GANG", "value": str(incarnation)},
        *_s3_env(config),
    ]
    if rollout_endpoints and not run.spec.rollout.endpoints:
        # spec.rollout.pool resolved by the operator (the trainer may not read RolloutPools).
        env.append({"name": ROLLOUT_ENDPOINTS_ENV, "value": ",".join(rollout_endpoints)})
    if nodes > 1:
        env.append({"name": "RAY_ADDRESS", "value": f"{head}:{config.ray_port}"})
    labels = {
        LABEL_COMPONENT: COMPONENT_TRAINER,
        LABEL_RUN: name,
        LABEL_RANK: str(rank),
        LABEL_GANG: str(incarnation),
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
                "resources": _resources(res.cpu, res.memory, res.gpus_per_node),
                "volumeMounts": [
                    {"name": "run-config", "mountPath": posixpath.dirname(RUN_CONFIG_PATH),
                     "readOnly": True},
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
    if nodes > 1:
        # Stable DNS for each rank through the headless Service.
        pod_spec["hostname"] = f"rank-{rank}"
        pod_spec["subdomain"] = trainer_names(run)["head_service"]
    _schedule(pod_spec, config, config.trainer_node_selector, res.node_selector,
              config.trainer_tolerations, config.trainer_affinity)
    if run.spec.active_deadline_seconds:
        pod_spec["activeDeadlineSeconds"] = run.spec.active_deadline_seconds
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(run, trainer_pod_name(name, incarnation, rank), labels),
        "spec": pod_spec,
    }


def build_trainer_gang(run: TrainingRun, config: OperatorConfig, incarnation: int) -> list[Manifest]:
    """All pods of one gang incarnation, rank 0 first."""
    return [
        build_trainer_pod(run, config, incarnation, rank) for rank in range(run.spec.resources.nodes)
    ]


def build_trainer_children(run: TrainingRun, config: OperatorConfig) -> list[Manifest]:
    """The run's long-lived children, created before the first gang (order matters for RBAC)."""
    children = [*build_trainer_rbac(run), build_run_config_map(run, config)]
    if run.spec.resources.nodes > 1:
        children.append(build_head_service(run, config))
    return children


# ---------------------------------------------------------------- RolloutPool


def pool_selector(pool_name: str) -> dict[str, str]:
    return {LABEL_COMPONENT: COMPONENT_ROLLOUT, LABEL_POOL: pool_name}


def selector_string(labels: dict[str, str]) -> str:
    """The label selector in string form (the scale subresource's labelSelectorPath wants it).

    >>> selector_string({"b": "2", "a": "1"})
    'a=1,b=2'
    """
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


# Read by `posttrain run` in a trainer pod when spec.rollout.endpoints is empty.
ROLLOUT_ENDPOINTS_ENV = "POSTTRAIN_ROLLOUT_ENDPOINTS"


def pool_endpoint(pool: RolloutPool) -> str:
    """In-cluster base URL of the pool's Service."""
    return f"http://{pool.metadata.name}.{pool.metadata.namespace}.svc:{pool.spec.port}"


def rollout_command(pool: RolloutPool) -> list[str]:
    """The server argv: ``vllm serve`` flags from engine_args, or ``posttrain serve`` for cpu."""
    spec = pool.spec
    served = spec.served_model_name or pool.metadata.name
    if spec.engine == "cpu":
        return [
            "posttrain", "serve", "--model", spec.model, "--host", "0.0.0.0",
            "--port", str(spec.port), "--served-model-name", served,
        ]  # fmt: skip
    from posttrain.rollout.vllm import VllmServeSpec, build_vllm_command

    serve_spec = VllmServeSpec.from_engine_args(
        spec.model, spec.engine_args, port=spec.port, served_model_name=served
    )
    return build_vllm_command(serve_spec)


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
    env: list[dict[str, Any]] = [{"name": "POSTTRAIN_POOL_NAME", "value": name}]
    if config.s3_endpoint:
        env += _s3_env(config)
    if spec.weight_update.source_uri:
        env += [
            {"name": "POSTTRAIN_WEIGHTS_URI", "value": spec.weight_update.source_uri},
            {"name": "POSTTRAIN_WEIGHTS_POLL_SECONDS", "value": str(spec.weight_update.poll_seconds)},
        ]
    gpus = spec.resources.gpus if spec.engine == "vllm" else 0
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": rollout_command(pool),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port}],
        "resources": _resources(spec.resources.cpu, spec.resources.memory, gpus),
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
    if gpus:
        pod_spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        container["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    _schedule(pod_spec, config, config.rollout_node_selector, spec.resources.node_selector,
              config.rollout_tolerations, config.rollout_affinity)
    template = {"metadata": {"labels": {**MANAGED_BY, **labels}}, "spec": pod_spec}
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


# ---------------------------------------------------------------- SandboxTask


def sandbox_pod_name(task_name: str, attempt: int) -> str:
    """``<task>-<attempt>``, attempts counted from 1.

    >>> sandbox_pod_name("t", 2)
    't-2'
    """
    return f"{task_name}-{attempt}"


def _check_file_name(name: str) -> str:
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


def build_sandbox_pod(task: SandboxTask, config: OperatorConfig, attempt: int) -> Manifest:
    """An isolated, Guaranteed-QoS pod for one attempt of ``task``.

    Files travel in pod annotations and reach the program through a downward-API volume
    copied into the writable workdir by an init container: no ConfigMap per task, so a
    burst of tasks costs one create per task. The program ends by writing a JSON result
    {"exit_code", "reward", "duration_ms", "reason"} to /dev/termination-log; without one
    the operator scores by exit code.
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
            _check_file_name(file_name)
        key = f"{ANNOTATION_FILE_PREFIX}{index}"
        annotations[key] = content
        items.append({"path": file_name, "fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}})
    command = list(spec.command) or ["python", "main.py"]
    if spec.stdin is not None:
        # Pods have no stdin pipe; the shell redirects the stdin file into the program.
        command = ["sh", "-c", f'exec "$@" < {SANDBOX_WORKDIR}/{SANDBOX_STDIN_FILE}', "sandbox",
                   *command]
    restricted = {
        "runAsNonRoot": True,
        "runAsUser": NOBODY_UID,
        "runAsGroup": NOBODY_UID,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    res = spec.resources
    workdir_mount = {"name": "workdir", "mountPath": SANDBOX_WORKDIR}
    containers = [
        {
            "name": "sandbox",
            "image": spec.image or config.sandbox_image,
            "imagePullPolicy": config.image_pull_policy,
            "command": command,
            "workingDir": SANDBOX_WORKDIR,
            "env": [
                {"name": "HOME", "value": SANDBOX_WORKDIR},
                {"name": "TMPDIR", "value": SANDBOX_WORKDIR},
                {"name": "POSTTRAIN_SANDBOX_TASK", "value": name},
                {"name": "POSTTRAIN_SANDBOX_ATTEMPT", "value": str(attempt)},
            ],
            "resources": _resources(res.cpu, res.memory, ephemeral_storage=res.ephemeral_storage),
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
                "command": ["cp", "-rL", *(f"{SANDBOX_FILES_DIR}/{t}" for t in top_level),
                            SANDBOX_WORKDIR + "/"],
                "resources": _resources("100m", "32Mi", ephemeral_storage="16Mi"),
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
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": NOBODY_UID,
            "runAsGroup": NOBODY_UID,
            "fsGroup": NOBODY_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": containers,
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    runtime_class = spec.runtime_class_name or config.sandbox_runtime_class_name
    if runtime_class:
        pod_spec["runtimeClassName"] = runtime_class
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [dict(s) for s in config.image_pull_secrets]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(task, sandbox_pod_name(name, attempt), labels, annotations),
        "spec": pod_spec,
    }


def build_sandbox_network_policy(namespace: str) -> Manifest:
    """One default-deny NetworkPolicy per namespace for every sandbox pod with network=none.

    It selects by label, so it is created once per namespace (not per task) and has no
    owner: it outlives any single task.
    """
    return {
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
