"""``posttrain dev up|down|status``: a local Kubernetes and MinIO for a person.

``up`` starts the real single-node cluster (:mod:`.realnode`: kubelet, containerd, runc) where
it can run, and refuses, saying what is missing and what provides it, where it cannot; the
control plane alone (``--node none``, whose pods need the stand-in ``posttrain dev agent``) is
started only when asked for. ``up`` is idempotent: a healthy environment recorded in the state
file is reused; a stopped or broken one (dead processes) is restarted in place, as what it was,
on its own data, with its ports, CA and MinIO keys. Whatever fails while starting is stopped
again, so nothing half-started is left running. Data is deleted only by ``dev down --purge``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import yaml

from posttrain.api.envnames import DEV_DIR, OPERATOR_S3_ENDPOINT, S3_ENDPOINT, S3_SECURE
from posttrain.errors import UsageError
from posttrain.processes import StartError, http_ok, pid_alive, stop_pid

from .registry import register_this_process, state_dir, stop_registered

log = logging.getLogger(__name__)


@dataclass
class DevState:
    workdir: str
    kubeconfig: str
    apiserver: str
    minio_endpoint: str
    minio_access_key: str
    minio_secret_key: str
    pids: list[int]
    node: str = "none"
    """"real": a kubelet with containerd runs the pods (``--node real``, the default); "none":
    only the control plane (pods need ``posttrain dev agent``). Records from before the real
    node lack the field: they were "none"."""
    node_record: dict[str, Any] | None = None
    """The real node's :meth:`RealCluster.record`, which ``dev down`` stops it from."""

    @classmethod
    def load(cls) -> DevState | None:
        path = state_dir() / "state.json"
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text()))

    def save(self) -> None:
        path = state_dir() / "state.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        path.chmod(0o600)

    def healthy(self) -> bool:
        return all(pid_alive(p) for p in self.pids) and http_ok(
            f"http://{self.minio_endpoint}/minio/health/live"
        )

    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": self.kubeconfig,
            S3_ENDPOINT: self.minio_endpoint,
            S3_SECURE: "false",
            "AWS_ACCESS_KEY_ID": self.minio_access_key,
            "AWS_SECRET_ACCESS_KEY": self.minio_secret_key,
            # What `posttrain operator` reads (OperatorConfig): pods it creates get this
            # endpoint, and keys from the Secret that `dev up` creates.
            OPERATOR_S3_ENDPOINT: self.minio_endpoint,
        }


def install_crds(kubeconfig: Path) -> None:
    """Create or replace the generated CRDs (rendered from the models in this install)."""
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    from posttrain.api.crdgen import render_crds

    api = config.new_client_from_config(config_file=str(kubeconfig))
    ext = client.ApiextensionsV1Api(api)
    for text in render_crds().values():
        body: dict[str, Any] = yaml.safe_load(text)
        # The client validates a dict body into its model anyway; doing it here types the call.
        crd = client.V1CustomResourceDefinition.model_validate(body)
        try:
            ext.create_custom_resource_definition(crd)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = ext.read_custom_resource_definition(body["metadata"]["name"])
            assert current.metadata is not None  # the apiserver always returns it
            body["metadata"]["resourceVersion"] = current.metadata.resource_version
            crd = client.V1CustomResourceDefinition.model_validate(body)
            ext.replace_custom_resource_definition(body["metadata"]["name"], crd)


def ensure_s3_secret(kubeconfig: Path, access_key: str, secret_key: str) -> None:
    """The ``posttrain-s3`` Secret in ``default``: the keys the operator gives trainer pods.

    Created or updated in place, so ``dev up`` stays idempotent and a restarted MinIO with
    new keys is picked up.
    """
    from kubernetes import client, config
    from kubernetes.client.rest import ApiException

    from posttrain.operator.config import OperatorConfig

    core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    name = OperatorConfig.model_fields["s3_credentials_secret"].default
    body = client.V1Secret.model_validate(
        {
            "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "posttrain-dev"}},
            "stringData": {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
        }
    )
    try:
        core.create_namespaced_secret("default", body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret(name, "default", body)


def dev_up(args: argparse.Namespace) -> int:
    """Start the dev environment, reuse a healthy one, or restart a stopped or broken one in
    place on its own data (never deleting it: that is ``dev down --purge``)."""
    from .controlplane import ControlPlane
    from .minio import MinioServer

    existing = DevState.load()
    if existing and existing.healthy():
        if args.node is not None and args.node != existing.node:
            raise UsageError(
                f"a dev environment with --node {existing.node} is running: `posttrain dev "
                f"down` stops it first (its data is kept for `posttrain dev up --node "
                f"{existing.node}`)"
            )
        print("posttrain dev environment already running")
        _print_state(existing)
        return 0
    # A recorded environment starts again as what it was; a new one is the real node.
    node = args.node or (existing.node if existing else "real")
    if existing is None:
        _refuse_orphaned_data(node)
    elif existing.node != node:
        raise UsageError(
            f"a stopped dev environment (--node {existing.node}) keeps its data in "
            f"{existing.workdir}: `posttrain dev up --node {existing.node}` starts it again with "
            "that data; `posttrain dev down --purge` deletes it"
        )
    images = _wanted_images(args.images) if node == "real" else []
    if node == "real":
        if args.apiserver_port or args.etcd_port or args.minio_port:
            raise UsageError(
                "--apiserver-port, --etcd-port and --minio-port are for --node none: the real "
                "node serves on its bridge's address and picks free ports"
            )
        _refuse_without_real_node(images, asked=args.node == "real")
    if existing is not None:
        print(f"restarting the dev environment in place; its data in {existing.workdir} is kept")
        _stop_processes(existing)
    if node == "real":
        return _dev_up_real_node(images, existing)
    workdir = Path(existing.workdir) if existing else state_dir() / "env"
    workdir.mkdir(parents=True, exist_ok=True)
    cp = ControlPlane(
        workdir=workdir / "controlplane",
        apiserver_port=args.apiserver_port or (_port(existing.apiserver) if existing else 0),
        etcd_port=args.etcd_port,
    )
    minio = MinioServer(
        data_dir=workdir / "minio",
        port=args.minio_port or (_port(existing.minio_endpoint) if existing else 0),
    )
    keys = _minio_keys(existing)
    if keys:
        minio.access_key, minio.secret_key = keys
    try:
        cp.start()
        minio.start()
        install_crds(cp.kubeconfig)
        ensure_s3_secret(cp.kubeconfig, minio.access_key, minio.secret_key)
    except (StartError, OSError) as exc:
        minio.stop()
        cp.stop(keep_logs=True)
        raise UsageError(f"dev environment failed to start: {exc}") from None
    except BaseException:
        minio.stop()
        cp.stop(keep_logs=True)
        raise
    pids = [p.pid for p in cp.processes if p.pid] + (
        [minio.process.pid] if minio.process and minio.process.pid else []
    )
    state = DevState(
        workdir=str(workdir),
        kubeconfig=str(cp.kubeconfig),
        apiserver=cp.server,
        minio_endpoint=minio.endpoint,
        minio_access_key=minio.access_key,
        minio_secret_key=minio.secret_key,
        pids=pids,
    )
    state.save()
    print("posttrain dev environment is up")
    _print_state(state)
    return 0


def _port(address: str) -> int:
    """The port of ``https://host:port`` or ``host:port``."""
    return int(address.rsplit(":", 1)[1])


def _minio_keys(existing: DevState | None) -> tuple[str, str] | None:
    """The recorded MinIO keys (its data and the posttrain-s3 Secrets were made with them)."""
    return (existing.minio_access_key, existing.minio_secret_key) if existing else None


def _refuse_orphaned_data(node: str) -> None:
    """No record, yet data where a new environment would start: never start over it."""
    workdir = state_dir() / ("node" if node == "real" else "env")
    if workdir.is_dir() and any(workdir.iterdir()):
        raise UsageError(
            f"{workdir} holds the data of an earlier dev environment whose record "
            f"({state_dir() / 'state.json'}) is gone; `posttrain dev down --purge` deletes it"
        )


def _wanted_images(images: str) -> list[str]:
    """``--images`` as image references (``ghcr.io/posttrain/<name>:<appVersion>``)."""
    from .realnode.cluster import IMAGE_NAMES, image_refs

    wanted = [name.strip() for name in images.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(IMAGE_NAMES))
    if unknown:
        raise UsageError(f"--images: unknown {unknown}; choose from {', '.join(IMAGE_NAMES)}")
    return image_refs(wanted)


def _refuse_without_real_node(images: list[str], asked: bool) -> None:
    """Say what keeps the real node from running here, what provides it, and how to start the
    stand-in instead; never fall back to it unasked (its pods are processes, not containers,
    and run the checked-out code, not the images: docs/e2e.md)."""
    from .realnode.requirements import missing_for_real_node

    missing = missing_for_real_node(images)
    if not missing:
        return
    command = "`posttrain dev up --node real`" if asked else "`posttrain dev up` (by default)"
    lines = "\n".join(f"  - {item}" for item in missing)
    raise UsageError(
        f"{command} starts a real single-node cluster, which cannot run on this machine; "
        f"missing:\n{lines}\n"
        "Provide those and run it again, or start the stand-in explicitly: `posttrain dev up "
        "--node none` runs etcd, kube-apiserver and MinIO without a node, and `posttrain dev "
        "agent` then runs pods as local bubblewrap processes of the checked-out code (no "
        "images, no root; docs/e2e.md)"
    )


def _dev_up_real_node(images: list[str], existing: DevState | None) -> int:
    """``dev up --node real``: the whole single-node cluster (posttrain.devenv.realnode)."""
    from .realnode.cluster import RealCluster

    workdir = Path(existing.workdir) if existing else state_dir() / "node"
    cluster = RealCluster(workdir, images=images)
    try:
        cluster.start(minio_keys=_minio_keys(existing))
        install_crds(cluster.kubeconfig)
        assert cluster.minio is not None
        ensure_s3_secret(cluster.kubeconfig, cluster.minio.access_key, cluster.minio.secret_key)
    except (StartError, OSError, RuntimeError, TimeoutError) as exc:
        cluster.stop(keep_workdir=True)
        raise UsageError(
            f"the real node failed to start: {exc} (logs in {workdir}; `posttrain dev up "
            "--node none` starts the control plane alone)"
        ) from None
    except BaseException:
        cluster.stop(keep_workdir=True)
        raise
    assert cluster.control_plane is not None and cluster.minio is not None
    state = DevState(
        workdir=str(workdir),
        kubeconfig=str(cluster.kubeconfig),
        apiserver=cluster.control_plane.server,
        minio_endpoint=cluster.minio.endpoint,
        minio_access_key=cluster.minio.access_key,
        minio_secret_key=cluster.minio.secret_key,
        pids=cluster.pids(),
        node="real",
        node_record=cluster.record(),
    )
    state.save()
    print("posttrain dev cluster is up (a real node: kubelet, containerd, runc)")
    for name, seconds in cluster.timings.items():
        print(f"  {name:<20} ready in {seconds:.1f} s")
    _print_state(state)
    return 0


def _print_state(state: DevState) -> None:
    print(f"  kube-apiserver: {state.apiserver}")
    print(f"  kubeconfig:     {state.kubeconfig}")
    print(f"  MinIO (S3):     http://{state.minio_endpoint}")
    print(f"  credentials:    {state_dir() / 'state.json'} (or `posttrain dev env`)")
    print(f"try: kubectl --kubeconfig {state.kubeconfig} get trainingruns -A")


def _stop_processes(state: DevState) -> None:
    """Stop the environment's own processes (the node first); its data stays."""
    if state.node_record is not None:
        from .realnode.cluster import RealCluster

        RealCluster.from_record(state.node_record).stop(keep_workdir=True)
    for pid in reversed(state.pids):
        stop_pid(pid)


def _inventory(state: DevState) -> str:
    """What the environment holds, for the line that says what ``--purge`` deletes."""
    held = [f"{_size_mb(Path(state.workdir)):,.0f} MB on disk"]
    if state.healthy():
        try:
            held.insert(0, f"{_count_trainingruns(Path(state.kubeconfig))} TrainingRun(s)")
            held.insert(1, f"{_count_objects(state)} object(s) in MinIO")
        except Exception as exc:  # counting is a courtesy; the deletion does not depend on it
            log.info("could not count what the environment holds: %s", exc)
    return ", ".join(held)


def _size_mb(path: Path) -> float:
    total = 0
    for entry in path.rglob("*") if path.is_dir() else []:
        with contextlib.suppress(OSError):
            if entry.is_file() and not entry.is_symlink():
                total += entry.stat().st_size
    return total / 1e6


def _count_trainingruns(kubeconfig: Path) -> int:
    from kubernetes import client, config

    from posttrain.api.base import GROUP, VERSION

    api = client.CustomObjectsApi(config.new_client_from_config(config_file=str(kubeconfig)))
    listed = api.list_cluster_custom_object(GROUP, VERSION, "trainingruns")
    return len(cast(dict[str, Any], listed).get("items", []))


def _count_objects(state: DevState) -> int:
    from minio import Minio

    s3 = Minio(
        state.minio_endpoint,
        access_key=state.minio_access_key,
        secret_key=state.minio_secret_key,
        secure=False,
    )
    return sum(
        1 for bucket in s3.list_buckets() for _ in s3.list_objects(bucket.name, recursive=True)
    )


def dev_down(args: argparse.Namespace) -> int:
    """Stop the operator, agent and pods started against the environment, then the
    environment itself (a stopped control plane would leave them retrying forever). Its data
    is kept for the next ``dev up`` unless ``--purge`` says to delete it."""
    state = DevState.load()
    inventory = _inventory(state) if state and args.purge else ""
    stopped = stop_registered()
    for entry in stopped:
        print(f"stopped {entry.role} (pid {entry.pid}): {entry.cmdline[:100]}")
    shutil.rmtree(state_dir() / "processes", ignore_errors=True)
    if state is not None:
        _stop_processes(state)
    if not args.purge:
        if state is None:
            print("no posttrain dev environment is running")
        else:
            print(
                f"posttrain dev environment stopped; its data is kept in {state.workdir} "
                f"({_size_mb(Path(state.workdir)):,.0f} MB): `posttrain dev up` starts it again "
                "with it, `posttrain dev down --purge` deletes it"
            )
        return 0
    deleted = [Path(state.workdir)] if state else []
    deleted += [d for d in (state_dir() / "env", state_dir() / "node") if d.is_dir()]
    for directory in dict.fromkeys(deleted):
        shutil.rmtree(directory, ignore_errors=True)
    (state_dir() / "state.json").unlink(missing_ok=True)
    if state is None and not deleted:
        print("no posttrain dev environment to delete")
    else:
        what = f" ({inventory})" if inventory else ""
        gone = ", ".join(str(d) for d in dict.fromkeys(deleted))
        print(f"posttrain dev environment stopped and removed: deleted {gone}{what}")
    return 0


def dev_status(args: argparse.Namespace) -> int:
    state = DevState.load()
    if state is None:
        print("no posttrain dev environment (run `posttrain dev up`)")
        return 1
    healthy = state.healthy()
    verdict = (
        "healthy"
        if healthy
        else f"stopped or unhealthy (`posttrain dev up` restarts it on its data in {state.workdir})"
    )
    print(f"posttrain dev environment: {verdict}")
    _print_state(state)
    return 0 if healthy else 1


def dev_env(args: argparse.Namespace) -> int:
    state = DevState.load()
    if state is None:
        raise UsageError("no posttrain dev environment is running; run `posttrain dev up` first")
    for key, value in state.env().items():
        print(f"export {key}={value}")
    return 0


def dev_agent(args: argparse.Namespace) -> int:
    """Run the local node agent (a development aid) against the dev control plane."""
    from .nodeagent import NodeAgent

    state = DevState.load()
    kubeconfig = args.kubeconfig or (state.kubeconfig if state else None)
    if kubeconfig is None:
        raise UsageError(
            "no dev environment: run `posttrain dev up --node none` first or pass --kubeconfig"
        )
    if state is not None and state.node == "real" and args.kubeconfig is None:
        raise UsageError(
            "the dev environment runs a real node, whose kubelet runs the pods: the stand-in "
            "agent is for `posttrain dev up --node none` (`posttrain dev down` first)"
        )
    # Inside the dev environment's directory, so `posttrain dev down` removes pod dirs and logs.
    workdir = Path(state.workdir) / "nodeagent" if state else state_dir() / "nodeagent"
    agent = NodeAgent.from_kubeconfig(
        Path(kubeconfig),
        workdir=workdir,
        register_processes=True,
        unreachable_exit_s=AGENT_GIVES_UP_S,
    )
    # Recorded so `posttrain dev down` stops this agent (and it its pods) with the rest.
    register_this_process("agent", str(kubeconfig))
    print(
        f"node agent running pods of {kubeconfig} as local processes "
        "(Ctrl-C or `posttrain dev down` stops it)",
        flush=True,
    )
    print(f"  pod logs: {workdir}/<namespace>_<pod>.log", flush=True)
    # SIGTERM (kill, a supervisor) stops the pods too: their processes live in their own
    # sessions and would otherwise outlive the agent.
    signal.signal(signal.SIGTERM, lambda signum, frame: agent.request_stop())
    try:
        agent.run_forever()
    except KeyboardInterrupt:
        agent.stop()
    return 1 if agent.gave_up else 0


# The agent stops itself (and its pods) when the apiserver is gone this long: a control
# plane stopped under it will not come back at the same address.
AGENT_GIVES_UP_S = 30.0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    dev = sub.add_parser(
        "dev",
        help="start/stop a local Kubernetes (a real single-node cluster) and MinIO",
        description="A local Kubernetes for development: a real single-node cluster "
        "(kubelet, containerd, runc) that runs the images of `make images`, or the control "
        "plane alone (--node none), and a MinIO server.",
    )
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="ACTION", required=True)
    up = dev_sub.add_parser(
        "up",
        help="start (or reuse) the dev environment",
        description="Start a real single-node cluster: etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler, a kubelet with containerd and runc, CNI, "
        "kube-proxy, CoreDNS, and MinIO, with the images of `make images` on the node; it "
        "needs root, containerd, runc, the CNI plugins (`make system-deps`) and the images. "
        "Where those are missing it refuses and says which. Then install the posttrain CRDs "
        "and the posttrain-s3 Secret, and record everything in "
        f"~/.cache/posttrain/dev/state.json (${DEV_DIR}). Idempotent: a healthy environment "
        "is reused, a stopped one restarts as what it was, on its data; whatever fails to "
        "start is stopped again.",
        epilog='next: eval "$(posttrain dev env)"; helm install ... -f '
        "charts/posttrain/values-dev.yaml; kubectl apply -f examples/dev-run.yaml  (README.md, "
        "'End to end on a local cluster'). Without a node (--node none): posttrain dev agent "
        "& posttrain operator --standalone &  (docs/e2e.md)",
    )
    up.add_argument(
        "--apiserver-port",
        type=int,
        default=0,
        help="with --node none: kube-apiserver's HTTPS port (default: a free port)",
    )
    up.add_argument(
        "--etcd-port",
        type=int,
        default=0,
        help="with --node none: etcd's client port (default: a free port)",
    )
    up.add_argument(
        "--minio-port",
        type=int,
        default=0,
        help="with --node none: MinIO's S3 port (default: a free port)",
    )
    up.add_argument(
        "--node",
        choices=("real", "none"),
        default=None,
        help="real (the default for a new environment): a whole single-node cluster "
        "(kubelet, containerd, runc, CNI, kube-proxy, CoreDNS, scheduler, controller-manager) "
        "that runs the images of `make images`; needs root, and refuses, saying what is "
        "missing, where it cannot run. none: etcd + kube-apiserver + MinIO only, for machines "
        "where the real node cannot run (no root, no containerd, no images): pods then need "
        "`posttrain dev agent`, a stand-in that runs them as local processes (docs/e2e.md). "
        "A recorded environment restarts as what it was",
    )
    up.add_argument(
        "--images",
        default="operator,sandbox,trainer",
        help="with the real node: which of `make images`' images to load into the node "
        "(comma-separated, from operator, sandbox, trainer, rollout; default: the three the "
        "chart's install and CPU pools run; add rollout, a 7 GB image, for `engine: vllm` "
        "pools). Each is imported once per image ID",
    )
    up.set_defaults(func=dev_up)
    down = dev_sub.add_parser(
        "down",
        help="stop it (its data is kept unless --purge)",
        description="Stop everything the dev environment runs: the `posttrain dev agent` and "
        "`posttrain operator` processes started against it (with the pods the agent runs), "
        "MinIO, kube-apiserver and etcd (and the real node). Its data (TrainingRuns in etcd, "
        "checkpoints and trajectories in MinIO) is kept for the next `posttrain dev up`.",
    )
    down.add_argument(
        "--purge",
        action="store_true",
        help="also delete its data: says how many TrainingRuns and MinIO objects it deletes",
    )
    down.set_defaults(func=dev_down)
    status = dev_sub.add_parser("status", help="is it running and healthy?")
    status.set_defaults(func=dev_status)
    env = dev_sub.add_parser("env", help="print shell exports (KUBECONFIG, S3 endpoint/keys)")
    env.set_defaults(func=dev_env)
    agent = dev_sub.add_parser(
        "agent",
        help="run pods as local processes (development aid: no containers, no kubelet)",
        description="Stand in for the node, scheduler, kubelet and Deployment controller the "
        "dev control plane lacks: register one Node, bind every pending pod to it, run each "
        "pod's command as a bubblewrap-isolated local process (images are ignored), report "
        "pod status and serve pod logs to `kubectl logs`/`posttrain logs`, and resolve "
        "Service names through each pod's /etc/hosts. Runs until Ctrl-C or `posttrain dev "
        "down`; stops its pods when it stops.",
        epilog="pod logs are kept in <dev workdir>/nodeagent/<namespace>_<pod>.log",
    )
    agent.add_argument(
        "--kubeconfig",
        default=None,
        help="cluster to serve (default: the one `posttrain dev up` started)",
    )
    agent.set_defaults(func=dev_agent)
