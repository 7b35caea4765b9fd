"""The real node's local volumes (posttrain.devenv.realnode.volumes) against a real apiserver:
the default StorageClass and the volumes are created once, and a volume whose claim was
deleted is emptied and offered again at the next start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from posttrain.devenv.realnode import volumes

pytestmark = pytest.mark.cluster


def test_volumes_are_created_once_and_a_released_one_is_emptied_and_recreated(
    kube_api: Any, tmp_path: Path
) -> None:
    from kubernetes import client

    core: Any = client.CoreV1Api(kube_api)
    storage: Any = client.StorageV1Api(kube_api)
    try:
        assert volumes.provide(kube_api, tmp_path, count=2) == ["local-0", "local-1"]
        default = storage.read_storage_class(volumes.STORAGE_CLASS)
        assert default.metadata.annotations["storageclass.kubernetes.io/is-default-class"] == "true"
        first = core.read_persistent_volume("local-0")
        assert first.spec.local.path == str(tmp_path / "local-0")
        # A second start changes nothing (no controller marks them Available here).
        volumes.provide(kube_api, tmp_path, count=2)
        assert core.read_persistent_volume("local-0").metadata.uid == first.metadata.uid
        # local-0's claim went: the PV controller would mark it Released.
        (tmp_path / "local-0" / "old-object").write_text("data of the deleted claim")
        claim = {"kind": "PersistentVolumeClaim", "namespace": "gone", "name": "data"}
        core.patch_persistent_volume("local-0", {"spec": {"claimRef": claim}})
        core.patch_persistent_volume_status("local-0", {"status": {"phase": "Released"}})
        assert "local-0" in volumes.provide(kube_api, tmp_path, count=2)
        again = core.read_persistent_volume("local-0")
        assert again.metadata.uid == first.metadata.uid and again.spec.claim_ref is None
        assert list((tmp_path / "local-0").iterdir()) == []
        assert (tmp_path / "local-1").is_dir()
    finally:
        for name in ("local-0", "local-1"):
            # No pv-protection controller here to lift the finalizer.
            core.patch_persistent_volume(name, {"metadata": {"finalizers": None}})
            core.delete_persistent_volume(name)
        storage.delete_storage_class(volumes.STORAGE_CLASS)
