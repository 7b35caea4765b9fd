"""``spec.model: pvc://CLAIM/PATH`` on the real apiserver: the operator mounts the claim
read-only in every pod that loads the model (trainer, evaluator Job, rollout replicas and
their fetch-model step), the apiserver accepts those pods, ``posttrain.models`` reads the
model where the claim is mounted, and a malformed reference is a spec error naming it.

The dev node agent mounts no PVCs (docs/e2e.md), so no pod here runs with the claim: what
is checked is what a kubelet would be given, and the resolver on a directory laid out as
the mount would be.
"""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from posttrain.operator.kube import KubeClient
from posttrain.operator.runtime import OperatorThread

from .conftest import create_cr, get_cr, run_body, wait_for

CLAIM_VOLUME = {
    "name": "model-pvc",
    "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
}
# Deadlines, not delays: the operator answers in well under a second when the machine is idle.
WAIT_S = 300
CLAIM_MOUNT = {"name": "model-pvc", "mountPath": "/mnt/pvc/models", "readOnly": True}


@pytest.mark.cluster
def test_trainer_pod_and_evaluator_job_mount_the_claim_read_only(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube,
        "trainingruns",
        namespace,
        run_body(
            "pv",
            model="pvc://models/smollm2/v1",
            evaluation={"inline": False},  # the evaluator Job scores the base model too
        ),
    )
    pod = wait_for(
        lambda: kube.get("v1", "Pod", namespace, "pv-g0-0"), what="trainer pod", timeout_s=WAIT_S
    )
    assert CLAIM_VOLUME in pod["spec"]["volumes"]
    assert CLAIM_MOUNT in pod["spec"]["containers"][0]["volumeMounts"]
    job = wait_for(
        lambda: kube.get("batch/v1", "Job", namespace, "pv-evaluator"),
        what="evaluator Job",
        timeout_s=WAIT_S,
    )
    template = job["spec"]["template"]["spec"]
    assert CLAIM_VOLUME in template["volumes"]
    assert CLAIM_MOUNT in template["containers"][0]["volumeMounts"]


@pytest.mark.cluster
def test_vllm_pool_mounts_the_claim_in_fetch_model_and_the_server(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(
        kube,
        "rolloutpools",
        namespace,
        {
            "kind": "RolloutPool",
            "metadata": {"name": "pv"},
            "spec": {"model": "pvc://models/smollm2/v1", "engine": "vllm", "replicas": 1},
        },
    )
    dep = wait_for(
        lambda: kube.get("apps/v1", "Deployment", namespace, "pv"),
        what="Deployment",
        timeout_s=WAIT_S,
    )
    spec = dep["spec"]["template"]["spec"]
    assert CLAIM_VOLUME in spec["volumes"]
    (fetch,) = spec["initContainers"]
    assert "pvc://models/smollm2/v1" in fetch["command"]
    # fetch-model links /models/current into the claim; the server follows that link.
    assert CLAIM_MOUNT in fetch["volumeMounts"]
    assert CLAIM_MOUNT in spec["containers"][0]["volumeMounts"]


@pytest.mark.cluster
def test_a_malformed_claim_reference_fails_the_run_naming_it(
    operator: OperatorThread, kube: KubeClient, namespace: str
) -> None:
    create_cr(kube, "trainingruns", namespace, run_body("bad", model="pvc://Models_X/m"))

    def failed() -> dict[str, Any] | None:
        status = (get_cr(kube, "trainingruns", namespace, "bad") or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    status = wait_for(failed, what="run Failed", timeout_s=WAIT_S)
    (condition,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert condition["reason"] == "InvalidSpec"
    assert "pvc://Models_X/m" in condition["message"]
    assert "PersistentVolumeClaim name" in condition["message"]
    assert kube.get("v1", "Pod", namespace, "bad-g0-0") is None


def test_resolve_model_reads_the_model_where_the_claim_is_mounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from posttrain.api import modelref
    from posttrain.errors import UsageError
    from posttrain.models import resolve_model

    monkeypatch.setattr(modelref, "PVC_MOUNT_ROOT", str(tmp_path))  # the pod's /mnt/pvc
    model = tmp_path / "models" / "smollm2" / "v1"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    assert resolve_model("pvc://models/smollm2/v1") == model.resolve()

    with pytest.raises(UsageError, match=r"not here.*PersistentVolumeClaim other"):
        resolve_model("pvc://other/m")
    (tmp_path / "models" / "empty").mkdir()
    with pytest.raises(UsageError, match=r"no config\.json"):
        resolve_model("pvc://models/empty")
    with pytest.raises(UsageError, match=re.escape("may not contain '..'")):
        resolve_model("pvc://models/../x")


def test_the_api_models_reject_a_malformed_claim_reference() -> None:
    from pydantic import ValidationError

    from posttrain.api import RolloutPoolSpec, TrainingRunSpec

    domains = [{"name": "a", "dataset": "builtin:arithmetic", "verifier": {"kind": "numeric"}}]
    for bad in ("pvc://", "pvc://UPPER/m", "pvc://ok/a/../b"):
        with pytest.raises(ValidationError, match="pvc://"):
            TrainingRunSpec.model_validate({"model": bad, "domains": domains})
        with pytest.raises(ValidationError, match="pvc://"):
            RolloutPoolSpec.model_validate({"model": bad})
    assert RolloutPoolSpec.model_validate({"model": "pvc://models"}).model == "pvc://models"


@pytest.mark.parametrize("module", ["posttrain.api.modelref", "posttrain.models"])
def test_docstring_examples_hold(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0
