"""Persistent volumes for the real node: a default StorageClass backed by local directories.

A chart that asks for a PersistentVolumeClaim (the bundled MinIO of ``charts/posttrain``)
stays Pending on a cluster with no default StorageClass. kind and k3d ship one (Rancher's
local-path provisioner, which starts a helper pod per volume); this node has no image
registry to pull that helper from, so it pre-creates a few ``local`` PersistentVolumes
instead, each a directory under the node's work dir, behind a default StorageClass
``standard`` (kind's name) with ``WaitForFirstConsumer`` binding. ``local`` rather than
``hostPath`` because the kubelet applies a pod's ``fsGroup`` to a local volume, so a
non-root container (MinIO as uid 1000) can write to it.

There is no provisioner behind the class, so nothing empties a volume when its claim goes.
At every start, a volume whose claim was deleted (``Released``) has its directory emptied and
its old claim reference dropped, so it is ``Available`` again: the reclaim policy ``Delete`` of
kind's default class, applied one ``dev up`` later.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from . import components

log = logging.getLogger(__name__)

STORAGE_CLASS = "standard"
VOLUME_COUNT = 4
VOLUME_SIZE = "50Gi"
"""Advertised capacity: a claim of up to this binds. Local volumes do not enforce a size;
what is really there is the node's free disk."""


def storage_class() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Retain",
    }


def persistent_volume(index: int, path: Path) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"local-{index}", "labels": {"posttrain.io/local-volume": "true"}},
        "spec": {
            "capacity": {"storage": VOLUME_SIZE},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "local": {"path": str(path)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": [components.NODE_NAME],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


def provide(api: Any, root: Path, count: int = VOLUME_COUNT) -> list[str]:
    """Create the StorageClass and ``count`` volumes under ``root`` where missing; recycle the
    released ones. Returns the names of the volumes that are ``Available`` now."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    storage: Any = client.StorageV1Api(api)
    core: Any = client.CoreV1Api(api)
    try:
        storage.create_storage_class(storage_class())
    except ApiException as error:
        if error.status != 409:
            raise
    available = []
    for index in range(count):
        path = root / f"local-{index}"
        name = f"local-{index}"
        try:
            volume = core.read_persistent_volume(name)
        except ApiException as error:
            if error.status != 404:
                raise
            volume = None
        path.mkdir(parents=True, exist_ok=True)
        if volume is None:
            core.create_persistent_volume(persistent_volume(index, path))
            available.append(name)
        elif volume.status.phase == "Released":
            # Retain's manual recycling: empty the directory, then drop the old claim's
            # reference; the PV controller makes the volume Available again.
            log.info("real node: recycling %s (its claim was deleted): emptying %s", name, path)
            shutil.rmtree(path)
            path.mkdir()
            core.patch_persistent_volume(name, {"spec": {"claimRef": None}})
            available.append(name)
        elif volume.status.phase == "Available":
            available.append(name)
    return available
