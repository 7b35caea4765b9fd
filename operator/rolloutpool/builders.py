"""Pure builders of a RolloutPool's children: the Deployment (model fetch + server), its
Service, its NetworkPolicy and the weights token Secret; plus what a run needs to call a
pool (endpoint, serving dtype, the token env) and the pool's replicas as native sidecars of
another pod (a trainer's, ``rollout.colocated``: :func:`colocated_replicas`).

Replica pods pass Pod Security "restricted" (docs/rollout.md, "Pod security"): they run as
the images' posttrain user on a read-only root and write only to their emptyDirs.
"""

from __future__ import annotations

import json
from typing import Any

from posttrain.api import RolloutPool
from posttrain.api.env import WEIGHTS_SCRATCH, WEIGHTS_TOKEN, RolloutPoolEnv
from posttrain.api.labels import (
    ANNOTATION_SPEC_HASH,
    COMPONENT_ROLLOUT,
    LABEL_COMPONENT,
    LABEL_POOL,
    MANAGED_BY,
    POOL_CLIENT_PREFIX,
)
from posttrain.api.modelref import PVC_MODEL_VOLUME

from ..config import OperatorConfig
from ..shared.builders import (
    POSTTRAIN_UID,
    Manifest,
    child_metadata,
    hf_model_env,
    mount_model_claim,
    otlp_env,
    resources,
    restricted_container_context,
    restricted_pod_context,
    s3_env,
    schedule,
    scrape_annotations,
    spec_hash,
)


def pool_selector(pool_name: str) -> dict[str, str]:
    return {LABEL_COMPONENT: COMPONENT_ROLLOUT, LABEL_POOL: pool_name}


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
# Hugging Face cache is on it too (the link points into it). The cpu engine's server resolves
# the model itself, onto the same volume ($POSTTRAIN_CACHE: a packaged model is converted
# there, an s3:// or hf:// one downloaded).
MODEL_VOLUME = "models"
MODEL_MOUNT = "/models"
MODEL_LINK = f"{MODEL_MOUNT}/current"
POOL_HF_HOME = f"{MODEL_MOUNT}/huggingface"


# Where a vLLM replica stages weight updates (POSTTRAIN_WEIGHTS_SCRATCH), a sized emptyDir.
WEIGHTS_SCRATCH_VOLUME = "weights-scratch"
WEIGHTS_SCRATCH_MOUNT = "/var/lib/posttrain/weights"
WEIGHTS_SCRATCH_ENV = WEIGHTS_SCRATCH

# vLLM's shared memory (a Memory emptyDir). A trainer pod mounts its own at the same place
# under the same name, which is what colocated replicas share with it.
SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"

# The root file system is read-only; what else the servers write goes to two emptyDirs:
# /tmp (Python's tempfile: the cpu engine's weight staging, vLLM's ZMQ IPC sockets, torch
# inductor's compiled kernels) and $HOME (vLLM's compile cache and usage file under
# ~/.cache/vllm and ~/.config/vllm, Triton's ~/.triton and CUDA's ~/.nv on GPUs). HOME is
# the images' home of POSTTRAIN_UID, made explicit so any image gets a writable one.
TMP_VOLUME = "tmp"
HOME_VOLUME = "home"
POOL_HOME = "/home/posttrain"


def model_fetch_command(pool: RolloutPool) -> list[str]:
    """The init step that puts spec.model on the pod's volume (fails naming the URI)."""
    return ["posttrain", "rollout", "fetch-model", "--model", pool.spec.model, "--link", MODEL_LINK]


def rollout_command(
    pool: RolloutPool, host: str = "$(POD_IP)", port: int | None = None
) -> list[str]:
    """The server argv: vLLM behind posttrain's front door, or ``posttrain serve`` for cpu,
    listening on ``host``:``port`` (default: the pod IP and ``spec.port``).

    The front door (``posttrain rollout vllm-entry``) is the entrypoint, not ``vllm serve``:
    it serves the pod's port, stamps each response with its weight version, loads weights
    on ``/v1/weights/load`` and pulls the latest committed version before it reports ready.
    vLLM itself listens on 127.0.0.1 at a free port (``--internal-port 0``), so its
    dev-mode ``/collective_rpc`` is unreachable from other pods.
    """
    spec = pool.spec
    served = spec.served_model_name or pool.metadata.name
    port = spec.port if port is None else port
    if spec.engine == "cpu":
        # Bind the pod IP, not 0.0.0.0: probes and the Service reach the pod IP either way, and
        # on a node whose pods share the host network (the dev node agent) replicas then do
        # not fight over one port.
        return [
            "posttrain", "serve", "--model", spec.model, "--host", host,
            "--port", str(port), "--served-model-name", served,
        ]  # fmt: skip
    engine_args = spec.engine_args.model_dump(mode="json", exclude_none=True)
    return [
        "posttrain", "rollout", "vllm-entry", "--model", MODEL_LINK,
        "--host", host, "--port", str(port), "--internal-port", "0",
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
    pod_spec = replica_pod_spec(pool, config)
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


def replica_pod_spec(
    pool: RolloutPool,
    config: OperatorConfig,
    *,
    host: str = "$(POD_IP)",
    port: int | None = None,
    registry: str | None = None,
) -> dict[str, Any]:
    """One replica's pod spec before placement: the server with its probes, the model step,
    the volumes and Pod Security "restricted". The Deployment's template, and (renamed) each
    sidecar of :func:`colocated_replicas`.

    ``host``/``port``: where the server listens (default the pod IP and ``spec.port``).
    ``registry``: pull on join from this weight registry instead of
    ``spec.weightUpdate.sourceUri``, without polling (the colocated replicas' trainer loads
    every version onto them itself).
    """
    spec = pool.spec
    image = spec.image or (config.rollout_cpu_image if spec.engine == "cpu" else config.vllm_image)
    env = _rollout_env(pool, config, registry)
    container = _server_container(pool, config, image, env, host, port)
    pod_spec: dict[str, Any] = {"containers": [container]}
    _stage_model(pool, config, image, env, pod_spec)
    mount_model_claim(
        spec.model, pod_spec, [container, *pod_spec.get("initContainers", [])]
    )  # the fetch-model step links /models/current into the claim: both need it
    _run_restricted(pod_spec)
    if _server_gpus(pool) or spec.engine == "vllm":
        # vLLM's engine core talks to its workers through shared memory (160 MiB of ring
        # buffers on CPU too) and the runtime's /dev/shm is 64 MiB: memory-backed, counted
        # against the pod's memory limit, which sizes it.
        pod_spec.setdefault("volumes", []).append(
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}
        )
        container.setdefault("volumeMounts", []).append(
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT}
        )
    return pod_spec


def _run_restricted(pod_spec: dict[str, Any]) -> None:
    """Pod Security "restricted" for every container of a replica: POSTTRAIN_UID (the
    images' own user, so files the images hold stay readable), no capability, no privilege
    escalation, RuntimeDefault seccomp and a read-only root, with /tmp and $HOME on emptyDirs
    (the model, the weight staging and /dev/shm already are)."""
    pod_spec["securityContext"] = restricted_pod_context(POSTTRAIN_UID)
    pod_spec.setdefault("volumes", []).extend(
        [{"name": TMP_VOLUME, "emptyDir": {}}, {"name": HOME_VOLUME, "emptyDir": {}}]
    )
    for container in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        container["securityContext"] = restricted_container_context(POSTTRAIN_UID)
        container["env"] = [*container.get("env", []), {"name": "HOME", "value": POOL_HOME}]
        container.setdefault("volumeMounts", []).extend([
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
            {"name": HOME_VOLUME, "mountPath": POOL_HOME},
        ])  # fmt: skip


def _rollout_env(
    pool: RolloutPool, config: OperatorConfig, registry: str | None = None
) -> list[dict[str, Any]]:
    """The server's environment: the pool contract, its pod IP, the weights token, S3 and
    telemetry.

    Trainers publish weights to S3 and ask every replica to load them (POST
    /v1/weights/load with an s3:// URI), so replicas need the S3 endpoint and credentials
    even when they do not poll a weight source themselves. ``registry`` replaces the
    pool's weight source (pull on join only): see :func:`replica_pod_spec`.
    """
    spec = pool.spec
    polls = bool(spec.weight_update.source_uri) and registry is None
    contract = RolloutPoolEnv(
        pool_name=pool.metadata.name,
        weights_uri=registry or (spec.weight_update.source_uri if polls else None),
        weights_poll_seconds=spec.weight_update.poll_seconds if polls else None,
    )
    env: list[dict[str, Any]] = [
        *contract.to_env(),
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Only the token's holders may load weights (the reconciler creates the Secret first).
        weights_token_env(pool.metadata.name, optional=False),
    ]
    if config.s3_endpoint:
        env += s3_env(config)
    return env + otlp_env(config, "posttrain-rollout", pool)


def _server_gpus(pool: RolloutPool) -> int:
    return pool.spec.resources.gpus if pool.spec.engine == "vllm" else 0


def _server_container(
    pool: RolloutPool,
    config: OperatorConfig,
    image: str,
    env: list[dict[str, Any]],
    host: str = "$(POD_IP)",
    port: int | None = None,
) -> dict[str, Any]:
    """The OpenAI-compatible server with its /health readiness and startup probes."""
    spec = pool.spec
    return {
        "name": "server",
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": rollout_command(pool, host, port),
        "env": env,
        "ports": [{"name": "http", "containerPort": spec.port if port is None else port}],
        # A replica that exits (bad weights, a model that will not load) leaves its last
        # log lines as the termination message the pool's status reports.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": resources(spec.resources.cpu, spec.resources.memory, _server_gpus(pool)),
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


def _stage_model(
    pool: RolloutPool,
    config: OperatorConfig,
    image: str,
    env: list[dict[str, Any]],
    pod_spec: dict[str, Any],
) -> None:
    """Where the model comes from: vLLM gets a fetch-model init container and a bounded
    weights scratch volume; the cpu server resolves spec.model itself onto the model volume.
    """
    spec = pool.spec
    container = pod_spec["containers"][0]
    # An hf:// model: the Hub, the cache and the token for whichever container downloads it.
    hf_env = hf_model_env(spec.model, POOL_HF_HOME, spec.hf_token_secret)
    mount = {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT}
    model_env = [*env, *RolloutPoolEnv(cache=MODEL_MOUNT).to_env()]
    if spec.engine != "vllm":
        container["env"] = [*model_env, *hf_env]
        container["volumeMounts"] = [mount]
        pod_spec["volumes"] = [{"name": MODEL_VOLUME, "emptyDir": {}}]
        return
    # Weight updates are staged on a declared volume, not in the container's /tmp: its
    # sizeLimit and the container's ephemeral-storage bound what a replica may write, so
    # an oversized update evicts that replica instead of filling the node's disk.
    container["env"] = [*model_env, {"name": WEIGHTS_SCRATCH_ENV, "value": WEIGHTS_SCRATCH_MOUNT}]
    container["volumeMounts"] = [
        mount,
        {"name": WEIGHTS_SCRATCH_VOLUME, "mountPath": WEIGHTS_SCRATCH_MOUNT},
    ]
    container["resources"] = resources(
        spec.resources.cpu,
        spec.resources.memory,
        _server_gpus(pool),
        ephemeral_storage=spec.resources.ephemeral_storage,
    )
    pod_spec["volumes"] = [
        {"name": MODEL_VOLUME, "emptyDir": {}},
        {"name": WEIGHTS_SCRATCH_VOLUME, "emptyDir": {"sizeLimit": spec.resources.weights_scratch}},
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


COLOCATED_PREFIX = "rollout"
"""Names of the colocated sidecars (``rollout-0``, ``rollout-1``...) and of their volumes."""


def colocated_endpoints(pool: RolloutPool, replicas: int) -> list[str]:
    """The loopback URLs of :func:`colocated_replicas`: a trainer in the same pod reaches
    them there, and a loopback URL is what makes it publish through ``/dev/shm``
    (``trainer/model/weight_sync.py:all_on_this_host``).

    >>> from posttrain.api import RolloutPool
    >>> pool = RolloutPool.model_validate({"metadata": {"name": "p"},
    ...                                    "spec": {"model": "m", "port": 8000}})
    >>> colocated_endpoints(pool, 2)
    ['http://127.0.0.1:8000', 'http://127.0.0.1:8001']
    """
    return [f"http://127.0.0.1:{pool.spec.port + i}" for i in range(replicas)]


def colocated_replicas(
    pool: RolloutPool, config: OperatorConfig, replicas: int, registry: str
) -> tuple[list[Manifest], list[Manifest]]:
    """``replicas`` servers of ``pool`` for another pod (``rollout.colocated``): its
    ``initContainers`` and the volumes they need.

    Each server is the pool's own replica (:func:`replica_pod_spec`: image, command, env
    with the weight token and storage, readiness probe, restricted securityContext) as a
    native sidecar (``restartPolicy: Always``: started before the pod's containers;
    restarted in place if it exits; stopped when they end),
    named ``rollout-<i>`` and listening on ``spec.port + i`` on every interface of the pod
    (the kubelet probes the pod IP; the trainer uses 127.0.0.1). Its ``/tmp``, ``$HOME``
    and weight staging are its own (``rollout-<i>-*`` emptyDirs); the model volume, the
    vLLM engine's one ``fetch-model`` step and a ``pvc://`` claim are shared by all (the
    model is the same). Every server mounts the host pod's ``/dev/shm`` volume
    (:data:`SHM_VOLUME`), which the host pod must have: that is where the trainer's weight
    versions are. ``registry``: the trainer's weight registry, pulled on join by a server
    that restarts.

    No startup probe: the kubelet starts a sidecar only once the one before it passed its
    startup probe, so N servers with one would load their model one after another (N model
    loads before the trainer even starts). Without it they all start at once, beside the
    trainer, which waits for every endpoint's ``/health`` itself (up to
    ``rollout.timeoutSeconds``, then it fails saying which is down); nothing else needs it
    (a server has no liveness probe to hold off while it loads).
    """
    init_containers: list[Manifest] = []
    volumes: list[Manifest] = []
    for i in range(replicas):
        port = pool.spec.port + i
        spec = replica_pod_spec(pool, config, host="0.0.0.0", port=port, registry=registry)
        own = f"{COLOCATED_PREFIX}-{i}"
        names: dict[str, str] = {SHM_VOLUME: SHM_VOLUME}  # the host pod's
        for volume in spec["volumes"]:
            name = volume["name"]
            if name == SHM_VOLUME:
                continue
            shared = name in (MODEL_VOLUME, PVC_MODEL_VOLUME)
            names[name] = f"{COLOCATED_PREFIX}-{name}" if shared else f"{own}-{name}"
            if i == 0 or not shared:
                volumes.append({**volume, "name": names[name]})
        if i == 0:  # fetch-model: once, onto the shared model volume, before any server
            for step in spec.get("initContainers", []):
                init_containers.append(_renamed(step, f"{COLOCATED_PREFIX}-{step['name']}", names))
        (server,) = spec["containers"]
        sidecar = _renamed(server, own, names)
        sidecar["restartPolicy"] = "Always"
        sidecar["ports"] = [{"name": own, "containerPort": port}]
        sidecar.pop("startupProbe", None)
        probe = sidecar["readinessProbe"]
        sidecar["readinessProbe"] = {**probe, "httpGet": {**probe["httpGet"], "port": own}}
        if not any(m["mountPath"] == SHM_MOUNT for m in sidecar["volumeMounts"]):
            sidecar["volumeMounts"].append({"name": SHM_VOLUME, "mountPath": SHM_MOUNT})
        init_containers.append(sidecar)
    return init_containers, volumes


def _renamed(container: Manifest, name: str, volumes: dict[str, str]) -> Manifest:
    """``container`` named ``name``, its mounts following the volumes' new names."""
    mounts = [{**m, "name": volumes[m["name"]]} for m in container.get("volumeMounts", [])]
    return {**container, "name": name, "volumeMounts": mounts}


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
