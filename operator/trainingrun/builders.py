"""Pure builders of a TrainingRun's children: the trainer pod (and its gang), run.yaml's
ConfigMap, the trainer's RBAC, the headless head Service, the NCCL/S3 env, and
:func:`build_trainer_children` (every long-lived child, assembled from this module, the
sandbox runner's and the evaluator's).

Names are deterministic (``<run>-g<incarnation>-<rank>``) so a restarted operator adopts
what it already created instead of duplicating it.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Sequence
from typing import Any

import yaml

from posttrain.api import GROUP, RolloutPool, TrainingRun, TrainingRunSpec
from posttrain.api.env import TrainerEnv
from posttrain.api.labels import (
    COMPONENT_TRAINER,
    LABEL_COLOCATED_ROLLOUT,
    LABEL_COMPONENT,
    LABEL_GANG,
    LABEL_RANK,
    LABEL_RUN,
    POOL_CLIENT_PREFIX,
)

from ..config import OperatorConfig
from ..rbac import CREATE_ONLY_RESOURCES, TRAINER_RULES
from ..rolloutpool.builders import (
    SHM_MOUNT,
    SHM_VOLUME,
    colocated_endpoints,
    colocated_replicas,
    pool_serving_dtype,
    weights_token_env,
)
from ..shared.builders import (
    METRICS_PORT_NAME,
    WORKSPACE_HF_HOME,
    BuildError,
    Manifest,
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
from . import evaluator, sandbox_runner
from .names import (
    RUN_CONFIG_KEY,
    RUN_CONFIG_PATH,
    resume_source_uri,
    run_storage_uri,
    trainer_names,
    trainer_pod_name,
)


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

    >>> from posttrain.operator.trainingrun.names import _example_run
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

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> run.spec.resources.nccl = {"NCCL_DEBUG": "INFO"}
    >>> nccl_env(run, OperatorConfig(trainer_nccl={"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "1"}))
    [{'name': 'NCCL_DEBUG', 'value': 'INFO'}, {'name': 'NCCL_IB_DISABLE', 'value': '1'}]
    """
    merged = {**config.trainer_nccl, **run.spec.resources.nccl}
    return [{"name": key, "value": merged[key]} for key in sorted(merged)]


def build_trainer_pod(
    run: TrainingRun,
    config: OperatorConfig,
    incarnation: int,
    rank: int,
    rollout_endpoints: Sequence[str] = (),
    head_host: str | None = None,
    rollout_dtype: str | None = None,
    colocated_pool: RolloutPool | None = None,
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
    ``colocated_pool`` (required with ``spec.rollout.colocated``): the template of the
    sidecar replicas the trainer samples from on loopback (:func:`add_colocated_replicas`).
    """
    name = run.metadata.name
    nodes = run.spec.resources.nodes
    on_ray = head_host is not None and nodes > 1
    head = head_host or f"{trainer_names(run)['head_service']}.{run.metadata.namespace}.svc"
    serves_metrics = bool(config.pod_metrics_port) and (nodes == 1 or rank == 0)
    command = _trainer_command(
        config, rank, head if on_ray else None, serves_metrics, ray_num_cpus(run)
    )
    template = _template_pool(run, colocated_pool)  # None unless rollout.colocated
    if template is not None:  # the pod's own replicas: their loopback URLs and dtype
        rollout_endpoints, rollout_dtype = _colocated_contract(run, template)
    env = _trainer_env(
        run, config, incarnation, rank, head, on_ray, rollout_endpoints, rollout_dtype
    )
    pod_spec = _trainer_pod_spec(run, config, command, env)
    if template is not None:
        add_colocated_replicas(run, config, template, pod_spec)
    if nodes > 1:
        # Stable DNS for each rank through the headless Service.
        pod_spec["hostname"] = f"rank-{rank}"
        pod_spec["subdomain"] = trainer_names(run)["head_service"]
    schedule(
        pod_spec,
        config,
        config.trainer_node_selector,
        run.spec.resources.node_selector,
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
    labels = _trainer_pod_labels(run, incarnation, rank, colocated=template is not None)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": child_metadata(
            run, trainer_pod_name(name, incarnation, rank), labels, annotations=annotations
        ),
        "spec": pod_spec,
    }


def _trainer_pod_labels(
    run: TrainingRun, incarnation: int, rank: int, *, colocated: bool
) -> dict[str, str]:
    """A trainer pod's labels: its run, rank and gang, the client labels of the pools it
    calls, and with colocated replicas the label their NetworkPolicy selects."""
    labels = {
        LABEL_COMPONENT: COMPONENT_TRAINER,
        LABEL_RUN: run.metadata.name,
        LABEL_RANK: str(rank),
        LABEL_GANG: str(incarnation),
        **pool_client_labels(run),
    }
    if colocated:
        labels[LABEL_COLOCATED_ROLLOUT] = "true"
    return labels


def _trainer_command(
    config: OperatorConfig, rank: int, ray_head: str | None, serves_metrics: bool, num_cpus: int
) -> list[str]:
    """``posttrain run`` (torchrun's agent); on a RayCluster (``ray_head``), the head starts
    Ray's GCS first and the workers run ``ray start`` instead, each declaring ``num_cpus``."""
    train = ["posttrain", "run", RUN_CONFIG_PATH, "--out", "/workspace"]
    if serves_metrics:  # rank 0's pod (on a RayCluster, Ray workers run `ray start`)
        train += ["--metrics-port", str(config.pod_metrics_port)]
    if ray_head is None:
        return train
    if rank == 0:
        # The head runs Ray's GCS and then the trainer, which drives the workers through Ray.
        return [
            "sh", "-c",
            f"ray start --head --port={config.ray_port} --num-cpus={num_cpus} "
            "--disable-usage-stats && exec " + " ".join(train),
        ]  # fmt: skip
    return ["ray", "start", f"--address={ray_head}:{config.ray_port}",
            f"--num-cpus={num_cpus}", "--block"]  # fmt: skip


def ray_num_cpus(run: TrainingRun) -> int:
    """The CPUs a Ray node of the run declares: the pod's CPU rounded up, and at least one
    per rank on the node (Ray Train asks one CPU per rank worker).

    Passed explicitly, as KubeRay's own generated start command does: left to itself Ray
    truncates a fractional cgroup quota, so a ``500m`` pod would declare 0 CPUs and the
    rank workers would wait for resources that never come.

    >>> from posttrain.operator.trainingrun.names import _example_run
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


def _trainer_env(
    run: TrainingRun,
    config: OperatorConfig,
    incarnation: int,
    rank: int,
    head: str,
    on_ray: bool,
    rollout_endpoints: Sequence[str],
    rollout_dtype: str | None,
) -> list[dict[str, Any]]:
    """The trainer's environment: the operator→trainer contract, storage, telemetry, model,
    NCCL, the pool's weights token and the judges' API keys."""
    nodes = run.spec.resources.nodes
    # spec.rollout.pool resolved by the operator: the Service URL as a fallback, and the
    # pool's name, whose status.replicaEndpoints the trainer follows (its Role may get that
    # one pool) so each weight version reaches every ready replica. Colocated replicas are
    # the pod's own: their loopback URLs, nothing to follow.
    resolved_pool = bool(rollout_endpoints) and not run.spec.rollout.endpoints
    follows_pool = resolved_pool and run.spec.rollout.colocated is None
    contract = TrainerEnv(
        run_name=run.metadata.name,
        run_namespace=run.metadata.namespace,
        run_uid=run.metadata.uid,
        master_addr=head if nodes > 1 else "127.0.0.1",
        master_port=config.trainer_master_port,
        world_size=nodes,
        rank=rank,
        node_rank=rank,
        gang=incarnation,
        sandbox_runner_url=sandbox_runner.own_runner_url(run),
        rollout_endpoints=list(rollout_endpoints) if resolved_pool else [],
        rollout_pool=run.spec.rollout.pool if follows_pool else None,
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
    return env + scorer_key_env(run.spec)  # judges' and reward models' API keys


def _trainer_pod_spec(
    run: TrainingRun, config: OperatorConfig, command: list[str], env: list[dict[str, Any]]
) -> dict[str, Any]:
    """The trainer container and its volumes: run.yaml, /dev/shm, the workspace, a model
    claim when the model is a PVC; as the image's posttrain user with /tmp and HOME of its
    own (Pod Security "restricted": :func:`run_as_posttrain_user`)."""
    res = run.spec.resources
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
                    {"name": SHM_VOLUME, "mountPath": SHM_MOUNT},
                    {"name": "workspace", "mountPath": "/workspace"},
                ],
            }
        ],
        "volumes": [
            {"name": "run-config", "configMap": {"name": trainer_names(run)["config"]}},
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
            {"name": "workspace", "emptyDir": {}},
        ],
    }
    mount_model_claim(run.spec.model, pod_spec, pod_spec["containers"])
    run_as_posttrain_user(pod_spec)
    return pod_spec


def _template_pool(run: TrainingRun, pool: RolloutPool | None) -> RolloutPool | None:
    """``pool`` when it is the run's ``rollout.pool`` and the run colocates its replicas;
    None when it does not; BuildError (saying what to create) when the colocated replicas
    have no template."""
    if run.spec.rollout.colocated is None:
        return None
    if pool is None or pool.metadata.name != run.spec.rollout.pool:
        raise BuildError(
            f"rollout.colocated: the trainer pod needs RolloutPool {run.spec.rollout.pool!r} "
            f"(its replicas' template), which was not found in namespace "
            f"{run.metadata.namespace!r}; create it (replicas: 0 makes it only a template)"
        )
    return pool


def _colocated_contract(run: TrainingRun, pool: RolloutPool) -> tuple[list[str], str | None]:
    """The trainer's rollout endpoints and serving dtype with colocated replicas of ``pool``."""
    colocated = run.spec.rollout.colocated
    assert colocated is not None
    return colocated_endpoints(pool, colocated.replicas), pool_serving_dtype(pool)


def _check_colocated_ports(config: OperatorConfig, pool: RolloutPool, replicas: int) -> None:
    """BuildError when the replicas' ports (``spec.port`` and up) leave the port range or
    take one the trainer listens on in the same pod (metrics, torchrun's rendezvous)."""
    ports = range(pool.spec.port, pool.spec.port + replicas)
    taken = {"metrics": config.pod_metrics_port, "rendezvous": config.trainer_master_port}
    problems = [f"the trainer's {what} port {port}" for what, port in taken.items()
                if port in ports]  # fmt: skip
    if ports.stop - 1 > 65535:
        problems.append("ports above 65535")
    if problems:
        raise BuildError(
            f"rollout.colocated: {replicas} replica(s) of RolloutPool {pool.metadata.name!r} "
            f"would listen on ports {ports.start}-{ports.stop - 1}, which includes "
            f"{' and '.join(problems)}; give the pool another spec.port"
        )


def add_colocated_replicas(
    run: TrainingRun, config: OperatorConfig, pool: RolloutPool, pod_spec: Manifest
) -> None:
    """``spec.rollout.colocated``: ``replicas`` servers of ``pool`` as native sidecars of the
    trainer pod (:func:`colocated_replicas`), sharing its ``/dev/shm`` (sized by
    ``shmSizeLimit`` when given). Each version the trainer publishes is then one file there
    that every server reads in place; a server that restarts pulls the latest version
    committed to the run's weight registry (``<storage>/weights``) before it is ready.

    Added after the trainer's own securityContext: the servers keep the pool's (a read-only
    root, their own ``/tmp`` and ``$HOME``), as in the pool's Deployment.
    """
    colocated = run.spec.rollout.colocated
    assert colocated is not None
    _check_colocated_ports(config, pool, colocated.replicas)
    registry = f"{run_storage_uri(run, config).rstrip('/')}/weights"
    sidecars, volumes = colocated_replicas(pool, config, colocated.replicas, registry)
    pod_spec["initContainers"] = [*pod_spec.get("initContainers", []), *sidecars]
    pod_spec["volumes"] = [*pod_spec["volumes"], *volumes]
    if colocated.shm_size_limit:
        for volume in pod_spec["volumes"]:
            if volume["name"] == SHM_VOLUME:
                volume["emptyDir"] = {**volume["emptyDir"], "sizeLimit": colocated.shm_size_limit}


def build_colocated_network_policy(run: TrainingRun, config: OperatorConfig) -> Manifest:
    """Who may reach a trainer pod that runs colocated replicas: only its metrics port (the
    one port a one-node trainer serves), from anywhere a scraper may be. The servers in the
    pod listen on every interface (the kubelet probes the pod IP) but only the trainer,
    over loopback, has any business with them; a RolloutPool's own replicas have their
    pool's NetworkPolicy for the same reason. Traffic from the node (probes) and loopback
    are not subject to NetworkPolicy. It selects the pods by
    :data:`LABEL_COLOCATED_ROLLOUT`, so it is inert for a later gang without replicas.

    >>> from posttrain.operator.config import OperatorConfig
    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> policy = build_colocated_network_policy(_example_run(), OperatorConfig())
    >>> policy["spec"]["ingress"], sorted(policy["spec"]["podSelector"]["matchLabels"])
    ([{'ports': [{'port': 9090}]}], ['posttrain.io/colocated-rollout', 'posttrain.io/component', 'posttrain.io/run'])
    """
    name = run.metadata.name
    owner_labels = {LABEL_COMPONENT: COMPONENT_TRAINER, LABEL_RUN: name}
    selector = {**owner_labels, LABEL_COLOCATED_ROLLOUT: "true"}
    ports = [{"port": config.pod_metrics_port}] if config.pod_metrics_port else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(run, trainer_names(run)["colocated_policy"], owner_labels),
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": ports}] if ports else [],
        },
    }


def build_trainer_gang(
    run: TrainingRun,
    config: OperatorConfig,
    incarnation: int,
    colocated_pool: RolloutPool | None = None,
) -> list[Manifest]:
    """All pods of one gang incarnation, rank 0 first."""
    return [
        build_trainer_pod(run, config, incarnation, rank, colocated_pool=colocated_pool)
        for rank in range(run.spec.resources.nodes)
    ]


def trainer_pools(spec: TrainingRunSpec) -> list[str]:
    """RolloutPools whose replicas the trainer reads: the rollout pool (unless explicit
    endpoints or colocated replicas replace it), then the judges' and reward models' pools,
    each once. What the trainer's Role may read, the pools' NetworkPolicies admit and the
    autoscaler takes demand for.

    >>> from posttrain.api import TrainingRunSpec
    >>> judge = {"kind": "judge", "judge": {"pool": "judge", "rubric": "{answer}"}}
    >>> trainer_pools(TrainingRunSpec.model_validate({"model": "m", "rollout": {"pool": "p"},
    ...     "domains": [{"name": "d", "dataset": "builtin:arithmetic", "verifier": judge}]}))
    ['p', 'judge']
    """
    rollout = spec.rollout
    own = not rollout.endpoints and rollout.colocated is None
    pools = [rollout.pool] if rollout.pool and own else []
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


def build_trainer_children(
    run: TrainingRun, config: OperatorConfig, incarnation: int, ray_cluster: bool = False
) -> list[Manifest]:
    """The run's long-lived children, created before the first gang (order matters for RBAC):
    RBAC, the run's ConfigMap, the head Service (selecting gang ``incarnation``), the
    NetworkPolicy of a trainer pod with colocated replicas, the sandbox runner (mode runner
    without runnerUrl) and the evaluator Job (``evaluation.inline: false``).

    With a RayCluster (``ray_cluster``) KubeRay makes the head Service, so ours is not needed.
    """
    children = [*build_trainer_rbac(run), build_run_config_map(run, config)]
    if run.spec.resources.nodes > 1 and not ray_cluster:
        children.append(build_head_service(run, config, incarnation))
    if run.spec.rollout.colocated is not None:
        children.append(build_colocated_network_policy(run, config))
    return [
        *children,
        *sandbox_runner.build_runner_children(run, config),
        *evaluator.build_evaluator_children(run, config),
    ]


def pool_client_labels(run: TrainingRun) -> dict[str, str]:
    """``client.posttrain.io/<pool>: "true"`` for each pool the run's pods call (judges'
    included): those pools' NetworkPolicies admit them.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> run = _example_run()
    >>> pool_client_labels(run)
    {}
    >>> run.spec.rollout.pool = "gen"
    >>> pool_client_labels(run)
    {'client.posttrain.io/gen': 'true'}
    """
    return {f"{POOL_CLIENT_PREFIX}{pool}": "true" for pool in trainer_pools(run.spec)}
