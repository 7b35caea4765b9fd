"""Builders are pure: check every security- and scheduling-relevant field without a cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from posttrain.api import RolloutPool, SandboxTask, TrainingRun
from posttrain.api import env as env_names
from posttrain.api import labels as api_labels
from posttrain.errors import UsageError
from posttrain.operator.config import OperatorConfig, load_config
from posttrain.operator.rbac import (
    LEADER_ELECTION_RULES,
    OPERATOR_RULES,
    TRAINER_RULES,
    rbac_yaml,
)
from posttrain.operator.rolloutpool import builders as b
from posttrain.operator.sandboxtask import builders as sandbox_builders
from posttrain.operator.shared import builders as shared_builders
from posttrain.operator.shared import sandbox as sandbox_shared
from posttrain.operator.trainingrun import builders as run_builders
from posttrain.operator.trainingrun import names as run_names
from posttrain.operator.trainingrun import raycluster
from posttrain.operator.trainingrun.builders import build_trainer_children

CONFIG = OperatorConfig(
    s3_endpoint="minio.storage:9000",
    s3_credentials_secret="s3-creds",
    trainer_image="trainer:1",
    vllm_image="vllm:1",
    rollout_cpu_image="cpu:1",
)


# What restricted pods of posttrain's images carry at the pod level (RolloutPool replicas,
# TrainingRun pods), spelled out here rather than read from the builders.
POSTTRAIN_POD_CONTEXT = {
    "runAsNonRoot": True,
    "runAsUser": shared_builders.POSTTRAIN_UID,
    "runAsGroup": shared_builders.POSTTRAIN_UID,
    "fsGroup": shared_builders.POSTTRAIN_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def make_run(**spec: Any) -> TrainingRun:
    return TrainingRun.model_validate(
        {
            "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-run", "generation": 1},
            "spec": {
                "model": "smollm2-135m-instruct",
                "domains": [
                    {"name": "math", "dataset": "builtin:arith", "verifier": {"kind": "numeric"}}
                ],
                **spec,
            },
        }
    )


def make_task(**spec: Any) -> SandboxTask:
    return SandboxTask.model_validate(
        {
            "metadata": {"name": "t", "namespace": "ml", "uid": "uid-task"},
            "spec": {"command": ["python", "main.py"], **spec},
        }
    )


def make_pool(**spec: Any) -> RolloutPool:
    return RolloutPool.model_validate(
        {
            "metadata": {"name": "pool", "namespace": "ml", "uid": "uid-pool"},
            "spec": {"model": "Qwen/Qwen3-0.6B", **spec},
        }
    )


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


def test_sandbox_pod_is_locked_down() -> None:
    pod = sandbox_builders.build_sandbox_pod(
        make_task(runtimeClassName="gvisor", timeoutSeconds=30), CONFIG, 2
    )
    assert pod["metadata"]["name"] == "t-2"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-task"
    spec = pod["spec"]
    assert spec["runtimeClassName"] == "gvisor"
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 30
    (main,) = spec["containers"]
    sc = main["securityContext"]
    assert sc == {
        "runAsNonRoot": True,
        "runAsUser": 65534,
        "runAsGroup": 65534,
        "readOnlyRootFilesystem": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    res = main["resources"]
    assert (
        res["requests"]
        == res["limits"]
        == {"cpu": "1", "memory": "512Mi", "ephemeral-storage": "1Gi"}
    )
    assert main["terminationMessagePath"] == "/dev/termination-log"
    assert main["terminationMessagePolicy"] == "FallbackToLogsOnError"
    workdir = next(v for v in spec["volumes"] if v["name"] == "workdir")
    assert workdir["emptyDir"]["sizeLimit"] == CONFIG.sandbox_workdir_size
    assert pod["metadata"]["labels"][api_labels.LABEL_SANDBOX_NETWORK] == "none"
    assert "initContainers" not in spec  # no files, nothing to copy


def test_sandbox_files_travel_in_annotations_and_init_copy() -> None:
    task = make_task(
        files={"main.py": "print(1)", "tests/test_a.py": "def test(): pass"},
        stdin="5\n",
        network="egress",
    )
    pod = sandbox_builders.build_sandbox_pod(task, CONFIG, 1)
    annotations = pod["metadata"]["annotations"]
    assert sorted(annotations.values()) == ["5\n", "def test(): pass", "print(1)"]
    items = next(v for v in pod["spec"]["volumes"] if v["name"] == "files")["downwardAPI"]["items"]
    assert sorted(i["path"] for i in items) == [".stdin", "main.py", "tests/test_a.py"]
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][:2] == ["cp", "-rL"]
    assert "/sandbox/files/tests" in init["command"] and "/sandbox/files/main.py" in init["command"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    # stdin is redirected from the copied file, the program's argv kept verbatim.
    assert pod["spec"]["containers"][0]["command"][-2:] == ["python", "main.py"]
    assert "< /workspace/.stdin" in pod["spec"]["containers"][0]["command"][2]
    assert pod["metadata"]["labels"][api_labels.LABEL_SANDBOX_NETWORK] == "egress"


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape.py", "a/../../b", ".hidden", "a//b"])
def test_sandbox_rejects_unsafe_file_names(bad: str) -> None:
    with pytest.raises(shared_builders.BuildError, match="plain relative path"):
        sandbox_builders.build_sandbox_pod(make_task(files={bad: "x"}), CONFIG, 1)


def test_network_policy_denies_all_for_sandboxes_only() -> None:
    policy = sandbox_shared.build_sandbox_network_policy("ml")
    assert policy["metadata"]["name"] == sandbox_shared.SANDBOX_NETWORK_POLICY
    assert "ownerReferences" not in policy["metadata"]  # shared by all tasks of the namespace
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        api_labels.LABEL_COMPONENT: "sandbox",
        api_labels.LABEL_SANDBOX_NETWORK: "none",
    }
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "egress" not in policy["spec"] and "ingress" not in policy["spec"]


def test_trainer_pod_gpus_shm_env_and_secrets() -> None:
    run = make_run(
        resources={
            "gpusPerNode": 8,
            "cpu": "32",
            "memory": "200Gi",
            "nodeSelector": {"pool": "h100"},
        },
        activeDeadlineSeconds=3600,
    )
    pod = run_builders.build_trainer_pod(run, CONFIG, incarnation=3, rank=0)
    assert pod["metadata"]["name"] == "demo-g3-0"
    (main,) = pod["spec"]["containers"]
    assert main["image"] == "trainer:1"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert main["resources"]["requests"]["nvidia.com/gpu"] == "8"
    env = env_of(main)
    assert {k: env[k]["value"] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")} == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "1",
        "RANK": "0",
    }
    assert env["POSTTRAIN_S3_ENDPOINT"]["value"] == "minio.storage:9000"
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key] == {
            "name": key,
            "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": key}},
        }
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": CONFIG.shm_size}
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["activeDeadlineSeconds"] == 3600
    assert pod["spec"]["restartPolicy"] == "Never"


def test_only_trainers_of_the_pools_runs_get_its_weight_token() -> None:
    """The pool's token reaches the trainers of runs that name the pool (optional: a pool
    made later) and no one else; explicit endpoints get none (they are not a pool's)."""
    pooled = run_builders.build_trainer_pod(
        make_run(rollout={"pool": "gen"}), CONFIG, 0, 0, rollout_endpoints=["http://gen:8000"]
    )
    env = env_of(pooled["spec"]["containers"][0])
    assert env["POSTTRAIN_WEIGHTS_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "gen-weights-token",
        "key": "token",
        "optional": True,
    }
    assert pooled["metadata"]["labels"]["client.posttrain.io/gen"] == "true"  # its pool admits it
    explicit = run_builders.build_trainer_pod(
        make_run(rollout={"endpoints": ["http://x:8000"]}), CONFIG, 0, 0
    )
    assert "POSTTRAIN_WEIGHTS_TOKEN" not in env_of(explicit["spec"]["containers"][0])
    assert not [k for k in explicit["metadata"]["labels"] if k.startswith("client.posttrain.io/")]
    policy = b.build_pool_network_policy(make_pool(port=8123), CONFIG.model_copy(
        update={"operator_namespace": "posttrain-system"}))  # fmt: skip
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8123}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"client.posttrain.io/pool": "true"}}},
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "posttrain-system"}
            },
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
        },
    ]
    first, second = b.build_pool_token_secret(make_pool()), b.build_pool_token_secret(make_pool())
    assert first["metadata"]["name"] == "pool-weights-token"
    assert first["metadata"]["ownerReferences"][0]["uid"] == "uid-pool"
    assert len(first["stringData"]["token"]) >= 40
    assert first["stringData"]["token"] != second["stringData"]["token"]  # random per pool


def test_cpu_trainer_has_no_gpu_resource() -> None:
    pod = run_builders.build_trainer_pod(make_run(), CONFIG, 0, 0)
    assert "nvidia.com/gpu" not in pod["spec"]["containers"][0]["resources"]["limits"]


def test_multi_node_gang_head_and_workers() -> None:
    run = make_run(resources={"nodes": 3})
    gang = run_builders.build_trainer_gang(run, CONFIG, incarnation=0)
    assert [p["metadata"]["name"] for p in gang] == ["demo-g0-0", "demo-g0-1", "demo-g0-2"]
    head, worker = gang[0]["spec"]["containers"][0], gang[2]["spec"]["containers"][0]
    # every node runs torchrun's agent (posttrain run); the rendezvous orders them by rank
    train = ["posttrain", "run", run_names.RUN_CONFIG_PATH, "--out", "/workspace"]
    assert head["command"][:5] == worker["command"] == train  # rank 0 also serves /metrics
    assert env_of(worker)["POSTTRAIN_NODE_RANK"]["value"] == "2"
    assert "RAY_ADDRESS" not in env_of(worker)
    assert env_of(worker)["RANK"]["value"] == "2"
    assert env_of(worker)["WORLD_SIZE"]["value"] == "3"
    assert env_of(worker)["MASTER_ADDR"]["value"] == "demo-head.ml.svc"
    service = run_builders.build_head_service(run, CONFIG, 4)
    assert service["spec"]["selector"][api_labels.LABEL_RANK] == "0"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # Only gang 4's rank 0: a terminating rank 0 of gang 3 must not resolve (it would, since
    # not-ready addresses are published).
    selector = service["spec"]["selector"]
    new_head = run_builders.build_trainer_pod(run, CONFIG, 4, 0)["metadata"]["labels"]
    old_head = run_builders.build_trainer_pod(run, CONFIG, 3, 0)["metadata"]["labels"]
    assert selector.items() <= new_head.items()
    assert not selector.items() <= old_head.items()


def test_nccl_settings_reach_every_gang_pod_run_over_chart() -> None:
    config = CONFIG.model_copy(
        update={"trainer_nccl": {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN"}}
    )
    run = make_run(resources={"nodes": 3, "nccl": {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}})
    want = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"}
    for pod in run_builders.build_trainer_gang(run, config, 0):
        env = env_of(pod["spec"]["containers"][0])
        assert {k: env[k]["value"] for k in env if k.startswith("NCCL_")} == want
    # The RayCluster path takes its pod templates from the same builder.
    cluster = raycluster.build_ray_cluster(run, config, 0)
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        env = env_of(group["template"]["spec"]["containers"][0])
        assert {k: env[k]["value"] for k in env if k.startswith("NCCL_")} == want


def test_nccl_settings_accept_only_nccl_names() -> None:
    with pytest.raises(ValidationError, match="NCCL_"):
        make_run(resources={"nccl": {"LD_PRELOAD": "/x.so"}})
    with pytest.raises(ValueError, match="NCCL_"):
        OperatorConfig(trainer_nccl={"PATH": "/x"})
    assert load_config(
        {"POSTTRAIN_OPERATOR_TRAINER_NCCL": '{"NCCL_IB_DISABLE": "1"}'}
    ).trainer_nccl == {"NCCL_IB_DISABLE": "1"}


def test_run_config_map_renders_spec_with_default_storage() -> None:
    cm = run_builders.build_run_config_map(make_run(algorithm={"maxSteps": 9}), CONFIG)
    body = yaml.safe_load(cm["data"]["run.yaml"])
    assert body["kind"] == "TrainingRun"
    assert body["spec"]["algorithm"]["maxSteps"] == 9
    # The object's own storage: a run created again under this name (another uid) starts fresh.
    assert body["spec"]["checkpoint"]["storageUri"] == "s3://posttrain/runs/ml/demo/uid-run"
    assert "resumeFrom" not in body["spec"]
    # It round-trips through the API model the trainer uses.
    assert TrainingRun.model_validate(body).spec.algorithm.max_steps == 9
    pod = run_builders.build_trainer_pod(make_run(), CONFIG, 0, 0)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[env_names.RUN_UID] == "uid-run"


def test_resume_from_is_rendered_as_the_uri_the_trainer_reads() -> None:
    def rendered(**spec: Any) -> dict[str, Any]:
        cm = run_builders.build_run_config_map(make_run(**spec), CONFIG)
        return dict(yaml.safe_load(cm["data"]["run.yaml"])["spec"])

    by_name = rendered(resumeFrom={"run": "demo"})
    # Every earlier object named demo lives under this root; the trainer skips its own uid.
    assert by_name["resumeFrom"] == {"checkpoint": "s3://posttrain/runs/ml/demo"}
    step = "s3://other/exp/3e1f/checkpoints/step-00000004"
    assert rendered(resumeFrom={"checkpoint": step})["resumeFrom"] == {"checkpoint": step}
    own = rendered(checkpoint={"storageUri": "s3://team/exp1"})  # theirs, used as given
    assert own["checkpoint"]["storageUri"] == "s3://team/exp1"


def test_trainer_rbac_is_narrow() -> None:
    sa, role, binding = run_builders.build_trainer_rbac(make_run())
    assert sa["metadata"]["name"] == "demo-trainer"
    named = [rule for rule in role["rules"] if rule["resources"] != ["events"]]
    assert all(rule["resourceNames"] == ["demo"] for rule in named)
    assert {v for rule in named for v in rule["verbs"]} == {"get", "patch"}
    # Events (stage boundaries) can only be created: no name to narrow to, no other verb.
    events = [rule for rule in role["rules"] if rule["resources"] == ["events"]]
    assert events == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-trainer", "namespace": "ml"}
    ]


def test_judges_get_their_pools_and_api_keys_and_nothing_more() -> None:
    """A judge on a pool: the trainer's Role may get that pool (beside the rollout pool) and
    no other; a judge on a URL with a Secret: the key reaches the pod as a secretKeyRef."""
    judge = {"kind": "judge", "judge": {"pool": "judges", "rubric": "{answer}"}}
    remote = {
        "kind": "judge",
        "judge": {"url": "https://api.example.com/v1", "rubric": "{answer}",
                  "apiKeyEnv": "JUDGE_KEY", "apiKeySecret": {"name": "judge", "key": "token"}},
    }  # fmt: skip
    run = make_run(
        rollout={"pool": "policy"},
        domains=[
            {"name": "a", "dataset": "builtin:arithmetic", "verifier": judge},
            {"name": "b", "dataset": "builtin:arithmetic", "verifier": remote},
        ],
    )
    role = next(m for m in run_builders.build_trainer_rbac(run) if m["kind"] == "Role")
    pools = [r for r in role["rules"] if r["resources"] == ["rolloutpools"]]
    assert pools == [{"apiGroups": ["posttrain.io"], "resources": ["rolloutpools"],
                      "verbs": ["get"], "resourceNames": ["policy", "judges"]}]  # fmt: skip
    env = run_builders.build_trainer_pod(run, CONFIG, 0, 0)["spec"]["containers"][0]["env"]
    keys = [e for e in env if e["name"] == "JUDGE_KEY"]
    assert keys == [
        {"name": "JUDGE_KEY", "valueFrom": {"secretKeyRef": {"name": "judge", "key": "token"}}}
    ]
    plain = next(m for m in run_builders.build_trainer_rbac(make_run()) if m["kind"] == "Role")
    assert not [r for r in plain["rules"] if r["resources"] == ["rolloutpools"]]


def test_vllm_deployment_flags_and_rollout_strategy() -> None:
    pool = make_pool(
        replicas=2,
        engineArgs={
            "tensorParallelSize": 2,
            "maxModelLen": 4096,
            "speculative": {"method": "ngram"},
        },
        resources={"gpus": 2},
    )
    dep = b.build_rollout_deployment(pool, CONFIG)
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = dep["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    cmd = server["command"]
    # The front door is the entrypoint; vLLM gets a loopback port the Service never exposes.
    assert cmd[:3] == ["posttrain", "rollout", "vllm-entry"]
    assert cmd[cmd.index("--model") + 1] == b.MODEL_LINK
    assert cmd[cmd.index("--host") + 1] == "$(POD_IP)"
    assert cmd[cmd.index("--port") + 1] == "8000"
    assert cmd[cmd.index("--internal-port") + 1] == "0"
    assert cmd[cmd.index("--served-model-name") + 1] == "pool"
    engine_args = json.loads(cmd[cmd.index("--engine-args") + 1])
    assert engine_args["tensor_parallel_size"] == 2
    assert engine_args["max_model_len"] == 4096
    assert engine_args["speculative"]["method"] == "ngram"
    assert server["ports"] == [{"name": "http", "containerPort": 8000}]
    service = b.build_rollout_service(pool)
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    # spec.model is resolved onto the pod's volume before the server starts.
    (fetch,) = pod["initContainers"]
    assert fetch["command"] == ["posttrain", "rollout", "fetch-model", "--model",
                                "Qwen/Qwen3-0.6B", "--link", b.MODEL_LINK]  # fmt: skip
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    volumes = {v["name"] for v in pod["volumes"]}
    assert {b.MODEL_VOLUME, "dshm"} <= volumes
    assert {m["mountPath"] for m in server["volumeMounts"]} == {
        b.MODEL_MOUNT,
        "/dev/shm",
        b.WEIGHTS_SCRATCH_MOUNT,
        "/tmp",
        b.POOL_HOME,
    }
    assert server["image"] == "vllm:1"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert server["readinessProbe"]["httpGet"]["path"] == "/health"
    assert dep["spec"]["selector"]["matchLabels"] == b.pool_selector("pool")
    assert dep["spec"]["template"]["metadata"]["labels"][api_labels.LABEL_POOL] == "pool"


def test_cpu_pool_binds_its_pod_ip_so_replicas_sharing_a_host_network_coexist() -> None:
    dep = b.build_rollout_deployment(make_pool(engine="cpu", port=8123), CONFIG)
    (server,) = dep["spec"]["template"]["spec"]["containers"]
    cmd = server["command"]
    assert cmd[:2] == ["posttrain", "serve"]
    assert cmd[cmd.index("--host") + 1] == "$(POD_IP)"
    assert cmd[cmd.index("--port") + 1] == "8123"
    pod_ip = next(e for e in server["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_spec_hash_changes_with_template_not_replicas() -> None:
    one = b.build_rollout_deployment(make_pool(replicas=1), CONFIG)
    three = b.build_rollout_deployment(make_pool(replicas=3), CONFIG)
    other = b.build_rollout_deployment(make_pool(replicas=1, port=9000), CONFIG)
    key = api_labels.ANNOTATION_SPEC_HASH
    assert one["metadata"]["annotations"][key] == three["metadata"]["annotations"][key]
    assert one["metadata"]["annotations"][key] != other["metadata"]["annotations"][key]


def test_rollout_service_targets_the_pool() -> None:
    svc = b.build_rollout_service(make_pool(port=8123))
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8123, "targetPort": "http"}]
    assert svc["spec"]["selector"] == b.pool_selector("pool")


def test_rbac_rules_have_no_wildcards_and_cover_leader_election() -> None:
    for rule in OPERATOR_RULES + TRAINER_RULES + LEADER_ELECTION_RULES:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "*" not in rule["apiGroups"]
    resources = {r for rule in OPERATOR_RULES for r in rule["resources"]}
    assert {
        "events",
        "pods",
        "deployments",
        "sandboxtasks/status",
    } <= resources
    docs = list(yaml.safe_load_all(rbac_yaml()))
    assert docs[0]["kind"] == "ClusterRole" and docs[0]["rules"] == OPERATOR_RULES
    assert docs[1]["rules"] == TRAINER_RULES
    assert docs[2]["kind"] == "Role" and docs[2]["rules"] == LEADER_ELECTION_RULES
    assert not [r for r in OPERATOR_RULES if "kopf.dev" in r["apiGroups"]]


def test_config_from_env_and_bad_values() -> None:
    config = load_config(
        {"POSTTRAIN_OPERATOR_NAMESPACES": "a, b", "POSTTRAIN_OPERATOR_MAX_WORKERS": "8"},
        standalone=True,
        lease_name=None,
    )
    assert config.namespaces == ("a", "b") and config.max_workers == 8 and config.standalone
    assert load_config({}).watched_namespaces == ("default",)
    assert load_config({}, all_namespaces=True).watched_namespaces == ()
    with pytest.raises(UsageError, match="POSTTRAIN_OPERATOR_"):
        load_config({"POSTTRAIN_OPERATOR_MAX_WORKERS": "zero"})


def test_leader_election_config() -> None:
    """The Lease lives in the operator's namespace (else the first watched one); the identity
    is the pod's name (else hostname_pid); the timings keep client-go's order."""
    config = load_config({"POSTTRAIN_OPERATOR_OPERATOR_NAMESPACE": "ops"})
    assert config.lease_namespace == "ops" and config.lease_name == "posttrain-operator"
    assert load_config({}, namespaces=("a", "b")).lease_namespace == "a"
    assert load_config({}, all_namespaces=True).lease_namespace == "default"
    assert load_config({}, identity="pod-1").lease_identity == "pod-1"
    with pytest.raises(UsageError, match="lease_retry_period_seconds < lease_renew_deadline"):
        load_config({}, lease_duration_seconds=5.0, lease_renew_deadline_seconds=6.0)
    with pytest.raises(UsageError, match="lease_name"):
        load_config({}, lease_name="Not A Name")


def test_chart_style_environment_reaches_the_pods() -> None:
    """The Helm chart passes structured values as JSON env vars (see operator-configmap)."""
    config = load_config(
        {
            "POSTTRAIN_OPERATOR_IMAGE_PULL_SECRETS": '[{"name": "regcred"}]',
            "POSTTRAIN_OPERATOR_TRAINER_NODE_SELECTOR": '{"pool": "gpu", "zone": "a"}',
            "POSTTRAIN_OPERATOR_TRAINER_TOLERATIONS": '[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]',
            "POSTTRAIN_OPERATOR_TRAINER_AFFINITY": "null",
            "POSTTRAIN_OPERATOR_ROLLOUT_TOLERATIONS": "[]",
            "POSTTRAIN_OPERATOR_SANDBOX_RUNTIME_CLASS_NAME": "gvisor",
            "POSTTRAIN_OPERATOR_LOG_LEVEL": "debug",
        }
    )
    assert config.trainer_affinity == {} and config.log_level == "DEBUG"
    pod = run_builders.build_trainer_pod(
        make_run(resources={"nodeSelector": {"zone": "b"}}), config, 0, 0
    )
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu", "zone": "b"}  # the run wins per key
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert "affinity" not in pod["spec"]
    sandbox = sandbox_builders.build_sandbox_pod(make_task(), config, 1)
    assert sandbox["spec"]["runtimeClassName"] == "gvisor"
    assert sandbox["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert (
        sandbox_builders.build_sandbox_pod(make_task(runtimeClassName="kata"), config, 1)["spec"][
            "runtimeClassName"
        ]
        == "kata"
    )
    dep = b.build_rollout_deployment(make_pool(), config)
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    with pytest.raises(UsageError, match="must be JSON"):
        load_config({"POSTTRAIN_OPERATOR_TRAINER_TOLERATIONS": "[oops"})


def test_trainer_pod_gets_the_pools_endpoint_unless_the_spec_names_endpoints() -> None:
    pool_url = b.pool_endpoint(make_pool(port=8001))
    assert pool_url == "http://pool.ml.svc:8001"
    pod = run_builders.build_trainer_pod(
        make_run(rollout={"pool": "pool"}), CONFIG, 0, 0, rollout_endpoints=[pool_url]
    )
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[env_names.ROLLOUT_ENDPOINTS] == pool_url
    explicit = run_builders.build_trainer_pod(
        make_run(rollout={"pool": "pool", "endpoints": ["http://10.0.0.9:8000"]}),
        CONFIG,
        0,
        0,
        rollout_endpoints=[pool_url],
    )
    names = {e["name"] for e in explicit["spec"]["containers"][0]["env"]}
    assert env_names.ROLLOUT_ENDPOINTS not in names


def test_trainer_pods_publish_in_the_pools_serving_dtype() -> None:
    """A bf16 vLLM pool: the trainer pods (plain gang and RayCluster) are told to publish
    bf16; ``auto`` and the cpu engine leave the trainer's own dtype."""
    from posttrain.trainer.model.weight_sync import serving_dtype

    pool = make_pool(engine="vllm", engineArgs={"dtype": "bfloat16"})
    dtype = b.pool_serving_dtype(pool)
    assert dtype == "bfloat16"
    run = make_run(rollout={"pool": "pool"})
    url = [b.pool_endpoint(pool)]
    pod = run_builders.build_trainer_pod(
        run, CONFIG, 0, 0, rollout_endpoints=url, rollout_dtype=dtype
    )
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[env_names.ROLLOUT_DTYPE] == "bfloat16"
    # What the trainer then reads.
    contract = env_names.TrainerEnv.from_env({k: v for k, v in env.items() if v is not None})
    assert str(serving_dtype(contract.rollout_dtype)) == "torch.bfloat16"
    ray = raycluster.build_ray_cluster(
        make_run(rollout={"pool": "pool"}, resources={"nodes": 2}),
        CONFIG,
        0,
        rollout_endpoints=url,
        rollout_dtype=dtype,
    )
    groups = [ray["spec"]["headGroupSpec"], *ray["spec"]["workerGroupSpecs"]]
    for group in groups:
        group_env = {
            e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]
        }
        assert group_env[env_names.ROLLOUT_DTYPE] == "bfloat16"
    assert b.pool_serving_dtype(make_pool(engine="vllm")) is None  # auto: vLLM decides
    assert b.pool_serving_dtype(make_pool(engine="cpu", engineArgs={"dtype": "bfloat16"})) is None
    plain = run_builders.build_trainer_pod(run, CONFIG, 0, 0, rollout_endpoints=url)
    assert env_names.ROLLOUT_DTYPE not in {e["name"] for e in plain["spec"]["containers"][0]["env"]}


CODE_DOMAIN = {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}}


def test_a_terminal_environment_runs_model_output_so_the_run_gets_a_runner() -> None:
    """A terminal environment's commands run in the sandbox, verifier or not; a
    function-calling one runs nothing (BFCL's checker judges in the trainer)."""
    from posttrain.operator.trainingrun import sandbox_runner as sr

    terminal = {
        "name": "shell",
        "dataset": "tasks.jsonl",
        "environment": {"kind": "terminal", "maxTurns": 4},
    }
    tools = {
        "name": "tools",
        "dataset": "builtin:bfcl_simple_python",
        "environment": {"kind": "function_calling"},
    }
    assert sr.executes_code(make_run(domains=[terminal], sandbox={"mode": "runner"}))
    assert not sr.executes_code(make_run(domains=[tools], sandbox={"mode": "runner"}))
    kinds = [
        c["kind"]
        for c in build_trainer_children(
            make_run(domains=[terminal], sandbox={"mode": "runner"}), CONFIG, 0
        )
    ]
    assert "Deployment" in kinds and "Service" in kinds


def test_runner_mode_without_url_gets_a_restricted_runner_of_its_own() -> None:

    run = make_run(
        domains=[CODE_DOMAIN],
        sandbox={
            "mode": "runner",
            "maxConcurrency": 3,
            "memoryMb": 256,
            "runtimeClassName": "gvisor",
        },
    )
    children = {c["kind"]: c for c in build_trainer_children(run, CONFIG, 0)}
    deployment, service = children["Deployment"], children["Service"]
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == "demo-sandbox-runner"
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == "uid-run"
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == CONFIG.sandbox_runner_image
    assert container["command"][:3] == ["posttrain", "sandbox", "serve"]
    assert container["command"][-2:] == ["--concurrency", "3"]
    # The run's sandbox policy is the runner's own: it refuses requests beyond it.
    command = container["command"]
    assert command[command.index("--max-memory-mb") + 1] == "256"
    assert command[command.index("--max-timeout-s") + 1] == "60.0"
    assert "--allow-host-network" not in command
    assert container["resources"]["limits"] == {"cpu": "3", "memory": "1024Mi"}
    assert pod["automountServiceAccountToken"] is False and pod["hostUsers"] is False
    assert pod["runtimeClassName"] == "gvisor"
    context = container["securityContext"]
    assert context["runAsNonRoot"] and context["runAsUser"] == 65534
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["allowPrivilegeEscalation"] is False
    # Exactly what bubblewrap needs beyond "restricted", nothing else.
    assert (context["seccompProfile"], context["procMount"]) == ({"type": "Unconfined"}, "Unmasked")
    policy = children["NetworkPolicy"]["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and "egress" not in policy
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {
        api_labels.LABEL_COMPONENT: api_labels.COMPONENT_TRAINER,
        api_labels.LABEL_RUN: "demo",
    }
    env = {
        e["name"]: e.get("value")
        for e in run_builders.build_trainer_pod(run, CONFIG, 0, 0)["spec"]["containers"][0]["env"]
    }
    assert env[env_names.SANDBOX_RUNNER_URL] == "http://demo-sandbox-runner.ml.svc:8090"


def test_a_run_that_does_not_evaluate_inline_gets_an_evaluator_job_of_its_own() -> None:
    from posttrain.operator.trainingrun.evaluator import COMPONENT_EVALUATOR

    assert "Job" not in [c["kind"] for c in build_trainer_children(make_run(), CONFIG, 0)]
    run = make_run(
        evaluation={"inline": False},
        resources={"cpu": "6", "memory": "20Gi", "gpusPerNode": 2, "image": "mine:2"},
    )
    (job,) = [c for c in build_trainer_children(run, CONFIG, 0) if c["kind"] == "Job"]
    assert (job["apiVersion"], job["metadata"]["name"]) == ("batch/v1", "demo-evaluator")
    owner = job["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("TrainingRun", "uid-run", True)
    assert job["metadata"]["labels"][api_labels.LABEL_COMPONENT] == COMPONENT_EVALUATOR
    assert job["spec"]["backoffLimit"] >= 1
    template = job["spec"]["template"]
    assert template["metadata"]["labels"] == {
        api_labels.LABEL_COMPONENT: COMPONENT_EVALUATOR,
        api_labels.LABEL_RUN: "demo",
    }
    pod = template["spec"]
    assert pod["restartPolicy"] == "OnFailure" and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["image"] == "mine:2"
    # The trainer's own config and storage: it scores exactly what the trainer commits.
    assert container["command"] == [
        "posttrain", "eval-checkpoints", run_names.RUN_CONFIG_PATH,
        "--storage", "s3://posttrain/runs/ml/demo/uid-run", "--out", "/workspace",
        "--watch", "--poll-seconds", "30", "--metrics-port", str(CONFIG.pod_metrics_port),
    ]  # fmt: skip
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/posttrain"]["readOnly"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run-config"]["configMap"]["name"] == "demo-config"
    # CPU and memory of a trainer node, never its GPUs (the evaluator serves on CPU).
    assert container["resources"]["limits"] == {"cpu": "6", "memory": "20Gi"}
    env = {e["name"]: e for e in container["env"]}
    assert env["POSTTRAIN_S3_ENDPOINT"]["value"] == "minio.storage:9000"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-creds"
    assert container["ports"] == [{"name": "metrics", "containerPort": CONFIG.pod_metrics_port}]
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    # evaluation.resources sizes it on its own (unset fields stay the trainer's).
    sized = make_run(
        evaluation={"inline": False, "resources": {"cpu": "500m"}},
        resources={"cpu": "6", "memory": "20Gi"},
    )
    (job,) = [c for c in build_trainer_children(sized, CONFIG, 0) if c["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "500m", "memory": "20Gi"}


def test_runner_url_given_means_no_runner_of_our_own() -> None:
    run = make_run(
        domains=[CODE_DOMAIN], sandbox={"mode": "runner", "runnerUrl": "http://shared:8090"}
    )
    kinds = [c["kind"] for c in build_trainer_children(run, CONFIG, 0)]
    assert "Deployment" not in kinds
    env = [
        e["name"]
        for e in run_builders.build_trainer_pod(run, CONFIG, 0, 0)["spec"]["containers"][0]["env"]
    ]
    assert "POSTTRAIN_SANDBOX_RUNNER_URL" not in env


def test_local_mode_gives_the_trainer_what_bubblewrap_needs_only_when_code_runs() -> None:
    code = run_builders.build_trainer_pod(make_run(domains=[CODE_DOMAIN]), CONFIG, 0, 0)["spec"]
    assert code["hostUsers"] is False
    context = code["containers"][0]["securityContext"]
    assert (context["seccompProfile"], context["procMount"]) == ({"type": "Unconfined"}, "Unmasked")
    assert context["capabilities"] == {"drop": ["ALL"]}
    # The rest of the trainer's posture stays (test_trainingrun_pods_are_pod_security_...).
    assert context["runAsUser"] == shared_builders.POSTTRAIN_UID and context["runAsNonRoot"]
    assert context["allowPrivilegeEscalation"] is False
    numeric = run_builders.build_trainer_pod(make_run(), CONFIG, 0, 0)["spec"]
    assert "hostUsers" not in numeric
    numeric_context = numeric["containers"][0]["securityContext"]
    assert (numeric_context["seccompProfile"], "procMount" in numeric_context) == (
        {"type": "RuntimeDefault"},
        False,
    )


def test_task_mode_lets_the_trainer_create_sandbox_tasks_and_nothing_more() -> None:
    role = next(
        m
        for m in run_builders.build_trainer_rbac(make_run(sandbox={"mode": "task"}))
        if m["kind"] == "Role"
    )
    rules = [r for r in role["rules"] if r["resources"] == ["sandboxtasks"]]
    assert rules == [
        {
            "apiGroups": ["posttrain.io"],
            "resources": ["sandboxtasks"],
            "verbs": ["get", "create", "delete"],
        }
    ]
    # The operator holds what it grants (RBAC escalation check).
    held = next(r for r in OPERATOR_RULES if r["resources"] == ["sandboxtasks"])
    assert {"get", "create", "delete"} <= set(held["verbs"])
    local = next(m for m in run_builders.build_trainer_rbac(make_run()) if m["kind"] == "Role")
    assert all("sandboxtasks" not in r["resources"] for r in local["rules"])


def test_trainer_and_rollout_pods_expose_metrics_and_get_the_otlp_endpoint() -> None:
    pod = run_builders.build_trainer_pod(make_run(), CONFIG, 0, 0)
    container = pod["spec"]["containers"][0]
    assert container["command"][-2:] == ["--metrics-port", str(CONFIG.pod_metrics_port)]
    assert container["ports"] == [{"name": "metrics", "containerPort": CONFIG.pod_metrics_port}]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(container)  # none configured
    # A Ray worker runs no trainer process, so it has nothing to scrape.
    worker = run_builders.build_trainer_pod(make_run(resources={"nodes": 2}), CONFIG, 0, 1)
    assert "ports" not in worker["spec"]["containers"][0]
    assert "annotations" not in worker["metadata"]

    traced = CONFIG.model_copy(update={"otlp_endpoint": "http://collector.monitoring:4318"})
    env = env_of(run_builders.build_trainer_pod(make_run(), traced, 0, 0)["spec"]["containers"][0])
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector.monitoring:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "posttrain-trainer"
    deployment = b.build_rollout_deployment(make_pool(), traced)
    template = deployment["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(
        template["spec"]["containers"][0]["ports"][0]["containerPort"]
    )
    rollout_env = env_of(template["spec"]["containers"][0])
    assert rollout_env["OTEL_SERVICE_NAME"]["value"] == "posttrain-rollout"
    off = CONFIG.model_copy(update={"pod_metrics_port": 0})
    assert (
        "--metrics-port"
        not in run_builders.build_trainer_pod(make_run(), off, 0, 0)["spec"]["containers"][0][
            "command"
        ]
    )


def _volume_under(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume ``container`` has mounted at ``path`` or above it."""
    (mount,) = [
        m
        for m in container["volumeMounts"]
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


HF_TOKEN_ENV = {
    "name": "HF_TOKEN",
    "valueFrom": {"secretKeyRef": {"name": "hub-token", "key": "token"}},
}


def test_the_pods_of_a_run_with_an_hf_model_download_it_onto_their_workspace() -> None:
    """hf:// (#30): the Hub on, HF_HOME on the writable /workspace emptyDir, the spec's token
    Secret as HF_TOKEN; trainer pods and the evaluator alike. Other models get none of it."""
    run = make_run(
        model="hf://HuggingFaceTB/SmolLM2-135M-Instruct@main",
        hfTokenSecret={"name": "hub-token", "key": "token"},
        evaluation={"inline": False},
    )
    trainer = run_builders.build_trainer_pod(run, CONFIG, incarnation=1, rank=0)
    (job,) = [c for c in build_trainer_children(run, CONFIG, 0) if c["kind"] == "Job"]
    for pod in (trainer["spec"], job["spec"]["template"]["spec"]):
        (container,) = pod["containers"]
        env = env_of(container)
        assert env["HF_HOME"]["value"] == "/workspace/.cache/huggingface"
        assert env["HF_HUB_OFFLINE"]["value"] == "0"
        assert env["HF_TOKEN"] == HF_TOKEN_ENV  # never a literal
        assert "emptyDir" in _volume_under(pod, container, env["HF_HOME"]["value"])
    without_token = run_builders.build_trainer_pod(
        make_run(model="hf://org/public"), CONFIG, incarnation=1, rank=0
    )
    assert "HF_TOKEN" not in env_of(without_token["spec"]["containers"][0])
    plain = run_builders.build_trainer_pod(make_run(), CONFIG, incarnation=1, rank=0)
    assert not [e for e in plain["spec"]["containers"][0]["env"] if e["name"].startswith("HF_")]


def test_a_vllm_pool_with_an_hf_model_downloads_it_in_its_fetch_step_onto_the_model_volume() -> (
    None
):
    pool = make_pool(
        model="hf://Qwen/Qwen3-0.6B@v2", hfTokenSecret={"name": "hub-token", "key": "token"}
    )
    pod = b.build_rollout_deployment(pool, CONFIG)["spec"]["template"]["spec"]
    (fetch,) = pod["initContainers"]
    assert fetch["command"][fetch["command"].index("--model") + 1] == "hf://Qwen/Qwen3-0.6B@v2"
    env = env_of(fetch)
    assert env["HF_HOME"]["value"] == b.POOL_HF_HOME == "/models/huggingface"
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    assert env["HF_TOKEN"] == HF_TOKEN_ENV
    # The cache is on the volume the server reads /models/current from (the link points in).
    assert _volume_under(pod, fetch, b.POOL_HF_HOME) == {"name": b.MODEL_VOLUME, "emptyDir": {}}
    (server,) = pod["containers"]
    assert _volume_under(pod, server, b.MODEL_LINK)["name"] == b.MODEL_VOLUME
    # The long-running server reads local files only: no token, no Hub.
    assert not {"HF_TOKEN", "HF_HUB_OFFLINE"} & set(env_of(server))
    # A pool on any other model is unchanged (no rollout of existing pools on upgrade).
    plain = b.build_rollout_deployment(make_pool(), CONFIG)["spec"]["template"]["spec"]
    assert not [e for e in plain["initContainers"][0]["env"] if e["name"].startswith("HF_")]


def test_a_cpu_pool_with_an_hf_model_gets_a_volume_for_its_cache() -> None:
    pool = make_pool(engine="cpu", model="hf://org/tiny")
    pod = b.build_rollout_deployment(pool, CONFIG)["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["command"][server["command"].index("--model") + 1] == "hf://org/tiny"
    env = env_of(server)
    assert env["HF_HOME"]["value"] == b.POOL_HF_HOME
    assert env["HF_HUB_OFFLINE"]["value"] == "0"
    assert "HF_TOKEN" not in env  # the spec names no Secret
    assert "emptyDir" in _volume_under(pod, server, b.POOL_HF_HOME)
    plain = b.build_rollout_deployment(make_pool(engine="cpu"), CONFIG)["spec"]["template"]
    assert not [e for e in plain["spec"]["containers"][0]["env"] if e["name"].startswith("HF_")]


POOL_PODS = {
    "cpu, packaged model": {"engine": "cpu", "model": "smollm2-135m-instruct"},
    "cpu, hf:// model": {"engine": "cpu", "model": "hf://org/tiny",
                         "hfTokenSecret": {"name": "hub-token", "key": "token"}},
    "vllm on GPUs, s3:// model": {"engine": "vllm", "model": "s3://b/runs/x/ckpt",
                                  "resources": {"gpus": 2}},
    "vllm on CPU, pvc:// model": {"engine": "vllm", "model": "pvc://models/smollm2",
                                  "resources": {"gpus": 0, "cpu": "1", "memory": "3Gi"}},
}  # fmt: skip


@pytest.mark.parametrize("spec", POOL_PODS.values(), ids=POOL_PODS.keys())
def test_pool_pods_are_pod_security_restricted_and_write_only_to_their_volumes(
    spec: dict[str, Any],
) -> None:
    """Every container of a replica (the fetch step, the server) runs as the images'
    posttrain user with no capability, no privilege escalation, RuntimeDefault seccomp and a
    read-only root; every place the servers write (/tmp, $HOME, the model cache, the Hugging
    Face cache, the weight staging) is a writable emptyDir of the pod.
    tests/operator/test_pod_security_cluster.py has the apiserver's own verdict."""
    pod = b.build_rollout_deployment(make_pool(**spec), CONFIG)["spec"]["template"]["spec"]
    assert pod["securityContext"] == POSTTRAIN_POD_CONTEXT
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    assert [c["name"] for c in containers][-1] == "server"
    for container in containers:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001, context
        assert context["allowPrivilegeEscalation"] is False, context
        assert context["capabilities"] == {"drop": ["ALL"]}, context
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, context
        assert context["readOnlyRootFilesystem"] is True, context
        assert not context.get("privileged"), context
        env = env_of(container)
        assert env["HOME"]["value"] == b.POOL_HOME
        written = ["/tmp", b.POOL_HOME, env[env_names.CACHE]["value"]]
        written += [env[k]["value"] for k in ("HF_HOME", env_names.WEIGHTS_SCRATCH) if k in env]
        for path in written:
            assert "emptyDir" in _volume_under(pod, container, path), (container["name"], path)
    assert "HF_HOME" in env_of(containers[0]) or not spec["model"].startswith("hf://")
    for volume in pod["volumes"]:  # the volume kinds "restricted" allows
        assert {"emptyDir", "persistentVolumeClaim"} & set(volume), volume
    assert "hostNetwork" not in pod and "hostPID" not in pod and "hostIPC" not in pod


def test_pool_pods_run_as_the_user_the_trainer_and_rollout_images_define() -> None:
    """The uid is the images' own (useradd in trainer/Dockerfile, which serves engine=cpu
    pools, and rollout/Dockerfile), and HOME its home, so what the images hold under their
    user stays readable and `getpass.getuser()` (torch inductor's cache dir) resolves."""
    root = Path(__file__).resolve().parents[2]
    uid = shared_builders.POSTTRAIN_UID
    for dockerfile in ("trainer/Dockerfile", "rollout/Dockerfile"):
        text = (root / dockerfile).read_text()
        assert f"useradd --uid {uid} --user-group --create-home --home-dir {b.POOL_HOME} " in text
        assert f"USER {uid}:{uid}" in text, dockerfile


def test_a_cpu_vllm_pool_gets_a_memory_backed_dev_shm() -> None:
    """vLLM's engine needs ~160 MiB of shared memory on CPU too; the runtime's /dev/shm is 64
    MiB (found by the rollout image's smoke test: "Insufficient space in /dev/shm")."""
    pool = make_pool(engine="vllm", resources={"gpus": 0, "cpu": "1", "memory": "3Gi"})
    pod = b.build_rollout_deployment(pool, OperatorConfig())["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    (server,) = pod["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in server["volumeMounts"]


def test_a_vllm_pool_stages_weight_updates_on_a_sized_volume() -> None:
    """Not the container's /tmp: a declared emptyDir with a sizeLimit, and ephemeral-storage
    requests = limits on the server, so an update that outgrows them evicts the replica."""
    pool = make_pool(
        engine="vllm", resources={"weightsScratch": "30Gi", "ephemeralStorage": "70Gi"}
    )
    pod = b.build_rollout_deployment(pool, OperatorConfig())["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[b.WEIGHTS_SCRATCH_VOLUME] == {
        "name": b.WEIGHTS_SCRATCH_VOLUME,
        "emptyDir": {"sizeLimit": "30Gi"},
    }
    (server,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    assert mounts[b.WEIGHTS_SCRATCH_VOLUME] == b.WEIGHTS_SCRATCH_MOUNT
    assert env_of(server)[b.WEIGHTS_SCRATCH_ENV]["value"] == b.WEIGHTS_SCRATCH_MOUNT
    for kind in ("requests", "limits"):
        assert server["resources"][kind]["ephemeral-storage"] == "70Gi"
    cpu = b.build_rollout_deployment(make_pool(engine="cpu", resources={"gpus": 0}), CONFIG)
    assert "ephemeral-storage" not in str(cpu)  # the dev-only cpu engine is left unsized


def test_a_pools_deployment_and_service_are_owned_by_the_pool() -> None:
    """What the garbage collector follows when the pool is deleted (the real one on a
    cluster, the dev agent's stand-in on the dev cluster): one controller reference, by uid."""
    pool = make_pool()
    expected = [
        {
            "apiVersion": "posttrain.io/v1alpha1",
            "kind": "RolloutPool",
            "name": "pool",
            "uid": "uid-pool",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    deployment = b.build_rollout_deployment(pool, CONFIG)
    service = b.build_rollout_service(pool)
    assert deployment["metadata"]["ownerReferences"] == expected
    assert service["metadata"]["ownerReferences"] == expected
    assert deployment["metadata"]["namespace"] == service["metadata"]["namespace"] == "ml"
    # The pods are the Deployment's (its controller sets that reference), not the pool's.
    assert "ownerReferences" not in deployment["spec"]["template"].get("metadata", {})


def trainingrun_pod_specs(
    run: TrainingRun, colocated_pool: RolloutPool | None = None
) -> dict[str, dict[str, Any]]:
    """Every pod spec a TrainingRun's reconciler creates for ``run`` (by kind), as the
    builders produce them: the plain gang's pods (with ``rollout.colocated``, their
    sidecars from ``colocated_pool``), the RayCluster's head and worker templates, the
    evaluator Job's template (when ``evaluation.inline`` is false) and the sandbox runner
    Deployment's template (mode runner without runnerUrl)."""
    specs = {
        f"gang rank {pod['metadata']['labels'][api_labels.LABEL_RANK]}": pod["spec"]
        for pod in run_builders.build_trainer_gang(run, CONFIG, 0, colocated_pool)
    }
    if run.spec.resources.nodes > 1:
        cluster = raycluster.build_ray_cluster(run, CONFIG, 0)["spec"]
        specs["ray head"] = cluster["headGroupSpec"]["template"]["spec"]
        (workers,) = cluster["workerGroupSpecs"]
        specs["ray worker"] = workers["template"]["spec"]
    for child in build_trainer_children(run, CONFIG, 0):
        if child["kind"] in ("Job", "Deployment"):
            specs[child["metadata"]["name"]] = child["spec"]["template"]["spec"]
    return specs


TRAINING_RUNS = {
    "one node, packaged model": {},
    "two nodes (gang and RayCluster), evaluator Job": {
        "resources": {"nodes": 2, "gpusPerNode": 1},
        "evaluation": {"inline": False},
    },
    "hf:// model": {"model": "hf://org/tiny"},
    "pvc:// model, evaluator Job": {"model": "pvc://models/smollm2", "evaluation": {"inline": False}},
}  # fmt: skip


@pytest.mark.parametrize("spec", TRAINING_RUNS.values(), ids=TRAINING_RUNS.keys())
def test_trainingrun_pods_are_pod_security_restricted_and_write_to_their_volumes(
    spec: dict[str, Any],
) -> None:
    """Every pod a TrainingRun creates (trainer gang, RayCluster head and workers, evaluator)
    runs as the trainer image's posttrain user with no capability, no privilege escalation and
    RuntimeDefault seccomp; the root stays writable (a known gap, docs/security.md). What
    torchrun, Ray and Hugging Face write (/tmp and Ray's /tmp/ray, $HOME, /dev/shm, the
    workspace with checkpoints and HF_HOME) is an emptyDir of the pod, which fsGroup gives
    the uid. tests/operator/test_pod_security_cluster.py has the apiserver's own verdict."""
    run = make_run(**spec)
    specs = trainingrun_pod_specs(run)
    kinds = {"gang rank 0", "ray head", "ray worker", "demo-evaluator"}
    assert kinds & set(specs) == kinds & {
        "gang rank 0",
        *(("ray head", "ray worker") if run.spec.resources.nodes > 1 else ()),
        *(("demo-evaluator",) if not run.spec.evaluation.inline else ()),
    }
    for name, pod in specs.items():
        assert pod["securityContext"] == POSTTRAIN_POD_CONTEXT, name
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            context = container["securityContext"]
            assert context == {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "allowPrivilegeEscalation": False,
                "privileged": False,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            }, (name, context)
            env = env_of(container)
            assert env["HOME"]["value"] == shared_builders.POSTTRAIN_HOME, name
            written = ["/tmp", "/tmp/ray", shared_builders.POSTTRAIN_HOME, "/workspace"]
            written += [env[k]["value"] for k in ("HF_HOME", env_names.CACHE) if k in env]
            if name != "demo-evaluator":  # the trainer: Gloo/NCCL and Ray's object store
                written.append("/dev/shm")
            for path in written:
                assert "emptyDir" in _volume_under(pod, container, path), (name, path)
        for volume in pod["volumes"]:  # the volume kinds "restricted" allows
            assert {"emptyDir", "persistentVolumeClaim", "configMap"} & set(volume), volume
        assert not {"hostNetwork", "hostPID", "hostIPC", "hostUsers"} & set(pod), name
    hf_model = run.spec.model.startswith("hf://")
    assert ("HF_HOME" in env_of(specs["gang rank 0"]["containers"][0])) == hf_model


def test_trainer_pods_run_as_the_user_the_trainer_image_defines() -> None:
    """uid 10001 is trainer/Dockerfile's USER and owns its HOME and /workspace, so a trainer
    pod's uid changes nothing the image holds; the image's HF_HOME is under /workspace."""
    text = (Path(__file__).resolve().parents[2] / "trainer/Dockerfile").read_text()
    uid, home = shared_builders.POSTTRAIN_UID, shared_builders.POSTTRAIN_HOME
    assert f"useradd --uid {uid} --user-group --create-home --home-dir {home} " in text
    assert f"chown {uid}:{uid} /workspace" in text and f"USER {uid}:{uid}" in text
    assert f"HF_HOME={shared_builders.WORKSPACE_HF_HOME}" in text


def test_the_bubblewrap_pods_of_a_run_are_restricted_but_for_what_bwrap_needs() -> None:
    """The documented exception (docs/sandboxes.md): the run's own sandbox runner and a
    mode-local trainer whose domains execute code differ from "restricted" only in
    Unconfined seccomp and an unmasked /proc (in their own user namespace)."""
    for sandbox in ({"mode": "runner"}, {"mode": "local"}):
        run = make_run(domains=[CODE_DOMAIN], sandbox=sandbox)
        specs = trainingrun_pod_specs(run)
        name = "demo-sandbox-runner" if sandbox["mode"] == "runner" else "gang rank 0"
        pod = specs[name]
        assert pod["hostUsers"] is False and pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        context = dict(container["securityContext"])
        assert context.pop("seccompProfile") == {"type": "Unconfined"}, name
        assert context.pop("procMount") == "Unmasked", name
        assert context["runAsNonRoot"] and context["runAsUser"] in (65534, 10001), name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"] == {"drop": ["ALL"]}, name


# --- rollout.colocated: the pool's replicas as native sidecars of the trainer pod ---

COLOCATED_POOLS = {
    "cpu engine": {"engine": "cpu", "model": "smollm2-135m-instruct", "port": 8100,
                   "resources": {"gpus": 0, "cpu": "500m", "memory": "2Gi"}},
    "vllm bf16": {"engine": "vllm", "model": "pvc://models/smollm2", "replicas": 0,
                          "engineArgs": {"dtype": "bfloat16"},
                          "resources": {"gpus": 0, "cpu": "1", "memory": "4Gi"}},
}  # fmt: skip


def colocated_run(replicas: int = 3, **rollout: Any) -> TrainingRun:
    return make_run(
        rollout={"pool": "pool", "colocated": {"replicas": replicas}, **rollout},
        resources={"cpu": "1", "memory": "6Gi"},
    )


def sidecars_of(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in pod["spec"]["initContainers"] if c.get("restartPolicy") == "Always"]


@pytest.mark.parametrize("pool_spec", COLOCATED_POOLS.values(), ids=COLOCATED_POOLS.keys())
def test_colocated_replicas_are_native_sidecars_sharing_the_trainers_dev_shm(
    pool_spec: dict[str, Any],
) -> None:
    """N sidecars (restartPolicy Always) on distinct ports, each probed on its own port and
    mounting the trainer's memory-backed /dev/shm; the trainer samples from their loopback
    URLs (which is what makes it publish through that /dev/shm) and follows no pool."""
    pool = make_pool(**pool_spec)
    run = colocated_run(3, colocated={"replicas": 3, "shmSizeLimit": "3Gi"})
    pod = run_builders.build_trainer_pod(run, CONFIG, 0, 0, colocated_pool=pool)
    spec = pod["spec"]
    sidecars = sidecars_of(pod)
    assert [c["name"] for c in sidecars] == ["rollout-0", "rollout-1", "rollout-2"]
    ports = [pool.spec.port + i for i in range(3)]
    assert [c["ports"] for c in sidecars] == [
        [{"name": f"rollout-{i}", "containerPort": port}] for i, port in enumerate(ports)
    ]
    for sidecar, port in zip(sidecars, ports, strict=True):
        command = sidecar["command"]
        assert command[command.index("--port") + 1] == str(port)
        assert command[command.index("--host") + 1] == "0.0.0.0"  # the kubelet probes the pod IP
        assert sidecar["readinessProbe"]["httpGet"]["port"] == sidecar["ports"][0]["name"]
        # No startup probe: the kubelet would start each sidecar only after the previous
        # one passed its own, loading the servers' models one after another.
        assert "startupProbe" not in sidecar
        assert {"name": "dshm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]
    # The regular init step (vLLM's fetch-model) runs once, before the first server.
    steps = [c["name"] for c in spec["initContainers"]]
    assert steps == (["rollout-fetch-model"] if pool.spec.engine == "vllm" else []) + [
        "rollout-0",
        "rollout-1",
        "rollout-2",
    ]
    (trainer,) = spec["containers"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in trainer["volumeMounts"]
    (shm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "3Gi"}
    env = env_of(trainer)
    assert env[env_names.ROLLOUT_ENDPOINTS]["value"] == ",".join(
        f"http://127.0.0.1:{port}" for port in ports
    )
    from posttrain.trainer.model.weight_sync import all_on_this_host

    assert all_on_this_host(env[env_names.ROLLOUT_ENDPOINTS]["value"].split(","))
    assert env_names.ROLLOUT_POOL not in env  # nothing to discover: no wait on the pool
    dtype = env.get(env_names.ROLLOUT_DTYPE, {}).get("value")
    assert dtype == ("bfloat16" if pool.spec.engine == "vllm" else None)
    # Loads need the pool's weight token, which the trainer and every server hold.
    for container in [trainer, *sidecars]:
        assert (
            env_of(container)[env_names.WEIGHTS_TOKEN]["valueFrom"]["secretKeyRef"]["name"]
            == "pool-weights-token"
        )
    # A server that restarts pulls the run's latest committed version on join.
    for sidecar in sidecars:
        assert env_of(sidecar)[env_names.WEIGHTS_URI]["value"] == (
            "s3://posttrain/runs/ml/demo/uid-run/weights"
        )
        assert env_names.WEIGHTS_POLL_SECONDS not in env_of(sidecar)
    # Names are unique in the pod, and every mount names a volume of the pod.
    names = [c["name"] for c in [*spec["initContainers"], *spec["containers"]]]
    assert len(names) == len(set(names))
    volumes = [v["name"] for v in spec["volumes"]]
    assert len(volumes) == len(set(volumes))
    for container in [*spec["initContainers"], *spec["containers"]]:
        assert {m["name"] for m in container["volumeMounts"]} <= set(volumes), container["name"]
    # The pod asks for the trainer plus three replicas: the scheduler places them together.
    for sidecar in sidecars:
        assert sidecar["resources"]["requests"]["cpu"] == pool.spec.resources.cpu


def test_each_sidecar_is_the_pools_own_server_but_for_where_it_listens() -> None:
    """The sidecar is the pool Deployment's server container (image, env, readiness probe,
    resources, securityContext): only its name, port, listen address, restart policy, volume
    names, weight source and the startup probe it does without differ, so the two cannot
    drift apart."""
    pool = make_pool(engine="vllm", resources={"gpus": 1}, weightUpdate={"sourceUri": "s3://b/w"})
    pod = run_builders.build_trainer_pod(colocated_run(2), CONFIG, 0, 0, colocated_pool=pool)
    (server,) = b.build_rollout_deployment(pool, CONFIG)["spec"]["template"]["spec"]["containers"]
    sidecar = sidecars_of(pod)[1]

    def comparable(container: dict[str, Any]) -> dict[str, Any]:
        left = {k: v for k, v in container.items()
                if k not in {"name", "ports", "command", "restartPolicy", "volumeMounts",
                             "readinessProbe", "startupProbe", "env"}}  # fmt: skip
        left["env"] = [e for e in container["env"]
                       if e["name"] not in (env_names.WEIGHTS_URI, env_names.WEIGHTS_POLL_SECONDS)]  # fmt: skip
        left["mounts"] = sorted(m["mountPath"] for m in container["volumeMounts"])
        probe = container["readinessProbe"]
        left["probe"] = {**probe, "httpGet": {**probe["httpGet"], "port": 0}}
        return left

    assert comparable(sidecar) == comparable(server)
    assert server["command"][server["command"].index("--host") + 1] == "$(POD_IP)"
    swapped = {"--host": "0.0.0.0", "--port": str(pool.spec.port + 1)}
    command = list(server["command"])
    for flag, value in swapped.items():
        command[command.index(flag) + 1] = value
    assert sidecar["command"] == command
    assert sidecar["resources"]["limits"]["nvidia.com/gpu"] == "1"  # a GPU per replica


def test_a_colocated_trainer_pod_is_pod_security_restricted_and_writes_only_to_its_volumes() -> (
    None
):
    """The trainer keeps its context and the servers keep the pool's (a read-only root):
    every container runs as uid 10001 with no capability, no privilege escalation and
    RuntimeDefault seccomp, and every place a server writes is an emptyDir of its own or
    the shared /dev/shm. tests/operator/test_pod_security_cluster.py has the apiserver's
    verdict on the same pod."""
    for pool_spec in COLOCATED_POOLS.values():
        pool = make_pool(**pool_spec)
        spec = run_builders.build_trainer_pod(colocated_run(2), CONFIG, 0, 0,
                                              colocated_pool=pool)["spec"]  # fmt: skip
        assert spec["securityContext"] == POSTTRAIN_POD_CONTEXT
        for container in [*spec["initContainers"], *spec["containers"]]:
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] == 10001
            assert context["allowPrivilegeEscalation"] is False and not context["privileged"]
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}
            server = container["name"].startswith("rollout-")
            assert context.get("readOnlyRootFilesystem", False) is server, container["name"]
            if not server:
                continue
            env = env_of(container)
            written = ["/tmp", b.POOL_HOME, env[env_names.CACHE]["value"]]
            written += [env[k]["value"] for k in (env_names.WEIGHTS_SCRATCH,) if k in env]
            if container.get("restartPolicy") == "Always":  # a server, not the fetch step
                written.append("/dev/shm")
            for path in written:
                assert "emptyDir" in _volume_under(spec, container, path), (container["name"], path)
        # Each server's /tmp and $HOME are its own, not the trainer's or another server's.
        tmp = [m["name"] for c in [*spec["initContainers"], *spec["containers"]]
               for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]  # fmt: skip
        assert sorted(set(tmp)) == sorted({"tmp", "rollout-0-tmp", "rollout-1-tmp"}), tmp
        for volume in spec["volumes"]:  # the volume kinds "restricted" allows
            assert {"emptyDir", "persistentVolumeClaim", "configMap"} & set(volume), volume
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)


def test_a_colocated_run_neither_reads_its_template_pool_nor_is_its_client() -> None:
    """No Role rule on the pool and no client label for its NetworkPolicy: the trainer
    samples from its own sidecars; a judge's pool is still read."""
    judge = {"kind": "judge", "judge": {"pool": "judge", "rubric": "{answer}"}}
    run = make_run(
        rollout={"pool": "pool", "colocated": {}},
        domains=[{"name": "d", "dataset": "builtin:arithmetic", "verifier": judge}],
    )
    assert run_builders.trainer_pools(run.spec) == ["judge"]
    assert run_builders.pool_client_labels(run) == {"client.posttrain.io/judge": "true"}
    role = next(m for m in run_builders.build_trainer_rbac(run) if m["kind"] == "Role")
    pools = [r for r in role["rules"] if r["resources"] == ["rolloutpools"]]
    assert pools == [{"apiGroups": ["posttrain.io"], "resources": ["rolloutpools"],
                      "verbs": ["get"], "resourceNames": ["judge"]}]  # fmt: skip


def test_only_the_metrics_port_of_a_colocated_trainer_pod_is_open_to_other_pods() -> None:
    """The sidecars listen on every interface (probes come to the pod IP), so the run gets a
    NetworkPolicy on its colocated pods: ingress to the metrics port only (node traffic and
    loopback are not subject to it); none for a run without colocated replicas, and a later
    gang without them is not selected (the label)."""
    pool = make_pool(engine="vllm", port=8000)
    run = colocated_run(2)
    pod = run_builders.build_trainer_pod(run, CONFIG, 0, 0, colocated_pool=pool)
    children = run_builders.build_trainer_children(run, CONFIG, 0)
    policy = next(m for m in children if m["kind"] == "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"ports": [{"port": CONFIG.pod_metrics_port}]}]
    assert CONFIG.pod_metrics_port not in range(8000, 8002)
    plain = make_run()
    plain_pod = run_builders.build_trainer_pod(plain, CONFIG, 0, 0)
    assert not selector.items() <= plain_pod["metadata"]["labels"].items()
    assert "NetworkPolicy" not in {m["kind"] for m in run_builders.build_trainer_children(
        plain, CONFIG, 0)}  # fmt: skip
    quiet = CONFIG.model_copy(update={"pod_metrics_port": 0})
    assert run_builders.build_colocated_network_policy(run, quiet)["spec"]["ingress"] == []


def test_a_colocated_trainer_pod_is_not_built_without_its_pool() -> None:
    """The replicas' template is the pool: without it the builder says what to create."""
    from posttrain.operator.shared.builders import BuildError

    with pytest.raises(BuildError, match=r"RolloutPool 'pool'.*replicas: 0 makes it only a"):
        run_builders.build_trainer_pod(colocated_run(1), CONFIG, 0, 0)
    other = RolloutPool.model_validate({"metadata": {"name": "other", "namespace": "ml",
                                                     "uid": "u"}, "spec": {"model": "m"}})  # fmt: skip
    with pytest.raises(BuildError):
        run_builders.build_trainer_pod(colocated_run(1), CONFIG, 0, 0, colocated_pool=other)


def test_colocated_ports_that_clash_with_the_trainers_are_refused() -> None:
    """The sidecars share the trainer's network namespace: a port the trainer serves
    metrics or torchrun's rendezvous on, or one past 65535, is a build error naming it."""
    from posttrain.operator.shared.builders import BuildError

    for port, named in ((9089, "metrics port 9090"), (29499, "rendezvous port 29500"),
                        (65534, "ports above 65535")):  # fmt: skip
        with pytest.raises(BuildError, match=f"{named}; give the pool another spec.port"):
            run_builders.build_trainer_pod(
                colocated_run(3), CONFIG, 0, 0, colocated_pool=make_pool(port=port)
            )
    run_builders.build_trainer_pod(colocated_run(3), CONFIG, 0, 0,
                                   colocated_pool=make_pool(port=9091))  # fmt: skip


def test_a_pool_of_zero_replicas_is_valid_and_serves_as_the_template() -> None:
    """replicas: 0 keeps the pool's Deployment empty (Ready, ScaledToZero) while a run
    colocates its replicas from it."""
    pool = make_pool(engine="cpu", replicas=0, resources={"gpus": 0})
    assert b.build_rollout_deployment(pool, CONFIG)["spec"]["replicas"] == 0
    pod = run_builders.build_trainer_pod(colocated_run(2), CONFIG, 0, 0, colocated_pool=pool)
    assert len(sidecars_of(pod)) == 2


@pytest.mark.parametrize(
    ("rollout", "resources", "message"),
    [
        ({"colocated": {}}, {}, "rollout.colocated takes its replicas' template from a "
                                "RolloutPool: set rollout.pool"),
        ({"pool": "p", "endpoints": ["http://a:1"], "colocated": {}}, {},
         "rollout.colocated and rollout.endpoints exclude each other"),
        ({"pool": "p", "colocated": {}}, {"nodes": 2}, "rollout.colocated runs the replicas "
         "inside the one trainer pod, so it needs resources.nodes: 1"),
        ({"pool": "p", "colocated": {"replicas": 0}}, {}, "greater than or equal to 1"),
    ],
)  # fmt: skip
def test_unsupported_colocations_are_refused_saying_what_to_do(
    rollout: dict[str, Any], resources: dict[str, Any], message: str
) -> None:
    """Multi-node trainers (a gang, or KubeRay's RayCluster: nodes > 1 only) sample from the
    pool's own replicas; the apiserver refuses the same (CEL, tests/api/test_bad_manifests)."""
    with pytest.raises(ValidationError, match=re.escape(message)):
        make_run(rollout=rollout, resources=resources)
