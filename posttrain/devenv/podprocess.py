"""How the local node agent turns a pod's container into a host process (dev aid).

Pure pieces of :mod:`posttrain.devenv.nodeagent`'s "kubelet": the container's environment
(``$(VAR)`` expansion, downward-API values, Secret data), the bubblewrap argv that shows the
process its volumes at their mount paths, executable resolution (``python``/``posttrain`` ->
the project's venv), process-group termination, httpGet probes, termination messages and
the pod/container status fragments the agent patches. Nothing here talks to the apiserver.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

Manifest = dict[str, Any]

DEFAULT_TERMINATION_PATH = "/dev/termination-log"
# The kubelet caps termination messages at 4 KiB; the same cap keeps status patches small.
MAX_TERMINATION_MESSAGE = 4096
# FallbackToLogsOnError uses the tail of the log (the kubelet takes 80 lines).
FALLBACK_LOG_LINES = 80
# Commands that must run the checked-out project, not whatever an image would have held.
INTERPRETER_COMMANDS = frozenset({"posttrain", "python", "python3"})


class PodSpecError(ValueError):
    """The pod asks for something the local agent cannot provide; the pod is marked Failed."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def refuse_sidecars(spec: Mapping[str, Any]) -> None:
    """PodSpecError for native sidecars (init containers with ``restartPolicy: Always``,
    e.g. a TrainingRun's ``rollout.colocated`` replicas): this agent runs init containers
    one after another to their exit, so a server there would hold the pod forever. The
    real node's kubelet runs them (``posttrain dev up``, docs/real-node.md).

    >>> refuse_sidecars({"initContainers": [{"name": "fetch-model"}]})
    >>> refuse_sidecars({"initContainers": [{"name": "rollout-0", "restartPolicy": "Always"}]})
    Traceback (most recent call last):
    ...
    posttrain.devenv.podprocess.PodSpecError: native sidecar containers (rollout-0: restartPolicy Always) need a real kubelet; the stand-in node agent runs init containers to their exit: use the real node (posttrain dev up)
    """
    sidecars = [c["name"] for c in spec.get("initContainers") or []
                if c.get("restartPolicy") == "Always"]  # fmt: skip
    if sidecars:
        raise PodSpecError(
            f"native sidecar containers ({', '.join(sidecars)}: restartPolicy Always) need a "
            "real kubelet; the stand-in node agent runs init containers to their exit: use "
            "the real node (posttrain dev up)"
        )


def expand_references(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes.

    >>> expand_references("$(A)-$(B)-$$(A)", {"A": "1"})
    '1-$(B)-$(A)'
    """

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", replace, text)


def field_ref_value(pod: Manifest, field_path: str) -> str:
    """The downward-API value of ``field_path`` for ``pod``.

    >>> field_ref_value({"metadata": {"annotations": {"a.b/c": "x"}}}, "metadata.annotations['a.b/c']")
    'x'
    >>> field_ref_value({"metadata": {"name": "p"}}, "metadata.name")
    'p'
    """
    meta = pod.get("metadata") or {}
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
    if keyed:
        return str((meta.get(keyed.group(1)) or {}).get(keyed.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": (pod.get("spec") or {}).get("nodeName"),
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName"),
        "status.podIP": (pod.get("status") or {}).get("podIP"),
        "status.hostIP": (pod.get("status") or {}).get("hostIP"),
    }
    if field_path in simple:
        return str(simple[field_path] or "")
    if field_path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(field_path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise PodSpecError(
        f"fieldRef {field_path!r} is not supported by the local node agent; "
        f"use one of {sorted(simple)} or metadata.labels/annotations['key']"
    )


def decode_secret_data(secret: Manifest) -> dict[str, str]:
    """A Secret's ``data`` (base64) merged over its ``stringData``, decoded.

    >>> decode_secret_data({"data": {"k": "aGk="}})
    {'k': 'hi'}
    """
    decoded = dict(secret.get("stringData") or {})
    for key, value in (secret.get("data") or {}).items():
        decoded[key] = base64.b64decode(value).decode()
    return decoded


@dataclass
class ContainerResult:
    exit_code: int
    reason: str
    message: str
    started_at: str
    finished_at: str


def existing_ancestors(target: str) -> set[str]:
    """Host directories above a mount path that does not exist yet (all of them up to /).

    >>> sorted(existing_ancestors("/etc/no-such-dir/x"))
    ['/', '/etc']
    """
    if os.path.lexists(target):
        return set()
    ancestors = [str(p) for p in Path(target).parents]
    first = next(i for i, p in enumerate(ancestors) if os.path.isdir(p))
    return set(ancestors[first:])


def host_view_binds(targets: Iterable[str], reach: Iterable[str] = ()) -> list[str]:
    """bwrap args rebuilding the host filesystem on bwrap's empty tmpfs root.

    Host entries are bound one by one; a directory that must receive a new mount point
    (``/`` for ``/workspace``, ``/etc`` for ``/etc/posttrain``) is recreated on tmpfs and its
    entries bound inside it, so mount points are made in the sandbox, never on the host.
    The ancestors of each ``reach`` path are recreated the same way (0755) but hold only the
    way down, so any user can walk to that path through a host directory it may not enter
    (root's 0700 home) without seeing that directory's other entries, which it could not
    have entered on the host either. /dev and /proc are fresh (``--dev``, ``--proc``).
    """
    exploded = {"/"}
    for target in targets:
        if not target.startswith(("/dev/", "/proc/")):
            exploded |= existing_ancestors(target)
    way_down = {str(p) for path in reach for p in Path(path).parents} - exploded
    on_the_way = way_down | set(reach)
    exploded |= way_down
    args: list[str] = []

    def visit(directory: str) -> None:
        for entry in sorted(os.listdir(directory)):
            path = os.path.join(directory, entry)
            if path in ("/dev", "/proc"):
                continue
            if directory in way_down and path not in on_the_way:
                continue
            if os.path.islink(path):
                args.extend(["--symlink", os.readlink(path), path])
            elif path in exploded and os.path.isdir(path):
                args.extend(["--perms", "0755", "--dir", path])
                visit(path)
            else:
                args.extend(["--bind", path, path])

    visit("/")
    return args


def service_host_entries(services: Iterable[Manifest], pods: Iterable[Manifest]) -> list[str]:
    """``/etc/hosts`` lines resolving each Service's DNS names to its ready pods' IPs.

    The stand-in for cluster DNS + kube-proxy: names map straight to pod IPs, so only
    Services whose ports all equal their target ports are resolvable (a client connects to
    the Service port on the pod); the others are left out rather than resolved wrongly.
    Named target ports are looked up in the pods' container ports.

    >>> svc = {"metadata": {"name": "pool", "namespace": "ns"},
    ...        "spec": {"selector": {"app": "p"}, "ports": [{"port": 8000, "targetPort": "http"}]}}
    >>> pod = {"metadata": {"labels": {"app": "p"}, "namespace": "ns"},
    ...        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
    ...        "status": {"podIP": "127.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    >>> service_host_entries([svc], [pod])
    ['127.0.0.5 pool.ns.svc.cluster.local pool.ns.svc pool.ns']
    >>> svc["spec"]["ports"][0]["targetPort"] = 9000  # port != targetPort: not resolvable here
    >>> service_host_entries([svc], [pod])
    []
    """
    pods = list(pods)
    lines: list[str] = []
    for service in services:
        meta, spec = service["metadata"], service.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector:
            continue  # no selector: endpoints are managed by hand, nothing to map
        namespace = meta["namespace"]
        ready = [
            pod
            for pod in pods
            if pod["metadata"].get("namespace") == namespace
            and selector.items() <= (pod["metadata"].get("labels") or {}).items()
            and (pod.get("status") or {}).get("podIP")
            and any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in (pod.get("status") or {}).get("conditions") or []
            )
        ]
        if not ready or not all(
            _target_port_matches(port, ready[0]) for port in spec.get("ports") or []
        ):
            continue
        name = meta["name"]
        names = f"{name}.{namespace}.svc.cluster.local {name}.{namespace}.svc {name}.{namespace}"
        lines += [f"{ip} {names}" for ip in sorted({p["status"]["podIP"] for p in ready})]
    return lines


def _target_port_matches(port: Manifest, pod: Manifest) -> bool:
    target = port["targetPort"] if "targetPort" in port else port["port"]
    if isinstance(target, str) and not target.isdigit():
        numbers = [
            p.get("containerPort")
            for c in pod["spec"].get("containers") or []
            for p in c.get("ports") or []
            if p.get("name") == target
        ]
        return numbers == [port["port"]]
    return int(target) == int(port["port"])


def hosts_file_text(base: str, pod_name: str, pod_ip: str, service_lines: Iterable[str]) -> str:
    r"""A pod's ``/etc/hosts``: the host's file, the pod's own name, then its namespace's Services.

    Short names (``pool``) resolve only inside the pod's namespace, as with cluster DNS search
    domains, so callers pass only that namespace's Service lines.

    >>> print(hosts_file_text("127.0.0.1 localhost\n", "p-0", "127.0.0.2",
    ...                       ["127.0.0.3 pool.ns.svc.cluster.local pool.ns.svc pool.ns"]), end="")
    127.0.0.1 localhost
    # posttrain node agent: pod and Services (rewritten in place while the pod runs)
    127.0.0.2 p-0
    127.0.0.3 pool.ns.svc.cluster.local pool.ns.svc pool.ns pool
    """
    lines = [
        base.rstrip("\n"),
        "# posttrain node agent: pod and Services (rewritten in place while the pod runs)",
        f"{pod_ip} {pod_name}",
    ]
    for line in service_lines:
        short = line.split()[-1].split(".")[0]
        lines.append(f"{line} {short}")
    return "\n".join(lines) + "\n"


def bwrap_prefix(
    mounts: Sequence[tuple[str, str, bool]],
    *,
    proc_unmasked: bool = False,
    host_pid: bool = False,
    hide: Sequence[str] = (),
    reach: Sequence[str] = (),
) -> list[str]:
    """The bwrap argv (without the trailing ``--``) giving a process the pod's filesystem view.

    ``hide``: host directories covered by an empty tmpfs, as a container never sees the
    node's: the dev environment's state (PKI, MinIO keys) and every other pod's directory
    (their service-account tokens). A mount whose source lies there still works: bwrap binds
    from the host side.

    ``mounts`` are (host source, mount path, read-only). Missing parent directories are made
    world-traversable (0755): bwrap would create them 0700, which a dropped-to user cannot
    enter. Nothing is created on the host (see :func:`host_view_binds`).

    Unless the pod sets ``hostPID`` or an unmasked ``/proc`` (below), it gets its own pid
    namespace, as in Kubernetes: a program that signals every process it may (``kill -1``,
    as the unit-test harness does when it is done) reaches only its own pod, never the other
    pods of the same uid. The container's command is its pid 1 (``--as-pid-1``), as in a
    container, so ``kill -1`` inside spares it: a SandboxTask's entrypoint outlives the
    harness it runs and still uploads the log.

    ``/proc`` plays the container's: by default a fresh procfs on which bwrap covers ``sys``,
    ``sysrq-trigger``, ``irq`` and ``bus`` (like Kubernetes' default masked ``/proc``), so
    bubblewrap *inside* the pod cannot mount a procfs of its own (the kernel lets an
    unprivileged user namespace mount one only where a fully visible one exists). A
    container with ``securityContext.procMount: Unmasked`` gets the host's ``/proc`` bound
    instead, as the kubelet gives it an unmasked one: the sandbox runner's bwrap then works.
    Such a pod stays in the host's pid namespace, the one that ``/proc`` shows: bwrap looks
    its children up as ``/proc/<pid>``, which in a pid namespace of its own would name other
    processes. (Its untrusted programs get pid namespaces of their own from its bwrap.)

    >>> "--unshare-pid" in bwrap_prefix([]), bwrap_prefix([], proc_unmasked=True)[-4:]
    (True, ['--bind', '/proc', '/proc', '--die-with-parent'])
    >>> "--unshare-pid" in bwrap_prefix([], host_pid=True)
    False
    """
    # Resolve symlinked parents (/var/run -> /run) so mount points are made in the real
    # directory, which host_view_binds recreates on tmpfs, not through a link into the host.
    mounts = [
        (source, target if target.startswith(("/dev/", "/proc/")) else os.path.realpath(target), ro)
        for source, target, ro in mounts
    ]
    args = [
        "bwrap",
        *host_view_binds((target for _, target, _ in mounts), reach),
        "--dev",
        "/dev",
        *(["--bind", "/proc", "/proc"] if proc_unmasked else ["--proc", "/proc"]),
        "--die-with-parent",
        *([] if host_pid or proc_unmasked else ["--unshare-pid", "--as-pid-1"]),
    ]
    hidden = sorted({os.path.realpath(path) for path in hide if os.path.isdir(path)})
    hidden = [h for h in hidden if not any(h.startswith(o.rstrip("/") + "/") for o in hidden)]
    for path in hidden:
        args += ["--tmpfs", path]

    def covered(path: str) -> bool:
        return any(path == h or path.startswith(h.rstrip("/") + "/") for h in hidden)

    made: set[str] = set()
    for source, target, read_only in mounts:
        parents = [str(p) for p in reversed(Path(target).parents) if str(p) != "/"]
        if os.path.isdir(source):
            parents.append(target)
        for parent in parents:
            on_fresh_fs = parent.startswith(("/dev/", "/proc/"))
            missing = not os.path.exists(parent) or (covered(parent) and parent not in hidden)
            if parent not in made and not on_fresh_fs and missing:
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind" if read_only else "--bind", source, target]
    return args


def mounted_over(path: str, targets: Iterable[str]) -> bool:
    """Whether a mount at one of ``targets`` hides ``path`` (the target is ``path`` or above it).

    >>> mounted_over("/tmp/agent/pods/p/cwd", ["/models", "/tmp"])
    True
    >>> mounted_over("/tmp/agent/pods/p/cwd", ["/tmpfs", "/home/posttrain"])
    False
    """
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets)


def write_projection(target: Path, data: Mapping[str, str], items: list[Manifest] | None) -> None:
    """Write ``data`` as files (all keys, or only ``items`` key -> path) under ``target``."""
    selected = (
        {item["key"]: item["path"] for item in items} if items else {key: key for key in data}
    )
    for key, relative in selected.items():
        if key not in data:
            raise PodSpecError(f"volume item key {key!r} not found (keys: {sorted(data)})")
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write-then-rename, as the kubelet's atomic writer does: a process polling the file
        # (a warm sandbox pod waiting for its claim) never reads half of an update.
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(data[key])
        os.replace(partial, path)


def chown_tree(root: Path, uid: int, gid: int) -> None:
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), uid, gid)


def interpreter_prefix(bin_dir: Path) -> list[str]:
    """Where the stand-in image's interpreter is installed, for :func:`bwrap_prefix`'s
    ``reach`` when a pod drops to another user.

    The environments standing in for images (``.venv``, ``.venv-vllm``) link their ``python``
    to an installation that may live under root's 0700 home (pyenv, uv). An image's own
    interpreter (``/opt/posttrain``) is readable by its user; here, a pod running as uid 10001
    could start its first process and then fail to start any child interpreter (the vLLM
    front door's vLLM, torchrun's workers) with EACCES. The installation's ancestors are
    recreated as sandbox directories (0755, :func:`host_view_binds`), so the user reaches
    it and nothing else under them: the rest of root's home keeps its mode.

    >>> interpreter_prefix(Path("/nonexistent/bin"))
    []
    """
    python = bin_dir / "python"
    if not python.exists():
        return []
    return [str(Path(os.path.realpath(python)).parent.parent)]


def run_as_user(pod_spec: Manifest, container: Manifest) -> tuple[int, int] | None:
    """(uid, gid) to drop to, container securityContext over the pod's; None = run as we are.

    Only root can switch users, so an unprivileged agent runs every pod as itself.

    >>> run_as_user({"securityContext": {"runAsUser": 7}}, {}) == ((7, 7) if os.geteuid() == 0
    ...                                                              else None)
    True
    """
    if os.geteuid() != 0:
        return None
    pod_ctx = pod_spec.get("securityContext") or {}
    ctx = container.get("securityContext") or {}
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
    if uid is None:
        return None
    gid = ctx.get("runAsGroup", pod_ctx.get("runAsGroup", uid))
    return int(uid), int(gid)


def image_repository(image: str) -> str:
    """The last path component of an image reference, without tag or digest: the key the
    node agent's image-to-environment map uses.

    >>> image_repository("ghcr.io/posttrain/rollout:0.1.0"), image_repository("busybox")
    ('rollout', 'busybox')
    >>> image_repository("localhost:5000/team/rollout@sha256:abc")
    'rollout'
    """
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def python_bin_dir_for(image: str, image_bin_dirs: Mapping[str, Path], default: Path) -> Path:
    """Which environment's ``bin/`` stands in for ``image``'s interpreter.

    An image has its own Python environment (the rollout image holds vLLM and its torch,
    the trainer image another torch); the agent has no images, so it maps an image's
    repository name to a local environment and falls back to ``default`` (the agent's own).

    >>> m = {"rollout": Path("/r/.venv-vllm/bin")}
    >>> str(python_bin_dir_for("ghcr.io/posttrain/rollout:0.1.0", m, Path("/r/.venv/bin")))
    '/r/.venv-vllm/bin'
    >>> str(python_bin_dir_for("ghcr.io/posttrain/posttrain:0.1.0", m, Path("/r/.venv/bin")))
    '/r/.venv/bin'
    """
    return image_bin_dirs.get(image_repository(image), default)


def resolve_executable(command: str, path: str, python_bin_dir: Path) -> str:
    """Map a container's ``command[0]`` to a host executable.

    ``posttrain``/``python``/``python3`` (bare or under /usr/bin, /usr/local/bin) run the
    project's venv, so pods execute the checked-out code; anything else is looked up on PATH.
    """
    base = os.path.basename(command)
    if base in INTERPRETER_COMMANDS and (command == base or command.startswith(("/usr/", "/bin/"))):
        candidate = python_bin_dir / base
        if candidate.exists():
            return str(candidate)
    if "/" in command:
        return command
    found = shutil.which(command, path=path)
    if found is None:
        raise PodSpecError(
            f"executable {command!r} not found on PATH {path}; install it on this "
            "host (the local agent runs commands on the host, not in the image)"
        )
    return found


def kill_process_group(process: subprocess.Popen[bytes] | None, grace_seconds: float) -> None:
    """SIGTERM the process's group, SIGKILL what is left of it after ``grace_seconds``, reap
    the leader.

    The group, not only its leader (bwrap): the container's command is pid 1 of its own pid
    namespace and outlives bwrap when it ignores SIGTERM (pid 1 without a handler does) and
    its parent-death signal was cleared by the switch to the pod's user; waiting for the
    leader alone left such processes running after their pod was gone.
    """
    if process is None:
        return
    pgid = process.pid
    for sig, wait_s in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, 5.0)):
        if sig == signal.SIGTERM and process.poll() is not None:
            continue  # the leader is gone: only leftovers, which get SIGKILL
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while True:
            process.poll()  # reap the leader, or the group never empties
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5.0)


def http_probe(probe: Manifest, container: Manifest, pod_ip: str) -> bool:
    """One httpGet probe against the pod IP; exec/tcp probes count as passing (not run here)."""
    get = probe.get("httpGet")
    if get is None:
        return True
    port = get.get("port")
    if isinstance(port, str) and not port.isdigit():
        named = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
        if port not in named:
            return False
        port = named[port]
    url = f"{get.get('scheme', 'HTTP').lower()}://{pod_ip}:{port}{get.get('path', '/')}"
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= int(response.status) < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_termination_message(
    termination_file: Path, log_path: Path, exit_code: int, policy: str
) -> str:
    """The container's termination message, or the log's tail under FallbackToLogsOnError."""
    message = termination_file.read_text(errors="replace") if termination_file.exists() else ""
    if not message and exit_code != 0 and policy == "FallbackToLogsOnError":
        lines = log_path.read_text(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
        message = "\n".join(lines)
    return message[-MAX_TERMINATION_MESSAGE:]


def pod_conditions(ready: bool) -> list[Manifest]:
    now = now_rfc3339()
    flag = "True" if ready else "False"
    return [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
        {"type": "Ready", "status": flag, "lastTransitionTime": now},
    ]


def _container_status(container: Manifest, ready: bool, state: Manifest) -> Manifest:
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": "running" in state,
        "state": state,
    }


def running_status(container: Manifest, started: str, ready: bool) -> Manifest:
    return _container_status(container, ready, {"running": {"startedAt": started}})


def waiting_status(container: Manifest, reason: str) -> Manifest:
    return _container_status(container, False, {"waiting": {"reason": reason}})


def terminated_status(container: Manifest, result: ContainerResult) -> Manifest:
    terminated = {
        "exitCode": result.exit_code,
        "reason": result.reason,
        "startedAt": result.started_at,
        "finishedAt": result.finished_at,
    }
    if result.message:
        terminated["message"] = result.message
    return _container_status(container, False, {"terminated": terminated})
