"""The node agent's kubelet part: runs one pod on this host and writes its status.

Volumes materialised in a per-pod directory and bound at their mountPaths with bubblewrap,
init containers then the first container as a local process group, env resolved from the
spec, httpGet readiness probes, a ServiceAccount token, and the pod's status as the kubelet
writes it. Part of the dev node agent (:mod:`.nodeagent`), a development aid.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge

from posttrain.telemetry import get_tracer

from . import registry
from .nodeapi import TOKEN_SECONDS, NodeAPI
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
    interpreter_prefix,
    kill_process_group,
    mounted_over,
    now_rfc3339,
    pod_conditions,
    python_bin_dir_for,
    read_termination_message,
    refuse_sidecars,
    resolve_executable,
    run_as_user,
    running_status,
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

# Dev runs want quick teardown; a 30 s default grace would make every test wait.
MAX_GRACE_SECONDS = 5.0
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@functools.cache
def host_hosts_text() -> str:
    """The host's /etc/hosts, the base of every pod's (pods share the host network)."""
    try:
        return Path("/etc/hosts").read_text()
    except OSError:
        return "127.0.0.1 localhost\n"


class PodDeleted(Exception):
    """The pod was deleted before its next container could start."""


@dataclass
class PodRunner:
    """Runs one pod on this host: volumes, init containers, main container, status.

    One thread per pod; the agent's loop calls :meth:`stop` when the pod is deleted.
    """

    cluster: NodeAPI
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
        refuse_sidecars(spec)
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
        # The agent's directory and the dev state are hidden; the pod keeps its own directory.
        mounts.insert(0, (str(self.pod_dir), str(self.pod_dir.resolve()), False))
        user = run_as_user(self.pod["spec"], container)
        bwrap = bwrap_prefix(
            mounts,
            proc_unmasked=unmasked,
            host_pid=bool(self.pod["spec"].get("hostPID")),
            hide=[str(self.workdir), str(registry.state_dir())],
            reach=interpreter_prefix(self.bin_dir(container)) if user is not None else (),
        )
        # The pod's own directory is its cwd, unless one of its volumes is mounted above it
        # (an emptyDir at /tmp, as rollout replicas have, over an agent whose directory is
        # under /tmp, as in the tests): then "/", a container's cwd without a WORKDIR.
        own_cwd = str((self.pod_dir / "cwd").resolve())
        hidden_by = [target for _, target, _ in mounts[1:]]
        default_cwd = "/" if mounted_over(own_cwd, map(os.path.realpath, hidden_by)) else own_cwd
        work_dir = container.get("workingDir") or default_cwd
        (self.pod_dir / "cwd").mkdir(parents=True, exist_ok=True)
        bwrap += ["--chdir", work_dir, "--"]
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
