"""A local node agent for the dev control plane: a DEVELOPMENT AID, not a product component.

``posttrain dev up`` runs etcd + kube-apiserver only: no scheduler, no kubelet, no
controller-manager, so the pods the operator creates would sit in Pending forever. This agent
plays those three roles just far enough for end-to-end runs on one machine:

* **node + scheduler**: registers one Node (Ready, ``nvidia.com/gpu: 0``), heartbeats it, and
  binds every unscheduled pod to itself through the ``pods/binding`` subresource (it ignores
  nodeSelector, tolerations and resource requests: there is only one node).
* **kubelet**: runs each pod's init containers and then its first container's command as a
  local process group (no images, no containers): env resolved from the spec, volumes
  materialised in a per-pod directory and bound at their mountPaths with bubblewrap, so the
  command sees ``/etc/posttrain/run.yaml`` and ``/workspace`` as the pod spec says. It writes
  pod status the way the kubelet does (Running, then Succeeded/Failed with exit code, reason
  and the termination message), polls httpGet readiness probes, mounts a ServiceAccount
  token (so in-cluster clients such as the trainer's status reporter work) and kills the
  process group when the pod is deleted.
* **Deployment controller stand-in**: keeps ``spec.replicas`` pods per Deployment and writes
  the Deployment's status (see :class:`DeploymentStandIn` for its limits).

Images are not pulled: ``posttrain``/``python``/``python3`` resolve to a local environment of
the checked-out project chosen by the image's repository name (``rollout`` images -- the
operator's vLLM image -- run ``.venv-vllm``, everything else the agent's own venv; see
:func:`default_image_bin_dirs`), other commands (``cp``, ``sh``) to the host's binaries. Each pod gets its own loopback
address (127.0.0.2, 127.0.0.3, ...) as podIP, so two replicas that bind their pod IP don't
collide; processes that bind 0.0.0.0 share the host's ports (one replica per port).
When the agent runs as root it honours ``runAsUser``/``runAsGroup`` by dropping privileges
with ``setpriv``; as another user it runs everything as that user.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from posttrain.telemetry import get_tracer

from . import registry
from .kubeletlogs import KubeletLogServer
from .podprocess import (
    DEFAULT_TERMINATION_PATH,
    ContainerResult,
    Manifest,
    PodSpecError,
    bwrap_prefix,
    chown_tree,
    decode_secret_data,
    expand_references,
    field_ref_value,
    hosts_file_text,
    http_probe,
    kill_process_group,
    now_rfc3339,
    pod_conditions,
    python_bin_dir_for,
    read_termination_message,
    resolve_executable,
    run_as_user,
    running_status,
    service_host_entries,
    terminated_status,
    waiting_status,
    write_projection,
)

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

PODS_STARTED = Counter(
    "posttrain_nodeagent_pods_started_total",
    "Pods whose main container the local node agent started",
)
PODS_FINISHED = Counter(
    "posttrain_nodeagent_pods_finished_total",
    "Pods the local node agent saw end, by final phase",
    ["phase"],
)
PODS_RUNNING = Gauge(
    "posttrain_nodeagent_pods_running", "Pods whose process the local node agent is running now"
)

DEFAULT_NODE_NAME = "posttrain-local"
# Dev runs want quick teardown; a 30 s default grace would make every test wait.
MAX_GRACE_SECONDS = 5.0
HEARTBEAT_SECONDS = 10.0


@functools.cache
def host_hosts_text() -> str:
    """The host's /etc/hosts, the base of every pod's (pods share the host network)."""
    try:
        return Path("/etc/hosts").read_text()
    except OSError:
        return "127.0.0.1 localhost\n"


TEMPLATE_HASH_ANNOTATION = "posttrain.io/devenv-template-hash"
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# Tokens are requested for an hour and rewritten at half-life, as the kubelet does.
TOKEN_SECONDS = 3600
# Status lists (conditions, containerStatuses) are always sent whole, so a merge patch
# replacing them is exactly what we mean, and it needs no strategic-merge keys.
MERGE_PATCH = "application/merge-patch+json"


class PodDeleted(Exception):
    """The pod was deleted before its next container could start."""


# ---------------------------------------------------------------- pure helpers


def template_hash(template: Manifest) -> str:
    """Digest of a pod template: a changed template means the stand-in recreates the pods.

    >>> template_hash({"a": 1}) == template_hash({"a": 1}) != template_hash({"a": 2})
    True
    """
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def loopback_address(index: int) -> str:
    """The ``index``-th per-pod loopback address (127.0.0.1 stays the host's own).

    >>> loopback_address(0), loopback_address(253), loopback_address(254)
    ('127.0.0.2', '127.0.0.255', '127.0.1.2')
    """
    block, offset = divmod(index, 254)
    return f"127.{block // 256}.{block % 256}.{offset + 2}"


def pod_is_ready(pod: Manifest) -> bool:
    """Whether the pod's Ready condition is True (what a Deployment counts as ready)."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def controller_uid(obj: Manifest) -> str | None:
    """The uid of ``obj``'s controlling owner, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


# ---------------------------------------------------------------- API access


class Cluster:
    """The few raw-dict API calls the agent needs, on a ``kubernetes.client.ApiClient``.

    Raw JSON (``_preload_content=False``) keeps objects in their wire form (camelCase),
    the same form the operator's builders produce, and sidesteps the generated client's
    model validation (V1Binding responses fail to deserialize there).
    """

    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    @staticmethod
    def _json(response: Any) -> Manifest:
        return json.loads(response.data or b"{}")

    def _list(
        self,
        all_namespaces: Callable[..., Any],
        namespaced: Callable[..., Any],
        namespaces: Sequence[str] | None,
    ) -> list[Manifest]:
        """Items of one kind, cluster-wide (``namespaces`` None) or from each namespace."""
        if namespaces is None:
            return self._json(all_namespaces(_preload_content=False))["items"]
        return [
            item
            for ns in namespaces
            for item in self._json(namespaced(ns, _preload_content=False))["items"]
        ]

    def list_pods(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.core.list_pod_for_all_namespaces, self.core.list_namespaced_pod, namespaces
        )

    def list_deployments(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.apps.list_deployment_for_all_namespaces,
            self.apps.list_namespaced_deployment,
            namespaces,
        )

    def list_services(self, namespaces: Sequence[str] | None) -> list[Manifest]:
        return self._list(
            self.core.list_service_for_all_namespaces, self.core.list_namespaced_service, namespaces
        )

    def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        from kubernetes.client.exceptions import ApiException

        read = {
            "Secret": self.core.read_namespaced_secret,
            "ConfigMap": self.core.read_namespaced_config_map,
        }[kind]
        try:
            return self._json(read(name, namespace, _preload_content=False))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def service_account_token(self, namespace: str, name: str) -> str | None:
        """A bound token for ServiceAccount ``namespace/name`` (TokenRequest); None if absent."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": TOKEN_SECONDS},
        }
        try:
            response = self.core.create_namespaced_service_account_token(
                name,
                namespace,
                client.AuthenticationV1TokenRequest.model_validate(body),
                _preload_content=False,
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return str(self._json(response)["status"]["token"])

    def apiserver_address(self) -> tuple[str, int, str | None]:
        """(host, port, CA file) of the apiserver this agent talks to, for in-cluster clients."""
        from urllib.parse import urlparse

        configuration = self.api_client.configuration
        url = urlparse(configuration.host)
        return url.hostname or "127.0.0.1", url.port or 443, configuration.ssl_ca_cert

    def bind(self, namespace: str, name: str, node_name: str) -> None:
        from kubernetes import client

        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node_name},
        }
        self.core.create_namespaced_pod_binding(
            name, namespace, client.V1Binding.model_validate(body), _preload_content=False
        )

    def patch_pod_status(self, namespace: str, name: str, status: Manifest) -> None:
        self.core.patch_namespaced_pod_status(
            name, namespace, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(
                name, namespace, grace_period_seconds=grace_seconds, _preload_content=False
            )
        except ApiException as err:
            if err.status != 404:
                raise

    def create_pod(self, namespace: str, body: Manifest) -> None:
        from kubernetes import client

        self.core.create_namespaced_pod(
            namespace, client.V1Pod.model_validate(body), _preload_content=False
        )

    def patch_deployment_status(self, namespace: str, name: str, status: Manifest) -> None:
        self.apps.patch_namespaced_deployment_status(
            name, namespace, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )

    def ensure_node(self, node: Manifest) -> None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.create_node(client.V1Node.model_validate(node), _preload_content=False)
        except ApiException as err:
            if err.status != 409:
                raise
        self.patch_node_status(node["metadata"]["name"], node["status"])

    def patch_node_status(self, name: str, status: Manifest) -> None:
        self.core.patch_node_status(
            name, {"status": status}, _preload_content=False, _content_type=MERGE_PATCH
        )


# ---------------------------------------------------------------- one pod


@dataclass
class PodRunner:
    """Runs one pod on this host: volumes, init containers, main container, status.

    One thread per pod; the agent's loop calls :meth:`stop` when the pod is deleted.
    """

    cluster: Cluster
    pod: Manifest
    pod_ip: str
    workdir: Path
    python_bin_dir: Path
    on_exit: Callable[[PodRunner], None] | None = None
    # image repository name -> the bin/ of the environment standing in for that image
    image_bin_dirs: dict[str, Path] = field(default_factory=dict)
    stopped: threading.Event = field(default_factory=threading.Event)
    process_lock: threading.Lock = field(default_factory=threading.Lock)
    service_account_dir: Path | None = None
    token_refresh_at: float = 0.0
    process: subprocess.Popen[bytes] | None = None
    thread: threading.Thread | None = None
    ready: bool = False
    probe_failures: int = 0
    started_at: float = 0.0
    hosts_text: str | None = None  # what update_hosts last wrote
    register_processes: bool = False  # record pod processes for `posttrain dev down`

    @property
    def namespace(self) -> str:
        return str(self.pod["metadata"]["namespace"])

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])

    @property
    def pod_dir(self) -> Path:
        return self.workdir / "pods" / f"{self.namespace}_{self.name}_{self.pod['metadata']['uid']}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.namespace}_{self.name}.log"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def hosts_path(self) -> Path:
        return self.pod_dir / "hosts"

    def update_hosts(self, service_lines: list[str]) -> None:
        """(Re)write the pod's /etc/hosts when its namespace's Services changed.

        Written in place (same inode), not renamed: the file is bind-mounted into the
        running process's view, and a rename would leave the mount on the old file.
        """
        text = hosts_file_text(host_hosts_text(), self.name, self.pod_ip, service_lines)
        if text == self.hosts_text:
            return  # called every poll: compare in memory, touch the file only on a change
        self.pod_dir.mkdir(parents=True, exist_ok=True)
        with open(self.hosts_path, "w") as hosts:
            hosts.write(text)
        self.hosts_text = text

    def start(self) -> PodRunner:
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        """Kill the running process group (SIGTERM, then SIGKILL after the grace period)."""
        with self.process_lock:
            self.stopped.set()
            process = self.process
        grace = min(
            float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)), MAX_GRACE_SECONDS
        )
        kill_process_group(process, grace)
        if self.thread is not None:
            self.thread.join(timeout=grace + 5)

    # -------------------------------------------------------------- lifecycle

    def _run(self) -> None:
        with tracer.start_as_current_span("nodeagent.pod") as span:
            span.set_attribute("pod", f"{self.namespace}/{self.name}")
            try:
                phase = self._run_pod()
            except PodDeleted:
                phase = "Deleted"
            except PodSpecError as err:
                log.warning("pod %s/%s cannot run locally: %s", self.namespace, self.name, err)
                phase = "Failed"
                self._patch_status(
                    {"phase": "Failed", "reason": "UnsupportedPodSpec", "message": str(err)}
                )
            except Exception:
                if self.stopped.is_set():
                    phase = "Deleted"
                else:
                    log.exception("pod %s/%s: agent error", self.namespace, self.name)
                    phase = "Failed"
                    self._patch_status(
                        {
                            "phase": "Failed",
                            "reason": "NodeAgentError",
                            "message": "local node agent error; see the agent's own log",
                        }
                    )
            span.set_attribute("phase", phase)
            PODS_FINISHED.labels(phase=phase).inc()
            if self.on_exit is not None:
                self.on_exit(self)

    def _run_pod(self) -> str:
        spec = self.pod["spec"]
        volumes = self._materialise_volumes()
        self._write_service_account_token()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        deadline = self._deadline()
        init_statuses: list[Manifest] = []
        for container in spec.get("initContainers") or []:
            if self.stopped.is_set():
                return "Deleted"
            result = self._run_container(container, volumes, deadline, probe=False)
            init_statuses.append(terminated_status(container, result))
            if result.exit_code != 0:
                self._patch_status(
                    {
                        "phase": "Failed",
                        "initContainerStatuses": init_statuses,
                        "containerStatuses": [
                            waiting_status(spec["containers"][0], "PodInitializing")
                        ],
                    }
                )
                return "Failed"
        if self.stopped.is_set():
            return "Deleted"
        main = spec["containers"][0]
        if len(spec["containers"]) > 1:
            log.warning(
                "pod %s/%s: only the first container (%s) runs locally",
                self.namespace,
                self.name,
                main["name"],
            )
        result = self._run_container(
            main, volumes, deadline, probe=True, init_statuses=init_statuses
        )
        if self.stopped.is_set():
            return "Deleted"
        phase = "Succeeded" if result.exit_code == 0 else "Failed"
        status: Manifest = {
            "phase": phase,
            "conditions": pod_conditions(ready=False),
            "containerStatuses": [terminated_status(main, result)],
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        if result.reason == "DeadlineExceeded":
            status.update(
                reason="DeadlineExceeded",
                message="Pod was active on the node longer than the specified deadline",
            )
        self._patch_status(status)
        log.info("pod %s/%s %s (exit %d)", self.namespace, self.name, phase, result.exit_code)
        return phase

    def _deadline(self) -> float | None:
        """From the pod's start, like the kubelet's; re-read because a claim may set it later."""
        seconds = self.pod["spec"].get("activeDeadlineSeconds")
        return self.started_at + float(seconds) if seconds else None

    def _run_container(
        self,
        container: Manifest,
        volumes: dict[str, Path],
        deadline: float | None,
        probe: bool,
        init_statuses: list[Manifest] | None = None,
    ) -> ContainerResult:
        termination_file = self.pod_dir / "termination" / container["name"]
        termination_file.parent.mkdir(parents=True, exist_ok=True)
        termination_file.write_text("")
        user = run_as_user(self.pod["spec"], container)
        if user is not None and os.geteuid() == 0:
            # As the kubelet does: the container's user writes its own termination message.
            os.chown(termination_file, *user)
        argv, env = self._container_argv(container, volumes, termination_file)
        started = now_rfc3339()
        with open(self.log_path, "ab") as log_file:
            shown = " ".join([*container.get("command", []), *container.get("args", [])])
            log_file.write(f"==> container {container['name']}: {shown}\n".encode())
            log_file.flush()
            # Under the lock so stop() either sees this process or we see stop()'s flag:
            # a pod deleted while its previous container ends never leaks the next one.
            with self.process_lock:
                if self.stopped.is_set():
                    raise PodDeleted(self.name)
                self.process = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                if self.register_processes:  # its own session: dev down stops the group
                    registry.register("pod", pid=self.process.pid, group=True)
        if probe:
            PODS_STARTED.inc()
            PODS_RUNNING.inc()
            running: Manifest = {
                "phase": "Running",
                "podIP": self.pod_ip,
                "podIPs": [{"ip": self.pod_ip}],
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "startTime": started,
                "conditions": pod_conditions(ready=False),
                "containerStatuses": [running_status(container, started, ready=False)],
            }
            if init_statuses:
                running["initContainerStatuses"] = init_statuses
            self._patch_status(running)
        try:
            exit_code, reason = self._wait(container, deadline, probe, started)
        finally:
            if probe:
                PODS_RUNNING.dec()
            if self.register_processes:
                registry.unregister(self.process.pid)
        message = read_termination_message(
            termination_file,
            self.log_path,
            exit_code,
            container.get("terminationMessagePolicy", "File"),
        )
        if reason is None:
            reason = "Completed" if exit_code == 0 else "Error"
        return ContainerResult(exit_code, reason, message, started, now_rfc3339())

    def _wait(
        self, container: Manifest, deadline: float | None, probe: bool, started: str
    ) -> tuple[int, str | None]:
        """Wait for the process, polling readiness; kill it at the pod's deadline."""
        assert self.process is not None
        readiness = container.get("readinessProbe") if probe else None
        period = float((readiness or {}).get("periodSeconds", 10))
        next_probe = time.monotonic() + float((readiness or {}).get("initialDelaySeconds", 0))
        if probe and readiness is None:
            self._set_ready(container, started, True)
        while True:
            code = self.process.poll()
            if code is not None:
                # A negative code is "killed by signal N"; a shell reports 128 + N.
                return (128 - code if code < 0 else code), None
            if self.service_account_dir is not None and time.monotonic() > self.token_refresh_at:
                self._write_service_account_token()
            deadline = self._deadline()
            if deadline is not None and time.monotonic() > deadline:
                kill_process_group(self.process, 0)
                return 137, "DeadlineExceeded"
            if readiness is not None and time.monotonic() >= next_probe:
                self._record_probe(container, started, readiness)
                next_probe = time.monotonic() + period
            time.sleep(0.1)

    def _record_probe(self, container: Manifest, started: str, readiness: Manifest) -> None:
        """One readiness probe; Ready flips off only after failureThreshold misses in a row."""
        if http_probe(readiness, container, self.pod_ip):
            self.probe_failures = 0
            self._set_ready(container, started, True)
            return
        self.probe_failures += 1
        if not self.ready or self.probe_failures >= int(readiness.get("failureThreshold", 3)):
            self._set_ready(container, started, False)

    def _set_ready(self, container: Manifest, started: str, ready: bool) -> None:
        if ready == self.ready:
            return
        self.ready = ready
        self._patch_status(
            {
                "conditions": pod_conditions(ready=ready),
                "containerStatuses": [running_status(container, started, ready)],
            }
        )

    def _patch_status(self, status: Manifest) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.cluster.patch_pod_status(self.namespace, self.name, status)
        except ApiException as err:
            # A pod deleted while we report on it is not an error: the loop stops us next.
            if err.status != 404:
                raise

    # -------------------------------------------------------------- process view

    def _container_argv(
        self, container: Manifest, volumes: dict[str, Path], termination_file: Path
    ) -> tuple[list[str], dict[str, str]]:
        env = self._container_env(container)
        command = [expand_references(str(a), env) for a in container.get("command") or []]
        args = [expand_references(str(a), env) for a in container.get("args") or []]
        if not command:
            raise PodSpecError(
                f"container {container['name']!r} has no command; the local agent cannot read "
                "an image's entrypoint, so give the container an explicit command"
            )
        argv = [
            resolve_executable(command[0], env["PATH"], self.bin_dir(container)),
            *command[1:],
            *args,
        ]
        mounts: list[tuple[str, str, bool]] = []
        for mount in container.get("volumeMounts") or []:
            source = volumes.get(mount["name"])
            if source is None:
                raise PodSpecError(f"volumeMount {mount['name']!r} names no volume of the pod")
            if mount.get("subPath"):
                source = source / mount["subPath"]
            mounts.append((str(source), mount["mountPath"], bool(mount.get("readOnly"))))
        termination_path = container.get("terminationMessagePath", DEFAULT_TERMINATION_PATH)
        mounts.append((str(termination_file), termination_path, False))
        if self.service_account_dir is not None:
            mounts.append((str(self.service_account_dir), SERVICE_ACCOUNT_MOUNT, True))
        if self.hosts_text is None:
            self.update_hosts([])
        mounts.append((str(self.hosts_path), "/etc/hosts", True))
        unmasked = (container.get("securityContext") or {}).get("procMount") == "Unmasked"
        bwrap = bwrap_prefix(
            mounts, proc_unmasked=unmasked, host_pid=bool(self.pod["spec"].get("hostPID"))
        )
        work_dir = container.get("workingDir") or str(self.pod_dir / "cwd")
        (self.pod_dir / "cwd").mkdir(parents=True, exist_ok=True)
        bwrap += ["--chdir", work_dir, "--"]
        user = run_as_user(self.pod["spec"], container)
        if user is not None:
            uid, gid = user
            bwrap += ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        return [*bwrap, *argv], env

    def bin_dir(self, container: Manifest) -> Path:
        """The environment standing in for the container's image (its ``posttrain``/python)."""
        image = str(container.get("image") or "")
        return python_bin_dir_for(image, self.image_bin_dirs, self.python_bin_dir)

    def _container_env(self, container: Manifest) -> dict[str, str]:
        """The process environment: host basics, then envFrom, then env (later wins)."""
        env = {
            "PATH": f"{self.bin_dir(container)}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
            "/sbin:/bin",
            "HOSTNAME": self.name,
            "HOME": "/root" if os.geteuid() == 0 else os.environ.get("HOME", "/"),
            "LANG": "C.UTF-8",
        }
        if self.service_account_dir is not None:
            # What load_incluster_config() reads, next to the token mounted by _mounts().
            host, port, _ = self.cluster.apiserver_address()
            env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=str(port))
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._object_data("ConfigMap", ref["name"], ref.get("optional", False))
            elif "secretRef" in source:
                ref = source["secretRef"]
                data = self._object_data("Secret", ref["name"], ref.get("optional", False))
            else:
                raise PodSpecError(f"envFrom entry {source} is neither configMapRef nor secretRef")
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            if "valueFrom" in var:
                value = self._env_value_from(var["name"], var["valueFrom"])
                if value is None:
                    continue
                env[var["name"]] = value
            else:
                env[var["name"]] = expand_references(str(var.get("value", "")), env)
        return env

    def _env_value_from(self, name: str, value_from: Manifest) -> str | None:
        for kind, key_field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
            if key_field in value_from:
                ref = value_from[key_field]
                data = self._object_data(kind, ref["name"], ref.get("optional", False))
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise PodSpecError(
                        f"env {name}: key {ref['key']!r} not in {kind} "
                        f"{self.namespace}/{ref['name']} (keys: {sorted(data)})"
                    )
                return data[ref["key"]]
        if "fieldRef" in value_from:
            return field_ref_value(self.pod, value_from["fieldRef"]["fieldPath"])
        raise PodSpecError(
            f"env {name}: valueFrom {sorted(value_from)} is not supported locally "
            "(use value, secretKeyRef, configMapKeyRef or fieldRef)"
        )

    def _object_data(self, kind: str, name: str, optional: bool) -> dict[str, str]:
        obj = self.cluster.get(kind, self.namespace, name)
        if obj is None:
            if optional:
                return {}
            raise PodSpecError(
                f"{kind} {self.namespace}/{name} does not exist; create it before "
                "the pod (the kubelet would keep the pod in CreateContainerConfig)"
            )
        if kind == "Secret":
            return decode_secret_data(obj)
        data = dict(obj.get("data") or {})
        for key, value in (obj.get("binaryData") or {}).items():
            data[key] = base64.b64decode(value).decode(errors="replace")
        return data

    def _write_service_account_token(self) -> None:
        """Token, CA and namespace for the pod's ServiceAccount, as the kubelet mounts them.

        Skipped when the pod opts out (automountServiceAccountToken: false) or the account
        does not exist (no controller-manager creates ``default`` here): the pod then runs
        without API credentials, and in-cluster clients fail with their own clear error.
        """
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return
        account = spec.get("serviceAccountName") or "default"
        token = self.cluster.service_account_token(self.namespace, account)
        if token is None:
            log.info(
                "pod %s/%s: ServiceAccount %s not found; no API token mounted",
                self.namespace,
                self.name,
                account,
            )
            return
        target = self.pod_dir / "serviceaccount"
        target.mkdir(parents=True, exist_ok=True)
        _, _, ca_file = self.cluster.apiserver_address()
        files = {"token": token, "namespace": self.namespace}
        if ca_file:
            files["ca.crt"] = Path(ca_file).read_text()
        for name, content in files.items():
            tmp = target / f".{name}.tmp"
            tmp.write_text(content)
            tmp.chmod(0o644)  # the pod's (possibly dropped-to) user must read it
            tmp.replace(target / name)  # atomic: a client re-reading the token never sees half
        self.service_account_dir = target
        self.token_refresh_at = time.monotonic() + TOKEN_SECONDS / 2

    def refresh_metadata(self, pod: Manifest) -> None:
        """Follow label/annotation changes into downward-API volumes, as the kubelet does.

        A warm sandbox pod is claimed by an annotation and waits for it to appear in its
        downward-API file, so a projection written once at start would never hand it a task.
        """
        meta = pod["metadata"]
        current = self.pod["metadata"]
        self.pod["spec"]["activeDeadlineSeconds"] = pod["spec"].get("activeDeadlineSeconds")
        if (meta.get("labels"), meta.get("annotations")) == (
            current.get("labels"),
            current.get("annotations"),
        ):
            return
        current["labels"], current["annotations"] = meta.get("labels"), meta.get("annotations")
        for volume in self.pod["spec"].get("volumes") or []:
            if "downwardAPI" not in volume:
                continue
            data = {
                item["path"]: field_ref_value(self.pod, item["fieldRef"]["fieldPath"])
                for item in volume["downwardAPI"].get("items") or []
            }
            write_projection(self.pod_dir / "volumes" / volume["name"], data, None)

    def _materialise_volumes(self) -> dict[str, Path]:
        """Write every volume's content under ``<pod_dir>/volumes/<name>``."""
        spec = self.pod["spec"]
        paths: dict[str, Path] = {}
        user = run_as_user(spec, spec["containers"][0])
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        for volume in spec.get("volumes") or []:
            target = self.pod_dir / "volumes" / volume["name"]
            target.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in volume:
                pass
            elif "configMap" in volume:
                source = volume["configMap"]
                data = self._object_data("ConfigMap", source["name"], source.get("optional", False))
                write_projection(target, data, source.get("items"))
            elif "secret" in volume:
                source = volume["secret"]
                data = self._object_data(
                    "Secret", source["secretName"], source.get("optional", False)
                )
                write_projection(target, data, source.get("items"))
            elif "downwardAPI" in volume:
                data = {
                    item["path"]: field_ref_value(self.pod, item["fieldRef"]["fieldPath"])
                    for item in volume["downwardAPI"].get("items") or []
                }
                write_projection(target, data, None)
            elif "hostPath" in volume:
                target.rmdir()
                paths[volume["name"]] = Path(volume["hostPath"]["path"])
                continue
            else:
                kinds = sorted(k for k in volume if k != "name")
                raise PodSpecError(
                    f"volume {volume['name']!r} of type {kinds} is not supported "
                    "locally (configMap, secret, downwardAPI, emptyDir, hostPath)"
                )
            if user is not None and os.geteuid() == 0:
                # The kubelet gives volumes to fsGroup; here the dropped-to user must write them.
                chown_tree(target, user[0], int(fs_group) if fs_group is not None else user[1])
            paths[volume["name"]] = target
        return paths


# ---------------------------------------------------------------- Deployments


@dataclass
class DeploymentStandIn:
    """Keeps ``spec.replicas`` pods per Deployment and writes the Deployment's status.

    Limits, on purpose (a dev aid, not a controller-manager): no ReplicaSets; pods are named
    ``<deployment>-<n>`` and owned by the Deployment itself; a changed pod template recreates
    every pod at once (no rolling strategy, no maxSurge); a pod that ends is deleted and
    recreated after ``replace_delay_s`` (that is the only "restart", with no backoff);
    the selector is not used (ownership is by ownerReference); pods of a deleted
    Deployment are deleted here because there is no garbage collector either.
    """

    cluster: Cluster
    replace_delay_s: float = 2.0
    last_replaced: dict[str, float] = field(default_factory=dict)

    def sync(self, deployments: list[Manifest], pods: list[Manifest]) -> None:
        by_owner: dict[str, list[Manifest]] = {}
        for pod in pods:
            uid = controller_uid(pod)
            if uid is not None:
                by_owner.setdefault(uid, []).append(pod)
        live_uids = {d["metadata"]["uid"] for d in deployments}
        for pod in pods:
            refs = pod["metadata"].get("ownerReferences") or []
            if any(r.get("kind") == "Deployment" and r.get("uid") not in live_uids for r in refs):
                self.cluster.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"], 0)
        for deployment in deployments:
            if not deployment["metadata"].get("deletionTimestamp"):
                self._sync_one(deployment, by_owner.get(deployment["metadata"]["uid"], []))

    def _sync_one(self, deployment: Manifest, owned: list[Manifest]) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        namespace, name = meta["namespace"], meta["name"]
        replicas = int(spec.get("replicas", 1))
        want_hash = template_hash(spec["template"])
        wanted_names = {f"{name}-{i}" for i in range(replicas)}
        existing = {p["metadata"]["name"]: p for p in owned}
        for pod_name, pod in existing.items():
            stale = (pod["metadata"].get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION)
            ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            unwanted = pod_name not in wanted_names or stale != want_hash or ended
            if unwanted and pod["metadata"].get("deletionTimestamp") is None:
                log.info("deployment %s/%s: deleting pod %s", namespace, name, pod_name)
                self.cluster.delete_pod(namespace, pod_name, 0)
                self.last_replaced[f"{namespace}/{pod_name}"] = time.monotonic()
        for pod_name in sorted(wanted_names - set(existing)):
            if (
                time.monotonic() - self.last_replaced.get(f"{namespace}/{pod_name}", -1e9)
                < self.replace_delay_s
            ):
                continue
            self.cluster.create_pod(
                namespace, self._pod_from_template(deployment, pod_name, want_hash)
            )
        current = [
            p
            for p in owned
            if p["metadata"]["name"] in wanted_names
            and not p["metadata"].get("deletionTimestamp")
            and (p["metadata"].get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) == want_hash
        ]
        ready = sum(1 for p in current if pod_is_ready(p))
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len([p for p in owned if not p["metadata"].get("deletionTimestamp")]),
            "updatedReplicas": len(current),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(replicas - ready, 0),
        }
        old = deployment.get("status") or {}
        if any(old.get(k, 0) != v for k, v in status.items()):
            self.cluster.patch_deployment_status(namespace, name, status)

    @staticmethod
    def _pod_from_template(deployment: Manifest, pod_name: str, want_hash: str) -> Manifest:
        template = deployment["spec"]["template"]
        meta = template.get("metadata") or {}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "labels": dict(meta.get("labels") or {}),
                "annotations": {
                    **(meta.get("annotations") or {}),
                    TEMPLATE_HASH_ANNOTATION: want_hash,
                },
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": deployment["metadata"]["name"],
                        "uid": deployment["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }


# ---------------------------------------------------------------- the agent


def node_manifest(node_name: str, kubelet_port: int | None = None) -> Manifest:
    """The Node this agent registers: one Ready node with this host's CPUs and memory.

    Its only address is the InternalIP 127.0.0.1: the apiserver prefers a Hostname address
    when there is one and would try to resolve ``posttrain-local`` in DNS to reach the
    kubelet (``pods/log`` then fails with "no such host"). ``kubelet_port`` is where the
    agent serves ``/containerLogs`` for ``kubectl logs``.
    """
    memory_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    except OSError:
        pass
    capacity = {
        "cpu": str(os.cpu_count() or 1),
        "memory": f"{memory_kib}Ki",
        "pods": "110",
        "nvidia.com/gpu": "0",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name,
            "labels": {
                "kubernetes.io/hostname": node_name,
                "kubernetes.io/os": "linux",
                "posttrain.io/dev-node": "true",
            },
        },
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            **(
                {"daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}}}
                if kubelet_port
                else {}
            ),
            "conditions": [node_ready_condition()],
            "nodeInfo": {
                "kubeletVersion": "posttrain-nodeagent",
                "operatingSystem": "linux",
                "architecture": os.uname().machine,
                "containerRuntimeVersion": "local-process://bwrap",
                "kernelVersion": os.uname().release,
                "osImage": "host",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        },
    }


def node_ready_condition(ready: bool = True) -> Manifest:
    now = now_rfc3339()
    return {
        "type": "Ready",
        "status": "True" if ready else "False",
        "reason": "KubeletReady" if ready else "KubeletStopped",
        "message": "posttrain local node agent is " + ("running" if ready else "stopped"),
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the apiserver cannot be reached at all (vs. it answered an error).

    >>> import urllib3
    >>> is_unreachable(urllib3.exceptions.MaxRetryError(None, "/", ConnectionRefusedError()))
    True
    >>> is_unreachable(ValueError("bad"))
    False
    """
    import urllib3

    return isinstance(
        exc, urllib3.exceptions.MaxRetryError | urllib3.exceptions.ProtocolError | OSError
    )


@dataclass
class SyncErrors:
    """Logs a failing sync loop readably: a traceback once per kind of error, a line per
    minute while it repeats, and a reason to stop once the apiserver has been unreachable
    for ``give_up_s`` (None: never stop)."""

    apiserver: str
    give_up_s: float | None
    unreachable_since: float | None = None
    last_error: str | None = None
    last_logged: float = 0.0

    def ok(self) -> None:
        if self.last_error is not None:
            log.info("node agent sync works again")
        self.unreachable_since, self.last_error = None, None

    def failed(self, exc: BaseException) -> str | None:
        """Log ``exc``; returns why to stop, or None to retry."""
        now = time.monotonic()
        text = f"{type(exc).__name__}: {exc}"
        if is_unreachable(exc):
            if self.unreachable_since is None:
                self.unreachable_since = now
                log.warning(
                    "cannot reach the apiserver at %s (%s); retrying",
                    self.apiserver,
                    getattr(exc, "reason", exc),
                )
            gone_for = now - self.unreachable_since
            if self.give_up_s is not None and gone_for >= self.give_up_s:
                return (
                    f"the apiserver at {self.apiserver} has been unreachable for "
                    f"{gone_for:.0f} s (the dev environment was stopped?); stopping the node "
                    "agent and its pods"
                )
            return None
        self.unreachable_since = None
        if text != self.last_error:
            log.exception("node agent sync failed; retrying")
        elif now - self.last_logged >= 60:
            log.warning("node agent sync still failing: %s", text[:300])
        else:
            return None
        self.last_error, self.last_logged = text, now
        return None


# Repository name of the operator's vLLM rollout image (OperatorConfig.vllm_image,
# ghcr.io/posttrain/rollout): vLLM pins its own torch, so that image has its own environment.
ROLLOUT_IMAGE_NAME = "rollout"


def default_image_bin_dirs() -> dict[str, Path]:
    """Images the agent runs with another environment than its own, by repository name.

    ``rollout`` (a RolloutPool's vLLM pods and their fetch-model init step) runs the rollout
    environment (``make venv-vllm``'s ``.venv-vllm``, or ``$POSTTRAIN_VLLM_PYTHON``'s
    directory), as the cluster runs those pods from the rollout image. Without one the map is
    empty and such pods run the agent's venv, where ``vllm-entry`` fails saying vLLM is
    missing. cpu-engine pools use the posttrain image and keep the agent's venv.
    """
    from posttrain.rollout.vllm_local import vllm_python

    python = vllm_python()
    return {ROLLOUT_IMAGE_NAME: python.parent} if python is not None else {}


class NodeAgent:
    """Node + scheduler + kubelet + Deployment stand-in for the local dev control plane.

    It polls (list every ``poll_interval_s``) rather than watching: a dev cluster holds a
    handful of pods, and a poll loop needs no resync or reconnect logic to stay correct.
    ``namespaces`` limits it to some namespaces (tests share one apiserver); None = all.
    """

    def __init__(
        self,
        api_client: Any,
        node_name: str = DEFAULT_NODE_NAME,
        workdir: Path | str | None = None,
        python_bin_dir: Path | str | None = None,
        image_bin_dirs: Mapping[str, Path | str] | None = None,
        namespaces: Iterable[str] | None = None,
        poll_interval_s: float = 0.25,
        register_processes: bool = False,
        serve_logs: bool = True,
        unreachable_exit_s: float | None = None,
    ) -> None:
        if shutil.which("bwrap") is None:
            raise RuntimeError(
                "bubblewrap (bwrap) is not installed; `apt-get install "
                "bubblewrap`: the agent binds volumes at mount paths with it"
            )
        self.cluster = Cluster(api_client)
        self.node_name = node_name
        self.workdir = Path(workdir or Path.home() / ".cache/posttrain/dev/nodeagent")
        self.python_bin_dir = Path(python_bin_dir or Path(sys.executable).parent)
        found = default_image_bin_dirs() if image_bin_dirs is None else image_bin_dirs
        self.image_bin_dirs = {name: Path(path) for name, path in found.items()}
        for name, path in sorted(self.image_bin_dirs.items()):
            log.info("images named %r run the environment in %s", name, path)
        self.namespaces = tuple(namespaces) if namespaces is not None else None
        self.poll_interval_s = poll_interval_s
        self.deployments = DeploymentStandIn(self.cluster)
        self.runners: dict[str, PodRunner] = {}
        self._finished: set[str] = set()
        self._terminating: set[str] = set()
        self._ip_index = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_heartbeat = 0.0
        self._stop_requested = threading.Event()
        self.register_processes = register_processes
        self.serve_logs = serve_logs
        # With a value, the agent stops (with its pods) once the apiserver has been
        # unreachable that long: `posttrain dev down` removed the control plane.
        self.unreachable_exit_s = unreachable_exit_s
        self.gave_up: str | None = None  # why the agent stopped itself, if it did
        self.log_server: KubeletLogServer | None = None

    def start(self) -> NodeAgent:
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = None
        if self.serve_logs:
            self.log_server = KubeletLogServer(
                self.workdir / "kubelet-pki", self.log_path, self.pod_running
            ).start()
            port = self.log_server.port
        self.cluster.ensure_node(node_manifest(self.node_name, port))
        self._last_heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="nodeagent", daemon=True)
        self._thread.start()
        log.info("node agent %s running pods (workdir %s)", self.node_name, self.workdir)
        return self

    def stop(self) -> None:
        """Stop the loop and kill every pod process this agent started."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        for runner in list(self.runners.values()):
            runner.stop()
        if self.log_server is not None:
            self.log_server.stop()
            self.log_server = None
        try:
            self.cluster.patch_node_status(
                self.node_name, {"conditions": [node_ready_condition(ready=False)]}
            )
        except Exception:
            # The control plane may already be gone when a dev session ends; nothing to mark.
            log.debug("could not mark node %s NotReady", self.node_name, exc_info=True)

    @classmethod
    def from_kubeconfig(cls, kubeconfig: Path | str, **kwargs: Any) -> NodeAgent:
        """An agent logged in with ``kubeconfig`` (what ``posttrain dev up`` writes)."""
        from kubernetes import config

        return cls(config.new_client_from_config(config_file=str(kubeconfig)), **kwargs)

    def run_forever(self) -> None:
        """Run until :meth:`request_stop` (e.g. from a signal handler), then stop every pod."""
        self.start()
        try:
            while not self._stop_requested.wait(1.0):
                pass
        finally:
            self.stop()

    def request_stop(self) -> None:
        """Ask :meth:`run_forever` to return; safe to call from a signal handler."""
        self._stop_requested.set()

    def runner(self, namespace: str, name: str) -> PodRunner | None:
        """The live runner of pod ``namespace/name`` (its process, pod dir, readiness)."""
        with self._lock:
            for runner in self.runners.values():
                if (runner.namespace, runner.name) == (namespace, name):
                    return runner
        return None

    def log_path(self, namespace: str, name: str) -> Path:
        return self.workdir / f"{namespace}_{name}.log"

    def pod_running(self, namespace: str, name: str) -> bool:
        """Whether pod ``namespace/name`` has a live process here (its log may still grow)."""
        runner = self.runner(namespace, name)
        return runner is not None and runner.process is not None and runner.process.poll() is None

    def _loop(self) -> None:
        errors = SyncErrors(self.cluster.api_client.configuration.host, self.unreachable_exit_s)
        while not self._stop.is_set():
            try:
                self.sync_once()
                errors.ok()
            except Exception as exc:
                # The apiserver may restart under a dev cluster: retry, one line per kind of
                # failure (not a traceback every 0.25 s), until it has been gone too long.
                self.gave_up = errors.failed(exc)
                if self.gave_up:
                    log.error("%s", self.gave_up)
                    self._stop_requested.set()
                    return
            self._stop.wait(self.poll_interval_s)

    def sync_once(self) -> None:
        if time.monotonic() - self._last_heartbeat > HEARTBEAT_SECONDS:
            self.cluster.patch_node_status(self.node_name, {"conditions": [node_ready_condition()]})
            self._last_heartbeat = time.monotonic()
        pods = self.cluster.list_pods(self.namespaces)
        self._sync_pods(pods)
        self.deployments.sync(self.cluster.list_deployments(self.namespaces), pods)
        self._sync_service_names(self.cluster.list_services(self.namespaces), pods)

    def _sync_service_names(self, services: list[Manifest], pods: list[Manifest]) -> None:
        """Point every running pod's /etc/hosts at the ready pods of its namespace's Services."""
        with self._lock:
            runners = list(self.runners.values())
        by_namespace: dict[str, list[str]] = {}
        for runner in runners:
            if runner.namespace not in by_namespace:
                in_namespace = [
                    s for s in services if s["metadata"]["namespace"] == runner.namespace
                ]
                by_namespace[runner.namespace] = service_host_entries(in_namespace, pods)
            runner.update_hosts(by_namespace[runner.namespace])

    def _sync_pods(self, pods: list[Manifest]) -> None:
        seen: set[str] = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            uid = meta["uid"]
            node = spec.get("nodeName")
            if node not in (None, "", self.node_name):
                continue
            seen.add(uid)
            if meta.get("deletionTimestamp"):
                self._delete(pod)
                continue
            phase = (pod.get("status") or {}).get("phase")
            if uid in self.runners:
                self.runners[uid].refresh_metadata(pod)
                continue
            if uid in self._finished or phase in ("Succeeded", "Failed"):
                continue
            if not node:
                self.cluster.bind(meta["namespace"], meta["name"], self.node_name)
                pod["spec"]["nodeName"] = self.node_name
            elif phase == "Running":
                # Running here before an agent restart: its process is gone with the old agent.
                self.cluster.patch_pod_status(
                    meta["namespace"],
                    meta["name"],
                    {
                        "phase": "Failed",
                        "reason": "NodeAgentRestarted",
                        "message": "the local node agent restarted and lost this pod's process",
                    },
                )
                continue
            self._start_pod(pod)
        with self._lock:
            vanished = [r for uid, r in self.runners.items() if uid not in seen]
        for runner in vanished:
            log.info("pod %s/%s deleted: killing its processes", runner.namespace, runner.name)
            self._terminate(runner.pod, finalize=False)
        self._finished &= seen  # only uids still listed can come back; the rest are gone

    def _start_pod(self, pod: Manifest) -> None:
        with self._lock:
            pod_ip = loopback_address(self._ip_index)
            self._ip_index += 1
        pod.setdefault("status", {}).update(podIP=pod_ip, hostIP="127.0.0.1")
        runner = PodRunner(
            self.cluster,
            pod,
            pod_ip,
            self.workdir,
            self.python_bin_dir,
            on_exit=self._on_exit,
            image_bin_dirs=self.image_bin_dirs,
            register_processes=self.register_processes,
        )
        with self._lock:
            self.runners[pod["metadata"]["uid"]] = runner
        log.info("starting pod %s/%s (podIP %s)", runner.namespace, runner.name, pod_ip)
        runner.start()

    def _on_exit(self, runner: PodRunner) -> None:
        if not runner.stopped.is_set():
            self._forget(runner)
            self._finished.add(runner.pod["metadata"]["uid"])

    def _forget(self, runner: PodRunner) -> None:
        with self._lock:
            self.runners.pop(runner.pod["metadata"]["uid"], None)

    def _delete(self, pod: Manifest) -> None:
        """Graceful deletion: kill the processes, then finalize the pod (grace 0)."""
        self._terminate(pod, finalize=True)

    def _terminate(self, pod: Manifest, finalize: bool) -> None:
        """Kill a pod's processes in the background: a slow SIGTERM must not stall the loop."""
        uid = pod["metadata"]["uid"]
        with self._lock:
            if uid in self._terminating:
                return
            self._terminating.add(uid)
            runner = self.runners.get(uid)

        def terminate() -> None:
            try:
                if runner is not None:
                    runner.stop()
                    self._forget(runner)
                if finalize:
                    meta = pod["metadata"]
                    self.cluster.delete_pod(meta["namespace"], meta["name"], 0)
            except Exception:
                log.exception("could not terminate pod %s", uid)
            finally:
                with self._lock:
                    self._terminating.discard(uid)

        threading.Thread(target=terminate, name=f"terminate-{uid[:8]}", daemon=True).start()
