"""A real single-node Kubernetes cluster from upstream parts, on this machine.

etcd and kube-apiserver (:class:`~posttrain.devenv.controlplane.ControlPlane`), the
controller manager and scheduler, a kubelet with containerd and runc, CNI bridge networking,
kube-proxy and CoreDNS, and MinIO on the node's address; the images of ``make images``
imported into the node's containerd. What kind or k3d give in containers, here as processes of
one root-owned host (no Docker daemon, no nested systemd), each upstream and unmodified.

:meth:`RealCluster.start` reports each component's readiness and how long it took;
:meth:`RealCluster.stop` stops everything and leaves no container, mount, cgroup, iptables
rule or process behind (the order matters: pods, kubelet, containerd, the control plane, then
the host's leftovers).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.api.env import CACHE
from posttrain.processes import ManagedProcess, free_port
from posttrain.telemetry import get_tracer

from ..binaries import REPO_ROOT, go_binary, pinned_versions
from ..certs import issue
from ..controlplane import ControlPlane
from ..minio import MinioServer
from . import components, volumes
from .containerd import PAUSE_IMAGE, Containerd
from .network import CNI_BIN_DIR, NodeNetwork

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

IMAGE_NAMES = ("operator", "sandbox", "trainer", "rollout")
# Paths the kubelet and the CNI plugins write outside their configured directories.
FIXED_LEFTOVERS = (
    Path("/var/lib/kubelet/device-plugins/kubelet.sock"),
    Path("/var/log/containers"),
    Path("/var/log/pods"),
    Path("/var/lib/cni/results"),
)
CGROUP_ROOT = Path("/sys/fs/cgroup")


def default_cache_dir() -> Path:
    base = os.environ.get(CACHE)
    return Path(base) if base else Path.home() / ".cache" / "posttrain"


def podman_env() -> dict[str, str]:
    """podman with the project's settings (runc, explicit rlimits: tools/images/containers.conf)."""
    return {
        **os.environ,
        "CONTAINERS_CONF": str(REPO_ROOT / "tools" / "images" / "containers.conf"),
    }


def chart_tag() -> str:
    """The chart's appVersion: the tag `make images` gives every image."""
    for line in (REPO_ROOT / "charts" / "posttrain" / "Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return line.split(":", 1)[1].strip().strip('"')
    raise RuntimeError("charts/posttrain/Chart.yaml has no appVersion")


def image_ref(name: str) -> str:
    """``ghcr.io/posttrain/<name>:<appVersion>``, the chart's default for that image."""
    return f"ghcr.io/posttrain/{name}:{chart_tag()}"


def minio_image() -> str:
    """The MinIO server image ``tools/images/build.sh`` makes from the pinned MinIO build: what
    the chart's bundled MinIO runs on the dev cluster (``charts/posttrain/values-dev.yaml``),
    where ``quay.io/minio/minio`` cannot be pulled."""
    return f"localhost/posttrain/minio:{pinned_versions()['MINIO_VERSION']}"


def image_refs(names: Sequence[str] = IMAGE_NAMES) -> list[str]:
    return [image_ref(name) for name in names]


@dataclass
class RealCluster:
    """One real node and its control plane; ``workdir`` holds configs, state and logs."""

    workdir: Path
    images: list[str] = field(default_factory=list)
    cache_dir: Path = field(default_factory=default_cache_dir)
    timings: dict[str, float] = field(default_factory=dict)
    control_plane: ControlPlane | None = None
    containerd: Containerd | None = None
    minio: MinioServer | None = None
    processes: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.network = NodeNetwork(
            cni_conf_dir=self.workdir / "cni" / "net.d", cni_state_dir=self.workdir / "cni"
        )

    @property
    def node_ip(self) -> str:
        return self.network.node_ip

    @property
    def kubeconfig(self) -> Path:
        assert self.control_plane is not None
        return self.control_plane.kubeconfig

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        with tracer.start_as_current_span(f"realnode.{name}"):
            yield
        self.timings[name] = round(time.monotonic() - started, 2)
        log.info("real node: %s ready in %.1f s", name, self.timings[name])

    def start(self, minio_data: Path | None = None, reap: Callable[[Path], bool] | None = None,
              minio_keys: tuple[str, str] | None = None) -> RealCluster:  # fmt: skip
        """Start every component in dependency order; on failure stop what started.

        The node's bridge and address are fixed, so one node runs at a time: a node still
        running (or left behind by a killed process) is an error, unless ``reap`` says it may be
        stopped (the test fixture reaps its own earlier nodes). ``minio_keys`` (access key,
        secret key): the keys MinIO's existing data was served with (``dev up`` restarting a
        stopped node in place)."""
        if os.geteuid() != 0:
            raise PermissionError("the real node runs containers through containerd: run as root")
        for other in running_nodes():
            if other == self.workdir or (reap is not None and reap(other)):
                log.warning("real node: stopping the node left running from %s", other)
                reap_node(other)
            else:
                raise RuntimeError(
                    f"another real node is running from {other}: stop it first "
                    "(`posttrain dev down`, or kill its processes)"
                )
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / NODE_MARKER).touch()
        try:
            self._start(minio_data, minio_keys)
        except BaseException:
            log.error("real node failed to start; logs are kept in %s", self.workdir)
            self.stop(keep_workdir=True)
            raise
        return self

    def _load_images(self) -> None:
        """Import the pause, MinIO and posttrain images into the node's containerd, then
        prune the names a rebuild left behind; every current posttrain image stays, also
        those not imported this time."""
        assert self.containerd is not None
        for ref in [PAUSE_IMAGE, minio_image(), *self.images]:
            seconds = self.containerd.import_from_podman(ref, podman_env())
            if seconds:
                log.info("real node: imported %s in %.1f s", ref, seconds)
        self.prune_images()

    def prune_images(self) -> list[str]:
        """Remove superseded posttrain names from the node's store (``Containerd.prune``),
        keeping the pause, MinIO and every current posttrain image; the removed names."""
        assert self.containerd is not None
        return self.containerd.prune(
            keep=[PAUSE_IMAGE, minio_image(), *image_refs()],
            prefixes=("ghcr.io/posttrain/", "localhost/posttrain/"),
        )

    def _start(self, minio_data: Path | None, minio_keys: tuple[str, str] | None) -> None:
        with self._timed("network"):
            self.network.set_up()
        with self._timed("control-plane"):
            self.control_plane = ControlPlane(
                workdir=self.workdir / "control-plane",
                address=self.node_ip,
                service_cidr=self.network.service_cidr,
                for_node=True,
            ).start()
        cp = self.control_plane
        assert cp.pki is not None
        pki = cp.pki
        admin = cp.kubeconfig
        with self._timed("containerd"):
            self.containerd = Containerd(
                workdir=self.workdir / "containerd",
                content_root=self.cache_dir / "containerd",
                cni_conf_dir=self.network.cni_conf_dir,
                cni_bin_dir=CNI_BIN_DIR,
            )
            self.containerd.start()
        with self._timed("images"):
            self._load_images()
        node_dir = self.workdir / "kubelet"
        node_dir.mkdir(parents=True, exist_ok=True)
        client_cert, client_key = issue(
            pki, "kubelet-client", f"system:node:{components.NODE_NAME}",
            organizations=("system:nodes",),
        )  # fmt: skip
        serving_cert, serving_key = issue(
            pki, "kubelet-serving", components.NODE_NAME,
            server_ips=(self.node_ip,), server_names=(components.NODE_NAME,),
        )  # fmt: skip
        kubelet_kubeconfig = components.write_kubeconfig(
            node_dir / "kubeconfig", cp.server, pki.ca_cert, client_cert, client_key,
            f"system:node:{components.NODE_NAME}",
        )  # fmt: skip
        config = components.kubelet_config(
            root=node_dir,
            ca=pki.ca_cert,
            serving_cert=serving_cert,
            serving_key=serving_key,
            runtime_endpoint=self.containerd.endpoint,
            cluster_dns=self.node_ip,
            port=free_port(),
            healthz_port=free_port(),
        )
        starts: list[tuple[str, Callable[[], ManagedProcess]]] = [
            ("controller-manager", lambda: components.controller_manager_process(
                self.workdir, admin, pki.ca_cert, pki.ca_key, pki.sa_private)),
            ("scheduler", lambda: components.scheduler_process(self.workdir, admin)),
            ("kubelet", lambda: components.kubelet_process(
                node_dir, kubelet_kubeconfig, config, self.node_ip)),
            ("kube-proxy", lambda: components.kube_proxy_process(
                self.workdir, admin, self.network.pod_cidr)),
            ("coredns", lambda: components.coredns_process(self.workdir, admin, self.node_ip)),
        ]  # fmt: skip
        for name, make in starts:
            with self._timed(name):
                process = make()
                self.processes.append(process)
                process.start(120.0)
        self.network.fence_first()
        with self._timed("node-ready"):
            self.wait_node_ready()
        with self._timed("volumes"):
            self._provide_volumes()
        with self._timed("minio"):
            self.minio = MinioServer(data_dir=minio_data or (self.workdir / "minio"),
                                     host=self.node_ip)  # fmt: skip
            if minio_keys:
                self.minio.access_key, self.minio.secret_key = minio_keys
            self.minio.start()

    def _provide_volumes(self) -> None:
        """The default StorageClass and the node's local volumes (:mod:`.volumes`)."""
        api = self.api()
        try:
            volumes.provide(api, self.workdir / "volumes")
        finally:
            api.close()

    # -- a cluster that outlives the process that started it (`posttrain dev up`) ----------

    def record(self) -> dict[str, Any]:
        """What :meth:`from_record` needs to stop this cluster from another process."""
        assert self.control_plane is not None and self.containerd is not None
        assert self.minio is not None and self.containerd.process is not None
        assert self.minio.process is not None
        return {
            "workdir": str(self.workdir),
            "cache_dir": str(self.cache_dir),
            "images": self.images,
            "timings": self.timings,
            "apiserver_port": self.control_plane.apiserver_port,
            "control_plane_pids": [p.pid for p in self.control_plane.processes],
            "containerd_pid": self.containerd.process.pid,
            "component_pids": {p.name: p.pid for p in self.processes},
            "minio": {"port": self.minio.port, "data_dir": str(self.minio.data_dir),
                      "access_key": self.minio.access_key, "secret_key": self.minio.secret_key,
                      "pid": self.minio.process.pid},
        }  # fmt: skip

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> RealCluster:
        """The cluster a :meth:`record` describes, able to :meth:`stop` (not to restart)."""

        def shell(name: str, pid: int | None, log_path: Path) -> ManagedProcess:
            return ManagedProcess(name=name, command=[], log_path=log_path, ready=lambda: True,
                                  pid=pid)  # fmt: skip

        workdir = Path(record["workdir"])
        cluster = cls(workdir, images=record["images"], cache_dir=Path(record["cache_dir"]),
                      timings=record["timings"])  # fmt: skip
        cp_dir = workdir / "control-plane"
        cluster.control_plane = ControlPlane(
            workdir=cp_dir, apiserver_port=record["apiserver_port"], address=cluster.node_ip,
            service_cidr=cluster.network.service_cidr, for_node=True,
            processes=[shell(f"control-plane-{i}", pid, cp_dir / "logs")
                       for i, pid in enumerate(record["control_plane_pids"])],
        )  # fmt: skip
        cluster.containerd = Containerd(
            workdir=workdir / "containerd", content_root=cluster.cache_dir / "containerd",
            cni_conf_dir=cluster.network.cni_conf_dir, cni_bin_dir=CNI_BIN_DIR,
            process=shell("containerd", record["containerd_pid"], workdir / "containerd.log"),
        )  # fmt: skip
        cluster.processes = [shell(name, pid, workdir / f"{name}.log")
                             for name, pid in record["component_pids"].items()]  # fmt: skip
        minio = record["minio"]
        cluster.minio = MinioServer(
            data_dir=Path(minio["data_dir"]), port=minio["port"], host=cluster.node_ip,
            access_key=minio["access_key"], secret_key=minio["secret_key"],
            process=shell("minio", minio["pid"], Path(minio["data_dir"]) / "minio.log"),
        )  # fmt: skip
        return cluster

    def pids(self) -> list[int]:
        processes = [
            *(self.control_plane.processes if self.control_plane else []),
            *([self.containerd.process] if self.containerd and self.containerd.process else []),
            *self.processes,
            *([self.minio.process] if self.minio and self.minio.process else []),
        ]
        return [p.pid for p in processes if p.pid]  # fmt: skip

    def api(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def wait_node_ready(self, timeout_s: float = 120.0) -> None:
        from kubernetes import client

        api = self.api()
        try:
            core = client.CoreV1Api(api)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                nodes = core.list_node().items
                for node in nodes:
                    conditions = (node.status.conditions if node.status else None) or []
                    if any(c.type == "Ready" and c.status == "True" for c in conditions):
                        return
                time.sleep(0.5)
            raise TimeoutError(
                f"node {components.NODE_NAME} not Ready after {timeout_s} s; see "
                f"{self.workdir / 'kubelet' / 'kubelet.log'}"
            )
        finally:
            api.close()

    # -- stopping ------------------------------------------------------------------------

    def stop(self, keep_workdir: bool = False) -> None:
        """Stop everything and clean the host; safe to call on a partly started cluster."""
        with tracer.start_as_current_span("realnode.stop"):
            if self.control_plane is not None and self.containerd is not None:
                self._delete_all_pods()
            for process in reversed(self.processes):
                process.stop()
            self.processes.clear()
            if self.containerd is not None:
                self._kill_containers()
                self.containerd.stop()
            if self.minio is not None:
                self.minio.stop()
            if self.control_plane is not None:
                self.control_plane.stop(keep_logs=True)
            self._clean_host()
            if not keep_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)

    def _delete_all_pods(self, timeout_s: float = 60.0) -> None:
        """Pods first, so the kubelet tears down their containers and networks itself."""
        kubectl = _kubectl()
        if kubectl is None or self.control_plane is None:
            return
        subprocess.run(
            [str(kubectl), "--kubeconfig", str(self.kubeconfig), "delete", "pods", "--all",
             "--all-namespaces", "--grace-period=0", "--force", "--wait=false"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert self.containerd is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.containerd.ctr("tasks", "ls", "-q").stdout.split():
                return
            time.sleep(1)
        log.warning("real node: pods still running after %s s; killing them", timeout_s)

    def _kill_containers(self) -> None:
        assert self.containerd is not None
        ctr = self.containerd.ctr
        for task in ctr("tasks", "ls", "-q").stdout.split():
            ctr("tasks", "kill", "--signal", "SIGKILL", task)
            ctr("tasks", "delete", "--force", task)
        for container in ctr("containers", "ls", "-q").stdout.split():
            ctr("containers", "delete", container)
        _delete_runc_containers(self.workdir)

    def _clean_host(self) -> None:
        _unmount_under(self.workdir)
        kube_proxy = _binary("kube-proxy")
        if kube_proxy is not None:
            subprocess.run([str(kube_proxy), "--cleanup"], capture_output=True, check=False)
        _remove_kube_chains()
        self.network.tear_down()
        _remove_cgroups("kubepods")
        for path in FIXED_LEFTOVERS:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


NODE_MARKER = ".posttrain-node"


def running_nodes() -> list[Path]:
    """Work dirs of real nodes whose containerd still runs (found by its config path)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not args or not args[0].endswith(b"containerd") or b"--config" not in args:
            continue
        config = Path(args[args.index(b"--config") + 1].decode())
        workdir = config.parent.parent
        if (workdir / NODE_MARKER).exists() and workdir not in found:
            found.append(workdir)
    return found


def _delete_runc_containers(workdir: Path) -> None:
    """Every container runc still holds for the node in ``workdir`` (what containerd missed)."""
    runc_root = workdir / "containerd" / "runc" / "k8s.io"
    for container in os.listdir(runc_root) if runc_root.is_dir() else []:
        subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", container],
                       capture_output=True, check=False)  # fmt: skip


def reap_node(workdir: Path) -> None:
    """Stop a node nobody holds a record of (its starter was killed): its containers through
    runc, every process whose command line names its work dir, then the host's leftovers."""
    _delete_runc_containers(workdir)
    marker = str(workdir).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, 9)
    cluster = RealCluster(workdir)
    cluster._clean_host()


def _binary(name: str) -> Path | None:
    try:
        return go_binary(name)
    except Exception:
        return None


def _kubectl() -> Path | None:
    from ..binaries import client_binary

    try:
        return client_binary("kubectl")
    except Exception:
        return None


def _remove_kube_chains() -> None:
    """KUBE-* chains `kube-proxy --cleanup` leaves (KUBE-FIREWALL in filter), with their jumps."""
    for table in ("filter", "nat", "mangle"):
        rules = subprocess.run(["iptables-save", "-t", table], capture_output=True, text=True,
                               check=False).stdout.splitlines()  # fmt: skip
        for rule in rules:
            parts = rule.split()
            if (
                rule.startswith("-A ")
                and "-j" in parts
                and parts[parts.index("-j") + 1].startswith("KUBE-")
                and not parts[1].startswith("KUBE-")
            ):
                subprocess.run(["iptables", "-t", table, "-D", *parts[1:]], capture_output=True,
                               check=False)  # fmt: skip
        for rule in rules:
            if rule.startswith(":KUBE-"):
                chain = rule[1:].split()[0]
                subprocess.run(["iptables", "-t", table, "-F", chain], capture_output=True,
                               check=False)  # fmt: skip
                subprocess.run(["iptables", "-t", table, "-X", chain], capture_output=True,
                               check=False)  # fmt: skip


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first (from /proc/self/mountinfo)."""
    prefix = str(root.resolve())
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def _unmount_under(root: Path) -> None:
    for _ in range(3):  # a bind mount may hide mounts below it until it goes
        points = mounts_under(root) if root.exists() else []
        if not points:
            return
        for point in points:
            subprocess.run(["umount", point], capture_output=True, check=False)
    for point in mounts_under(root) if root.exists() else []:
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _remove_cgroups(name: str) -> None:
    """``kubepods`` (and its QoS children) in every cgroup v1 hierarchy, deepest first."""
    if not CGROUP_ROOT.is_dir():
        return
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                      reverse=True)  # fmt: skip
        for path in [*dirs, top]:
            with suppress(OSError):
                path.rmdir()


def leftovers(workdir: Path) -> list[str]:
    """What a stopped cluster left on the host ([] when clean): for ``dev down`` and tests."""
    found = []
    if subprocess.run(["ip", "link", "show", "ptbr0"], capture_output=True).returncode == 0:
        found.append("bridge ptbr0")
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    if "POSTTRAIN-FORWARD" in rules or "KUBE-" in rules:
        found.append("iptables rules (POSTTRAIN-FORWARD/KUBE-*)")
    if workdir.exists() and mounts_under(workdir):
        found.append(f"mounts under {workdir}")
    for hierarchy in CGROUP_ROOT.iterdir() if CGROUP_ROOT.is_dir() else []:
        if (hierarchy / "kubepods").is_dir():
            found.append(f"cgroup {hierarchy / 'kubepods'}")
    processes = subprocess.run(["pgrep", "-f", "containerd-shim-runc-v2 .*-address " + str(workdir)],
                               capture_output=True, text=True).stdout.split()  # fmt: skip
    if processes:
        found.append(f"containerd shims {processes}")
    return found
