"""containerd (Debian's 1.6) with runc for the real node, on a private configuration.

Everything lives under the node's directories: its socket and state in the run's work dir, its
content store under ``~/.cache/posttrain/containerd`` (images stay imported across
``dev up``s). Settings this machine needs, each verified by a failing pod without it:

* ``restrict_oom_score_adj = true``: a pod sandbox asks for oom_score_adj -998, which root here
  may not set (no CAP_SYS_RESOURCE); without it every sandbox fails with "can't get final
  child's PID from pipe: EOF".
* ``disable_apparmor``: no AppArmor on these hosts; ``netns_mounts_under_state_dir``: pod
  network namespaces are mounted under the private state dir, not ``/var/run/netns``.
* runc v2 with ``SystemdCgroup = false`` (cgroupfs, like the kubelet) and its own root.
* ``sandbox_image``: the pause image cannot be pulled; ``localhost/posttrain/pause`` (the local
  base with ``sleep infinity``) holds each pod's namespaces.

Images come from podman's store (``make images``) with ``podman save | ctr images import``,
skipped when the same image ID was imported before. A rebuilt image leaves its predecessor
behind: the CRI plugin names every image it sees also by its ID (``sha256:...``), and that
name keeps the old layers (several GB) after the tag moves. :meth:`Containerd.prune` removes
such names, and posttrain tags other than the current ones, then lets containerd's garbage
collector free their content and snapshots.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.processes import ManagedProcess

log = logging.getLogger(__name__)

NAMESPACE = "k8s.io"  # the CRI plugin's containerd namespace
PAUSE_IMAGE = "localhost/posttrain/pause:1"


def config_toml(
    *, root: Path, state: Path, socket: Path, runc_root: Path, cni_conf_dir: Path, cni_bin_dir: Path
) -> str:
    """containerd's config (version 2) for the CRI plugin.

    >>> text = config_toml(root=Path("/r"), state=Path("/s"), socket=Path("/s/c.sock"),
    ...                    runc_root=Path("/s/runc"), cni_conf_dir=Path("/n"),
    ...                    cni_bin_dir=Path("/usr/lib/cni"))
    >>> "restrict_oom_score_adj = true" in text and 'address = "/s/c.sock"' in text
    True
    """
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"
oom_score = 0

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[metrics]
  address = ""

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  netns_mounts_under_state_dir = true
  enable_selinux = false
  max_container_log_line_size = 16384

[{cri}.containerd]
  default_runtime_name = "runc"
  snapshotter = "overlayfs"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
  Root = "{runc_root}"

[{cri}.cni]
  bin_dir = "{cni_bin_dir}"
  conf_dir = "{cni_conf_dir}"
  max_conf_num = 1

[plugins."io.containerd.internal.v1.opt"]
  path = "{state}/opt"
"""


@dataclass
class Containerd:
    """One containerd process and the ``ctr`` calls the node needs."""

    workdir: Path
    content_root: Path
    cni_conf_dir: Path
    cni_bin_dir: Path
    process: ManagedProcess | None = None
    _imported_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self._imported_dir = self.content_root / "imported"

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def ctr(
        self, *args: str, timeout: float = 60, **kwargs: object
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, *args],
            capture_output=True, text=True, timeout=timeout, **kwargs,  # type: ignore[call-overload]
        )  # fmt: skip

    def start(self, timeout_s: float = 60.0) -> None:
        state = self.workdir / "state"
        for path in (self.workdir, state, self.content_root / "root"):
            path.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.toml"
        config.write_text(
            config_toml(
                root=self.content_root / "root",
                state=state,
                socket=self.socket,
                runc_root=self.workdir / "runc",
                cni_conf_dir=self.cni_conf_dir,
                cni_bin_dir=self.cni_bin_dir,
            )
        )
        self.process = ManagedProcess(
            name="containerd",
            command=["containerd", "--config", str(config)],
            log_path=self.workdir / "containerd.log",
            ready=lambda: self.socket.exists() and self.ctr("version").returncode == 0,
        )
        self.process.start(timeout_s)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def images(self) -> dict[str, str]:
        """Every image name in the CRI namespace, with the digest it points to."""
        lines = self.ctr("images", "ls").stdout.splitlines()[1:]
        return {cols[0]: cols[2] for line in lines if len(cols := line.split()) >= 3}

    def remove_image(self, ref: str) -> list[str]:
        """Remove ``ref`` and the CRI plugin's ID name of the same image, waiting for the
        garbage collector to free its content and snapshots (the rollout image's 7 GB, say,
        once the one test that runs it is done); the removed names."""
        images = self.images()
        digest = images.get(ref)
        if digest is None:
            return []
        names = [name for name, d in images.items()
                 if d == digest and (name == ref or name.startswith("sha256:"))]  # fmt: skip
        result = self.ctr("images", "rm", "--sync", *names, timeout=600)
        if result.returncode != 0:
            log.warning("real node: removing %s failed: %s", names, result.stderr[-500:])
        return names

    def prune(self, keep: Sequence[str], prefixes: Sequence[str]) -> list[str]:
        """Remove names under ``prefixes`` that are not in ``keep`` (an older tag), and ID
        names (``sha256:...``) whose image no other name points to any more (a rebuilt
        image's predecessor); the last removal waits for the garbage collector. Returns the
        removed names.

        Only names are removed: an image still running in a pod keeps its content (the
        CRI plugin holds leases on what containers use).
        """
        images = self.images()
        stale = [ref for ref in images
                 if ref.startswith(tuple(prefixes)) and ref not in keep]  # fmt: skip
        named = {digest for ref, digest in images.items()
                 if not ref.startswith("sha256:") and ref not in stale}  # fmt: skip
        stale += [ref for ref, digest in images.items()
                  if ref.startswith("sha256:") and digest not in named]  # fmt: skip
        if stale:
            log.info("real node: removing %d superseded image name(s): %s", len(stale), stale)
            result = self.ctr("images", "rm", "--sync", *stale, timeout=600)
            if result.returncode != 0:
                log.warning("real node: removing old images failed: %s", result.stderr[-500:])
        return stale

    def has_image(self, ref: str) -> bool:
        return ref in self.ctr("images", "ls", "-q").stdout.split()

    def import_from_podman(self, ref: str, podman_env: dict[str, str]) -> float:
        """Import ``ref`` from podman's store unless this image ID is already in; seconds."""
        image_id = subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Id}}", ref],
            capture_output=True, text=True, check=True, env=podman_env,
        ).stdout.strip()  # fmt: skip
        stamp = self._imported_dir / ref.replace("/", "_").replace(":", "_")
        if self.has_image(ref) and stamp.exists() and stamp.read_text() == image_id:
            return 0.0
        started = time.monotonic()
        log.info("real node: importing %s into containerd (podman save | ctr import)...", ref)
        # podman writes an OCI archive only to a file (not a pipe); it is deleted at once.
        archive = self.content_root / f".import-{os.getpid()}.tar"
        try:
            subprocess.run(
                ["podman", "save", "--quiet", "--format", "oci-archive", "-o", str(archive), ref],
                capture_output=True, text=True, check=True, env=podman_env, timeout=1800,
            )  # fmt: skip
            result = self.ctr("images", "import", str(archive), timeout=1800)
            if result.returncode != 0 and snapshot_vanished(result.stderr):
                # Seen once after another session's prune: the unpack found a layer's
                # snapshot that containerd's garbage collector then removed. The second
                # import unpacks it again.
                log.warning("real node: importing %s failed (%s); once more", ref,
                            result.stderr.strip()[-300:])  # fmt: skip
                result = self.ctr("images", "import", str(archive), timeout=1800)
        finally:
            archive.unlink(missing_ok=True)
        if result.returncode != 0:
            raise RuntimeError(f"importing {ref} into containerd failed: {result.stderr[-2000:]}")
        if not self.has_image(ref):
            raise RuntimeError(f"ctr import of {ref} did not register it: {result.stdout[-500:]}")
        self._imported_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(image_id)
        return time.monotonic() - started


def snapshot_vanished(stderr: str) -> bool:
    """Whether ``ctr images import`` failed on a layer snapshot that containerd's garbage
    collector removed during the unpack (worth one more import), as seen on 2026-12-06.

    >>> snapshot_vanished('ctr: failed to unpack: apply layer error: parent snapshot '
    ...                   'sha256:9f1e... does not exist: not found')
    True
    >>> snapshot_vanished("ctr: content digest sha256:ab...: not found")
    False
    """
    return "snapshot" in stderr and "does not exist" in stderr
