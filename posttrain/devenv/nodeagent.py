"""A local node agent for the dev control plane: a DEVELOPMENT AID, not a product component.

``posttrain dev up --node none`` (the fallback where the real node cannot run: docs/e2e.md)
runs etcd + kube-apiserver only: no scheduler, no kubelet, no controller-manager, so the pods
the operator creates would sit in Pending forever. This agent plays those three roles just far
enough for end-to-end runs on one machine:

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
  the Deployment's status (see :class:`~.deployments.DeploymentStandIn` for its limits).
* **garbage collector stand-in**: deletes what a deleted owner owned (a RolloutPool's
  Deployment and Service, a TrainingRun's pods; :mod:`.garbage`).

Images are not pulled: ``posttrain``/``python``/``python3`` resolve to a local environment of
the checked-out project chosen by the image's repository name (``rollout`` images -- the
operator's vLLM image -- run ``.venv-vllm``, everything else the agent's own venv; see
:func:`default_image_bin_dirs`), other commands (``cp``, ``sh``) to the host's binaries. Each pod gets its own loopback
address (127.0.0.2, 127.0.0.3, ...) as podIP, so two replicas that bind their pod IP don't
collide; processes that bind 0.0.0.0 share the host's ports (one replica per port).
When the agent runs as root it honours ``runAsUser``/``runAsGroup`` by dropping privileges
with ``setpriv``; as another user it runs everything as that user.

This module is the agent's loop (node heartbeat, scheduling, starting and stopping pods);
each role it plays has its own module: :mod:`.node` (the Node object), :mod:`.kubelet` (one
pod: :class:`~.kubelet.PodRunner`), :mod:`.deployments` (the Deployment stand-in),
:mod:`.garbage` (the garbage collector), :mod:`.nodeapi` (its API calls), :mod:`.podprocess` (pure pod-spec helpers) and
:mod:`.kubeletlogs` (``kubectl logs``).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deployments import DeploymentStandIn
from .garbage import GarbageCollectorStandIn
from .kubelet import PodRunner
from .kubeletlogs import KubeletLogServer
from .node import node_manifest, node_ready_condition
from .nodeapi import NodeAPI
from .podprocess import Manifest, service_host_entries

log = logging.getLogger(__name__)

DEFAULT_NODE_NAME = "posttrain-local"
HEARTBEAT_SECONDS = 10.0


def loopback_address(index: int) -> str:
    """The ``index``-th per-pod loopback address (127.0.0.1 stays the host's own).

    >>> loopback_address(0), loopback_address(253), loopback_address(254)
    ('127.0.0.2', '127.0.0.255', '127.0.1.2')
    """
    block, offset = divmod(index, 254)
    return f"127.{block // 256}.{block % 256}.{offset + 2}"


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
        self.cluster = NodeAPI(api_client)
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
        self.garbage = GarbageCollectorStandIn(api_client, self.namespaces)
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
        self.garbage.sync()  # before the Deployment stand-in, so it sees what is gone
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
