"""Can the real node run on this machine? What ``posttrain dev up`` checks before starting it.

The real node needs root (its containers need mounts, cgroups, iptables rules and a network
bridge), the Debian packages ``make system-deps`` installs (containerd, runc, the CNI plugins,
iptables, and podman, whose store holds the images), and the images ``make images`` builds.
:func:`missing_for_real_node` names each missing piece with what provides it, so that ``dev
up`` can refuse with exactly what to do instead of failing halfway through a start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from .cluster import minio_image, podman_env
from .containerd import PAUSE_IMAGE
from .network import CNI_BIN_DIR

COMMANDS = ("containerd", "ctr", "runc", "iptables", "ip", "podman")


@dataclass(frozen=True)
class Missing:
    """One thing the real node needs and this machine lacks, and what provides it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


def missing_for_real_node(images: Sequence[str]) -> list[Missing]:
    """What keeps the real node with ``images`` (image references) from starting here; []
    when nothing does."""
    missing = []
    if os.geteuid() != 0:
        missing.append(Missing(
            "root", "the node's containers need mounts, cgroups, iptables rules and a network "
            "bridge: run it in a root shell",
        ))  # fmt: skip
    commands = [name for name in COMMANDS if shutil.which(name) is None]
    if commands:
        missing.append(Missing(
            f"command {', '.join(commands)}",
            "`make system-deps` installs them (Debian packages containerd, runc, iptables, "
            "iproute2, podman)",
        ))  # fmt: skip
    if not (CNI_BIN_DIR / "bridge").exists():
        missing.append(Missing(
            f"the CNI plugins ({CNI_BIN_DIR / 'bridge'})",
            "`make system-deps` installs them (Debian package containernetworking-plugins)",
        ))  # fmt: skip
    if "podman" in commands:
        return missing  # the images are in podman's store: they cannot be looked up yet
    built = built_images()
    absent = [ref for ref in [PAUSE_IMAGE, minio_image(), *images] if ref not in built]
    if absent:
        missing.append(Missing(f"image {', '.join(absent)}", "`make images` builds them"))
    return missing


def built_images() -> set[str]:
    """``repository:tag`` of every image in podman's store (where ``make images`` puts them)."""
    listed = subprocess.run(
        ["podman", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
        env=podman_env(), capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return set(listed.stdout.split()) if listed.returncode == 0 else set()
