"""Run one container of a pod manifest in podman, as a kubelet would start it.

The image smoke tests take the exact pod specs the operator's builders (and the chart) write and
start their containers from the built images: the same command and arguments (with Kubernetes'
``$(VAR)`` expansion), environment, user, read-only root file system, dropped capabilities,
seccomp and ``/proc`` settings, and emptyDir/ConfigMap volumes. What only a cluster provides
(Services, DNS, probes, scheduling) is not modelled here: tests/e2e on the real node covers it.
Every container shares the host's network namespace, so servers are reached on loopback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.devenv.realnode.cluster import IMAGE_NAMES, image_ref, podman_env

__all__ = ["IMAGE_NAMES", "image_ref", "podman_env"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["podman", *args],
        env=podman_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def missing_images() -> list[str]:
    """The images `make images` has not built (or every one, without podman)."""
    if shutil.which("podman") is None:
        return list(IMAGE_NAMES)
    return [
        name
        for name in IMAGE_NAMES
        if podman("image", "exists", image_ref(name), check=False).returncode != 0
    ]


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values.

    >>> expand("--host=$(POD_IP) $(MISSING)", {"POD_IP": "127.0.0.1"})
    '--host=127.0.0.1 $(MISSING)'
    """
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


@dataclass
class PodContainer:
    """One container of a pod spec, translated to ``podman run`` arguments.

    ``field_refs`` answers ``valueFrom.fieldRef`` (e.g. ``status.podIP``); ``secrets`` maps
    ``(secret, key)`` to the values ``secretKeyRef`` would read; ``config_maps`` maps a
    ConfigMap name to its data. emptyDir volumes become fresh host directories (memory-backed
    ones a tmpfs), owned by the pod's fsGroup or user so a non-root container can write them.
    """

    pod_spec: Mapping[str, Any]
    container_name: str
    field_refs: Mapping[str, str] = field(default_factory=dict)
    secrets: Mapping[tuple[str, str], str] = field(default_factory=dict)
    config_maps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    extra_env: Mapping[str, str] = field(default_factory=dict)
    volume_dirs: dict[str, Path] = field(default_factory=dict)
    kubeconfig: Path | None = None
    """Stands in for the ServiceAccount token a pod gets: mounted read-only, $KUBECONFIG."""
    name: str = field(default_factory=lambda: f"posttrain-smoke-{uuid.uuid4().hex[:10]}")

    @property
    def container(self) -> Mapping[str, Any]:
        containers = [*self.pod_spec.get("initContainers", []), *self.pod_spec["containers"]]
        for container in containers:
            if container["name"] == self.container_name:
                return container
        raise KeyError(f"no container {self.container_name!r} in the pod spec")

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in self.container.get("envFrom", []):
            env.update(self.config_maps[source["configMapRef"]["name"]])
        for item in self.container.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(str(item["value"]), env)
                continue
            source = item["valueFrom"]
            if "fieldRef" in source:
                env[item["name"]] = self.field_refs[source["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                if (ref["name"], ref["key"]) not in self.secrets and ref.get("optional"):
                    continue  # as the kubelet does: an optional key that is absent is unset
                env[item["name"]] = self.secrets[(ref["name"], ref["key"])]
            else:
                raise NotImplementedError(f"env {item['name']}: {source}")
        env.update(self.extra_env)
        return env

    def security_args(self) -> list[str]:
        pod_context = self.pod_spec.get("securityContext", {})
        context = {**pod_context, **self.container.get("securityContext", {})}
        args: list[str] = []
        if "runAsUser" in context:
            args += ["--user", f"{context['runAsUser']}:{context.get('runAsGroup', 0)}"]
        if "fsGroup" in pod_context:
            args += ["--group-add", str(pod_context["fsGroup"])]
        if context.get("readOnlyRootFilesystem"):
            args.append("--read-only")
        for cap in context.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        if context.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        seccomp = context.get("seccompProfile", {}).get("type")
        if seccomp == "Unconfined":
            args += ["--security-opt", "seccomp=unconfined"]
        if context.get("procMount") == "Unmasked":
            args += ["--security-opt", "unmask=ALL"]
        return args

    def _owner(self) -> int | None:
        pod_context = self.pod_spec.get("securityContext", {})
        uid = self.container.get("securityContext", {}).get("runAsUser")
        return pod_context.get("fsGroup", uid if uid is not None else pod_context.get("runAsUser"))

    def volume_args(self, workdir: Path) -> list[str]:
        volumes = {v["name"]: v for v in self.pod_spec.get("volumes", [])}
        args: list[str] = []
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            read_only = ":ro" if mount.get("readOnly") else ""
            if "emptyDir" in volume and volume["emptyDir"].get("medium") == "Memory":
                # As the kubelet sizes it: sizeLimit, else the container's memory limit.
                limits = self.container.get("resources", {}).get("limits", {})
                size = volume["emptyDir"].get("sizeLimit") or limits.get("memory", "1Gi")
                size = size.replace("Gi", "g").replace("Mi", "m")
                if mount["mountPath"] == "/dev/shm":  # podman mounts its own there (64 MB)
                    args += ["--shm-size", size]
                else:
                    args += ["--tmpfs", f"{mount['mountPath']}:rw,mode=1777,size={size}"]
                continue
            host = self.volume_dirs.get(mount["name"])
            if host is None:
                host = Path(tempfile.mkdtemp(prefix=f"{mount['name']}-", dir=workdir))
                if "configMap" in volume:
                    for key, text in self.config_maps[volume["configMap"]["name"]].items():
                        (host / key).write_text(text)
                elif "secret" in volume:
                    secret = volume["secret"]
                    for item in secret["items"]:
                        value = self.secrets[(secret["secretName"], item["key"])]
                        (host / item["path"]).write_text(value)
                elif "emptyDir" not in volume:
                    raise NotImplementedError(f"volume {mount['name']}: {volume}")
                owner = self._owner()
                host.chmod(0o777 if owner is None else 0o775)
                if owner is not None:
                    os.chown(host, owner, owner)
                self.volume_dirs[mount["name"]] = host
            args += ["--volume", f"{host}:{mount['mountPath']}{read_only}"]
        return args

    def run_args(self, image: str, workdir: Path) -> list[str]:
        """``podman run`` arguments: entrypoint and args as Kubernetes combines them."""
        env = self.environment()
        command = [expand(part, env) for part in self.container.get("command", [])]
        arguments = [expand(part, env) for part in self.container.get("args", [])]
        args = ["run", "--name", self.name, "--network", "host", "--pull", "never"]
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        args += self.security_args() + self.volume_args(workdir)
        if self.kubeconfig is not None:
            copy = Path(tempfile.mkdtemp(prefix="kube-", dir=workdir))
            (copy / "config").write_text(self.kubeconfig.read_text())
            copy.chmod(0o755)
            (copy / "config").chmod(0o644)
            args += ["--volume", f"{copy}:/var/run/posttrain-kube:ro",
                     "--env", "KUBECONFIG=/var/run/posttrain-kube/config"]  # fmt: skip
        if command:
            # podman's --entrypoint takes a JSON array for a multi-word command.
            args += ["--entrypoint", json.dumps(command)]
        return [*args, image, *arguments]


@dataclass
class RunningContainer:
    """A detached container: ``logs()`` while it runs, ``stop()`` removes it."""

    name: str

    def logs(self) -> str:
        result = podman("logs", self.name, check=False)
        return result.stdout + result.stderr

    def exit_code(self) -> int | None:
        state = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.name)
        status, code = state.stdout.split()
        return int(code) if status in {"exited", "stopped"} else None

    def stop(self) -> None:
        podman("rm", "--force", "--time", "5", self.name, check=False, timeout=60)


def run_to_completion(
    spec: PodContainer, image: str, workdir: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run the container in the foreground and remove it afterwards."""
    args = spec.run_args(image, workdir)
    try:
        return podman(args[0], "--rm", *args[1:], timeout=timeout, check=False)
    finally:
        podman("rm", "--force", spec.name, check=False)


def start(spec: PodContainer, image: str, workdir: Path) -> RunningContainer:
    args = spec.run_args(image, workdir)
    podman(args[0], "--detach", *args[1:])
    return RunningContainer(spec.name)


def run_simple(
    image: str, args: Sequence[str], *, extra: Sequence[str] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``podman run --rm [extra] IMAGE ARGS`` with the image's own entrypoint."""
    return podman(
        "run",
        "--rm",
        "--network",
        "host",
        "--pull",
        "never",
        *extra,
        image,
        *args,
        timeout=timeout,
        check=False,
    )
