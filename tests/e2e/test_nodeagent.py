"""The local node agent against the real dev control plane: pods really run as processes."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.devenv.nodeagent import NodeAgent

from .conftest import wait_for

pytestmark = pytest.mark.cluster

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def core(kube_api: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube_api)


def read_pod(core: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return json.loads(core.read_namespaced_pod(name, namespace, _preload_content=False).data)
    except ApiException as err:
        if err.status == 404:
            return None
        raise


def pod_phase(core: Any, namespace: str, name: str) -> str | None:
    pod = read_pod(core, namespace, name)
    return ((pod or {}).get("status") or {}).get("phase")


def bare_pod(name: str, script: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": "python:3.11", "command": ["python", "-c", script]}
            ],
            **spec,
        },
    }


def host_pids_running(needle: str) -> list[int]:
    """Host pids whose command line contains ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if needle.encode() in cmdline:
                found.append(int(entry.name))
    return found


def pid_gone(pid: int) -> bool:
    """No such process, or only a zombie left (it no longer runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def test_pod_with_secret_env_and_configmap_volume_succeeds(
    agent: NodeAgent, core: Any, namespace: str
) -> None:
    core.create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "creds"},
            "data": {"AWS_ACCESS_KEY_ID": base64.b64encode(b"minio-key").decode()},
        },
    )
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cfg"}, "data": {"run.yaml": "steps: 3\n", "MODE": "fast"}}
    )
    script = (
        "import os, pathlib, sys\n"
        "cfg = pathlib.Path('/etc/posttrain/run.yaml').read_text().strip()\n"
        "pathlib.Path('/workspace/out.txt').write_text('x')\n"
        "msg = f\"{os.environ['AWS_ACCESS_KEY_ID']}|{os.environ['MODE']}|{cfg}|"
        "{os.environ['POD']}|{os.environ['NS']}|{sys.executable}\"\n"
        "pathlib.Path('/dev/termination-log').write_text(msg)\n"
        "sys.exit(0)\n"
    )
    body = bare_pod(
        "env-and-volumes",
        script,
        volumes=[
            {"name": "config", "configMap": {"name": "cfg"}},
            {"name": "workspace", "emptyDir": {}},
        ],
    )
    container = body["spec"]["containers"][0]
    container["env"] = [
        {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "AWS_ACCESS_KEY_ID"}},
        },
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    container["envFrom"] = [{"configMapRef": {"name": "cfg"}}]
    container["volumeMounts"] = [
        {"name": "config", "mountPath": "/etc/posttrain", "readOnly": True},
        {"name": "workspace", "mountPath": "/workspace"},
    ]
    core.create_namespaced_pod(namespace, body)

    wait_for(
        lambda: pod_phase(core, namespace, "env-and-volumes") == "Succeeded", what="pod Succeeded"
    )
    pod = read_pod(core, namespace, "env-and-volumes")
    assert pod is not None
    assert pod["spec"]["nodeName"] == agent.node_name  # bound through pods/binding
    assert pod["status"]["podIP"].startswith("127.")
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0
    assert terminated["reason"] == "Completed"
    key, mode, config, pod_name, pod_ns, executable = terminated["message"].split("|")
    assert (key, mode, config) == ("minio-key", "fast", "steps: 3")
    assert (pod_name, pod_ns) == ("env-and-volumes", namespace)
    # python resolved to the project's interpreter, not whatever the image would hold.
    assert Path(executable).parent == agent.python_bin_dir


def test_service_account_token_gives_in_cluster_api_access(
    agent: NodeAgent, kube_api: Any, core: Any, namespace: str
) -> None:
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(kube_api)
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "reader"}})
    rules = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "reader"}, "rules": rules})
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        },
    )
    # What the trainer's KubeStatusReporter does: in-cluster config, then an API call.
    script = (
        "import json, os, pathlib\n"
        "from kubernetes import client, config\n"
        "config.load_incluster_config()\n"
        "ns = pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read_text()\n"
        "raw = client.CoreV1Api().read_namespaced_pod('api-user', ns, _preload_content=False)\n"
        "pathlib.Path('/dev/termination-log').write_text(json.loads(raw.data)['spec']"
        "['serviceAccountName'])\n"
    )
    core.create_namespaced_pod(namespace, bare_pod("api-user", script, serviceAccountName="reader"))

    wait_for(
        lambda: pod_phase(core, namespace, "api-user") in ("Succeeded", "Failed"),
        what="pod finished",
    )
    pod = read_pod(core, namespace, "api-user")
    assert pod is not None
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    log_text = agent.log_path(namespace, "api-user").read_text()
    assert terminated["exitCode"] == 0, log_text
    assert terminated["message"] == "reader"


def test_a_pod_sees_neither_other_pods_tokens_nor_the_dev_state(
    agent: NodeAgent, core: Any, namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a kubelet, a pod's view holds its own service-account token only: not the other
    pods' directories (where their tokens are), not the agent's serving key, not the dev
    environment's state (its PKI and MinIO keys)."""
    dev_dir = tmp_path / "dev"
    (dev_dir / "env/controlplane/pki").mkdir(parents=True)
    (dev_dir / "state.json").write_text('{"minio_secret_key": "root"}')
    monkeypatch.setenv("POSTTRAIN_DEV_DIR", str(dev_dir))
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "holder"}})
    holder = bare_pod("holder", "import time; time.sleep(120)", serviceAccountName="holder")
    core.create_namespaced_pod(namespace, holder)
    wait_for(lambda: pod_phase(core, namespace, "holder") == "Running", what="holder running")
    pods_dir = agent.workdir / "pods"
    holder_dir = next(pods_dir.glob(f"{namespace}_holder_*"))
    token = holder_dir / "serviceaccount" / "token"
    assert token.is_file()  # on the host it is there: the pod must not see it
    probes = {
        "token": str(token),
        "pods": str(pods_dir),
        "state": str(dev_dir / "state.json"),
        "agent": str(agent.workdir / "kubelet-pki"),
    }
    script = (
        "import json, os, pathlib\n"
        f"probes = {probes!r}\n"
        "seen = {k: os.path.exists(p) for k, p in probes.items()}\n"
        "seen['pods'] = sorted(os.listdir(probes['pods']))\n"
        "seen['own'] = pathlib.Path('/var/run/secrets/kubernetes.io/serviceaccount/token')"
        ".is_file()\n"
        "pathlib.Path('/dev/termination-log').write_text(json.dumps(seen))\n"
    )
    core.create_namespaced_service_account(namespace, {"metadata": {"name": "snooper"}})
    core.create_namespaced_pod(namespace, bare_pod("snooper", script, serviceAccountName="snooper"))
    wait_for(
        lambda: pod_phase(core, namespace, "snooper") in ("Succeeded", "Failed"),
        what="snooper finished",
    )
    pod = read_pod(core, namespace, "snooper")
    assert pod is not None
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0, agent.log_path(namespace, "snooper").read_text()
    seen = json.loads(terminated["message"])
    own = pod["metadata"]["uid"]
    assert seen.pop("pods") == [f"{namespace}_snooper_{own}"]  # its own directory only
    assert seen == {
        "token": False,
        "state": False,
        "agent": False,
        "own": True,
    }


def test_failing_pod_reports_exit_code_and_log_fallback(
    agent: NodeAgent, core: Any, namespace: str
) -> None:
    body = bare_pod("fails", "import sys; print('boom: bad input'); sys.exit(3)")
    body["spec"]["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
    core.create_namespaced_pod(namespace, body)

    wait_for(lambda: pod_phase(core, namespace, "fails") == "Failed", what="pod Failed")
    pod = read_pod(core, namespace, "fails")
    assert pod is not None
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["reason"] == "Error"
    assert "boom: bad input" in terminated["message"]
    assert "boom: bad input" in agent.log_path(namespace, "fails").read_text()


def test_pod_logs_are_served_through_the_apiserver(
    agent: NodeAgent, core: Any, namespace: str
) -> None:
    """`kubectl logs` / `posttrain logs` read pods/log, which the apiserver proxies to the
    node's kubelet: the agent serves that endpoint from its log files (no "no such host")."""
    core.create_namespaced_pod(
        namespace, bare_pod("talker", "print('line one'); print('line two')")
    )
    wait_for(lambda: pod_phase(core, namespace, "talker") == "Succeeded", what="pod Succeeded")
    assert core.read_namespaced_pod_log("talker", namespace, container="main") == (
        "line one\nline two\n"
    )
    assert core.read_namespaced_pod_log("talker", namespace, tail_lines=1) == "line two\n"


def test_deleting_running_pod_kills_its_process(
    agent: NodeAgent, core: Any, namespace: str
) -> None:
    marker = f"time.sleep({600 + int(namespace[2:], 16) % 1000}.5)"  # unique on the host
    core.create_namespaced_pod(namespace, bare_pod("sleeper", f"import time; {marker}"))
    wait_for(lambda: pod_phase(core, namespace, "sleeper") == "Running", what="pod Running")
    # The pod has its own pid namespace: find its processes (bwrap's and the program's) by
    # command line, in the host's.
    pids = wait_for(lambda: host_pids_running(marker), what="the pod's processes")
    assert not any(pid_gone(pid) for pid in pids)

    core.delete_namespaced_pod("sleeper", namespace)  # graceful: the agent finalizes it
    wait_for(lambda: all(map(pid_gone, pids)), timeout_s=60, what=f"processes {pids} gone")
    wait_for(lambda: read_pod(core, namespace, "sleeper") is None, what="pod object removed")


def test_pod_past_active_deadline_is_killed(agent: NodeAgent, core: Any, namespace: str) -> None:
    # What bounds a SandboxTask's timeoutSeconds: the kubelet's activeDeadlineSeconds.
    body = bare_pod("too-slow", "import time; time.sleep(600)", activeDeadlineSeconds=1)
    core.create_namespaced_pod(namespace, body)

    wait_for(lambda: pod_phase(core, namespace, "too-slow") == "Failed", what="pod Failed")
    pod = read_pod(core, namespace, "too-slow")
    assert pod is not None
    assert pod["status"]["reason"] == "DeadlineExceeded"
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "DeadlineExceeded")


def test_deployment_replicas_readiness_and_scale_down(
    agent: NodeAgent, kube_api: Any, core: Any, namespace: str
) -> None:
    from kubernetes import client

    apps = client.AppsV1Api(kube_api)
    labels = {"app": "web"}
    server = {
        "name": "server",
        "image": "python:3.11",
        # Each replica binds its own loopback pod IP, so both can use port 8000.
        "command": ["python", "-m", "http.server", "--bind", "$(POD_IP)", "8000"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
    }
    template = {"metadata": {"labels": labels}, "spec": {"containers": [server]}}
    apps.create_namespaced_deployment(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": template},
        },
    )

    def deployment_status() -> dict[str, Any]:
        raw = apps.read_namespaced_deployment("web", namespace, _preload_content=False).data
        return json.loads(raw).get("status") or {}

    status = wait_for(
        lambda: (s := deployment_status()).get("readyReplicas") == 2 and s,
        timeout_s=45,
        what="2 ready replicas",
    )
    assert status["replicas"] == 2 and status["availableReplicas"] == 2
    assert status["observedGeneration"] == 1
    pods = {name: read_pod(core, namespace, name) for name in ("web-0", "web-1")}
    for pod in pods.values():
        assert pod is not None and pod["status"]["phase"] == "Running"
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
        assert pod["status"]["containerStatuses"][0]["ready"] is True
    assert pods["web-0"]["status"]["podIP"] != pods["web-1"]["status"]["podIP"]

    apps.patch_namespaced_deployment_scale("web", namespace, {"spec": {"replicas": 1}})
    wait_for(lambda: read_pod(core, namespace, "web-1") is None, what="web-1 deleted")
    status = wait_for(
        lambda: (s := deployment_status()).get("replicas") == 1 and s, what="status replicas 1"
    )
    assert status["readyReplicas"] == 1
    assert status["observedGeneration"] == 2
    assert pod_phase(core, namespace, "web-0") == "Running"


def test_sandbox_task_from_example_succeeds_through_operator(
    crds_installed: None, kube_api: Any, kubeconfig: Path, agent: NodeAgent, namespace: str
) -> None:
    from kubernetes import client

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        s3_endpoint="127.0.0.1:9000",
        max_workers=4,
    )
    task = yaml.safe_load((REPO_ROOT / "examples" / "sandbox-task.yaml").read_text())
    task["metadata"]["namespace"] = namespace
    custom = client.CustomObjectsApi(kube_api)
    operator = OperatorThread(config).start()
    try:
        custom.create_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, "sandboxtasks", task
        )
        name = task["metadata"]["name"]

        def status() -> dict[str, Any]:
            obj = custom.get_namespaced_custom_object(
                "posttrain.io", "v1alpha1", namespace, "sandboxtasks", name
            )
            return obj.get("status") or {}

        final = wait_for(
            lambda: (s := status()).get("phase") in ("Succeeded", "Failed") and s,
            timeout_s=60,
            what="SandboxTask finished",
        )
    finally:
        operator.stop()
    log_text = agent.log_path(namespace, f"{name}-1").read_text()
    assert final["phase"] == "Succeeded", (final, log_text)
    assert final["exitCode"] == 0
    # The program really ran: its own output, after the init container's cp.
    assert "all tests passed" in log_text
    if os.geteuid() == 0:
        # Root agent: the sandbox's runAsUser 65534 was honoured by dropping privileges.
        workdir = next((agent.workdir / "pods").glob(f"{namespace}_{name}-1_*")) / "volumes"
        assert (workdir / "workdir" / "main.py").stat().st_uid == 65534


def test_warm_pool_pod_is_claimed_and_runs_the_task(
    crds_installed: None, kube_api: Any, kubeconfig: Path, agent: NodeAgent, namespace: str
) -> None:
    """A SandboxWarmPool's idle pod runs its waiting entrypoint here; a task claims it through
    the claim annotation, which the agent projects into the pod's downward-API file."""
    from kubernetes import client

    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.runtime import OperatorThread

    config = OperatorConfig(
        kubeconfig=str(kubeconfig),
        namespaces=(namespace,),
        standalone=True,
        resync_seconds=1.0,
        max_workers=4,
    )
    custom = client.CustomObjectsApi(kube_api)
    core = client.CoreV1Api(kube_api)

    def get(plural: str, name: str) -> dict[str, Any]:
        obj = custom.get_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, plural, name
        )
        return obj.get("status") or {}

    operator = OperatorThread(config).start()
    try:
        custom.create_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, "sandboxwarmpools",
            {"apiVersion": "posttrain.io/v1alpha1", "kind": "SandboxWarmPool",
             "metadata": {"name": "warm"}, "spec": {"replicas": 1}},
        )  # fmt: skip
        wait_for(
            lambda: get("sandboxwarmpools", "warm").get("readyReplicas") == 1,
            timeout_s=60,
            what="one idle warm pod ready",
        )
        (idle,) = core.list_namespaced_pod(
            namespace, label_selector="posttrain.io/warm-pool=warm"
        ).items
        custom.create_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, "sandboxtasks",
            {"apiVersion": "posttrain.io/v1alpha1", "kind": "SandboxTask",
             "metadata": {"name": "warm-task"},
             "spec": {"warmPoolRef": "warm", "command": ["python3", "main.py"],
                      "files": {"main.py": "print('hello from a warm pod')\n"}}},
        )  # fmt: skip
        final = wait_for(
            lambda: (
                (s := get("sandboxtasks", "warm-task")).get("phase") in ("Succeeded", "Failed")
                and s
            ),
            timeout_s=60,
            what="warm SandboxTask finished",
        )
    finally:
        operator.stop()
    log_text = agent.log_path(namespace, idle.metadata.name).read_text()
    assert final["phase"] == "Succeeded", (final, log_text)
    assert final["podName"] == idle.metadata.name  # the pre-started pod, not a cold one
    assert final["warmPool"] == "warm" and final["exitCode"] == 0
    assert "hello from a warm pod" in log_text


def test_children_go_with_their_owner_through_the_garbage_collector_stand_in(
    crds_installed: None, agent: NodeAgent, kube_api: Any, core: Any, namespace: str
) -> None:
    """Deleting a RolloutPool removes its Deployment, Service and server pod; deleting a
    TrainingRun its pod and ConfigMap; what a live owner owns stays. The children are the
    operator's own builders' (their ownerReferences are what is tested), with a cheap
    command instead of the rollout server (issue #35)."""
    from kubernetes import client

    from posttrain.api import RolloutPool, TrainingRun
    from posttrain.api.base import GROUP, VERSION
    from posttrain.operator.config import OperatorConfig
    from posttrain.operator.rolloutpool import builders as pool_builders
    from posttrain.operator.trainingrun import builders as b

    custom, apps = client.CustomObjectsApi(kube_api), client.AppsV1Api(kube_api)

    def create(plural: str, body: dict[str, Any]) -> dict[str, Any]:
        body = {"apiVersion": f"{GROUP}/{VERSION}", **body}
        return custom.create_namespaced_custom_object(GROUP, VERSION, namespace, plural, body)  # type: ignore[no-any-return]

    def cheap(pod_spec: dict[str, Any]) -> None:
        pod_spec.pop("initContainers", None)
        pod_spec.pop("volumes", None)
        (container,) = pod_spec["containers"]
        for key in ("readinessProbe", "startupProbe", "livenessProbe", "volumeMounts", "env"):
            container.pop(key, None)
        container["command"] = ["python", "-c", "import time; time.sleep(300)"]

    pool = RolloutPool.model_validate(
        create("rolloutpools", {"kind": "RolloutPool", "metadata": {"name": "p"},
                                "spec": {"model": "smollm2-135m-instruct", "engine": "cpu"}})
    )  # fmt: skip
    deployment = pool_builders.build_rollout_deployment(pool, OperatorConfig())
    cheap(deployment["spec"]["template"]["spec"])
    apps.create_namespaced_deployment(namespace, deployment)
    core.create_namespaced_service(namespace, pool_builders.build_rollout_service(pool))
    spec = {"model": "m", "domains": [{"name": "a", "dataset": "builtin:arithmetic",
                                       "verifier": {"kind": "numeric"}}]}  # fmt: skip
    runs = {
        name: TrainingRun.model_validate(
            create(
                "trainingruns", {"kind": "TrainingRun", "metadata": {"name": name}, "spec": spec}
            )
        )
        for name in ("gone", "kept")
    }
    for run in runs.values():
        core.create_namespaced_config_map(namespace, b.build_run_config_map(run, OperatorConfig()))
        pod = b.build_trainer_pod(run, OperatorConfig(), 0, 0)
        cheap(pod["spec"])
        core.create_namespaced_pod(namespace, pod)
    for name in ("p-0", "gone-g0-0", "kept-g0-0"):
        wait_for(lambda n=name: pod_phase(core, namespace, n) == "Running", what=f"{name} runs")

    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "rolloutpools", "p")
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "trainingruns", "gone")

    def names(listed: Any) -> set[str]:
        return {i["metadata"]["name"] for i in json.loads(listed.data)["items"]}

    def left() -> set[str]:
        return (
            names(apps.list_namespaced_deployment(namespace, _preload_content=False))
            | names(core.list_namespaced_service(namespace, _preload_content=False))
            | names(core.list_namespaced_pod(namespace, _preload_content=False))
            | names(core.list_namespaced_config_map(namespace, _preload_content=False))
        )

    # kube-root-ca.crt: the namespace's own ConfigMap, owned by nothing.
    wait_for(lambda: left() <= {"kept-g0-0", "kept-config", "kube-root-ca.crt"} and left(),
             timeout_s=60, what="the deleted owners' children gone")  # fmt: skip
    assert {"kept-g0-0", "kept-config"} <= left()
    assert pod_phase(core, namespace, "kept-g0-0") == "Running"
