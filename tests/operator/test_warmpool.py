"""SandboxWarmPool without a cluster: pod builder, claim patch, pool decisions, and the
waiting entrypoint run as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from posttrain.api import SandboxTask, SandboxWarmPool
from posttrain.api.labels import (
    ANNOTATION_CLAIM,
    ANNOTATION_SPEC_HASH,
    LABEL_ATTEMPT,
    LABEL_WARM_POOL,
)
from posttrain.operator.config import OperatorConfig
from posttrain.operator.sandboxtask.builders import build_sandbox_pod
from posttrain.operator.sandboxtask.plan import plan_sandbox
from posttrain.operator.shared.views import PodView
from posttrain.operator.warmpool.builders import (
    ENTRYPOINT_SOURCE,
    build_claim_patch,
    build_warm_pod,
    claim_mismatch,
    pool_template,
    template_hash,
)
from posttrain.operator.warmpool.plan import plan_warm_pool

CONFIG = OperatorConfig()


def pool(replicas: int = 2, **spec: object) -> SandboxWarmPool:
    return SandboxWarmPool.model_validate(
        {
            "metadata": {"name": "py", "namespace": "ns", "uid": "pool-uid", "generation": 1},
            "spec": {"replicas": replicas, **spec},
        }
    )


def task(name: str = "t", **spec: object) -> SandboxTask:
    return SandboxTask.model_validate(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "generation": 1},
            "spec": {
                "command": ["python", "main.py"],
                "files": {"main.py": "print(1)"},
                "warmPoolRef": "py",
                **spec,
            },
        }
    )


HASH = template_hash(pool_template(pool(), CONFIG))


def idle(name: str, ready: bool = True, hash_: str = HASH, phase: str = "Running") -> PodView:
    return PodView(
        name, {LABEL_WARM_POOL: "py"}, {ANNOTATION_SPEC_HASH: hash_}, phase=phase, ready=ready
    )


def test_warm_pod_is_as_restricted_as_a_cold_pod() -> None:
    warm = build_warm_pod(pool(), CONFIG)
    cold = build_sandbox_pod(task(), CONFIG, 1)
    warm_c, cold_c = warm["spec"]["containers"][0], cold["spec"]["containers"][0]
    assert warm_c["securityContext"] == cold_c["securityContext"]
    assert warm_c["resources"] == cold_c["resources"]
    for key in (
        "securityContext",
        "automountServiceAccountToken",
        "enableServiceLinks",
        "restartPolicy",
    ):
        assert warm["spec"][key] == cold["spec"][key], key
    assert "activeDeadlineSeconds" not in warm["spec"]  # set by the claim
    meta = warm["metadata"]
    assert meta["generateName"] == "py-" and "name" not in meta
    assert meta["labels"][LABEL_WARM_POOL] == "py"
    assert meta["labels"]["posttrain.io/sandbox-network"] == "none"
    assert meta["ownerReferences"][0]["kind"] == "SandboxWarmPool"
    item = warm["spec"]["volumes"][1]["downwardAPI"]["items"][0]
    assert item["fieldRef"]["fieldPath"] == f"metadata.annotations['{ANNOTATION_CLAIM}']"


def test_claim_mismatch_names_every_difference() -> None:
    assert claim_mismatch(task(), pool(), CONFIG) == ""
    why = claim_mismatch(task(image="node:22", resources={"cpu": "2"}), pool(), CONFIG)
    assert "image 'node:22' != 'ghcr.io/posttrain/sandbox:0.1.0'" in why and "cpu '2' != '1'" in why
    assert "egress" in claim_mismatch(task(network="egress"), pool(), CONFIG)
    assert "cold pod" in claim_mismatch(task(snapshot=True), pool(), CONFIG)


def test_claim_patch_is_conditional_and_moves_ownership() -> None:
    now = datetime(2026, 1, 1, 0, 1, 0, tzinfo=UTC)
    pod = {
        "metadata": {"name": "py-abc", "resourceVersion": "42"},
        "status": {"startTime": (now - timedelta(seconds=30.5)).isoformat()},
    }
    patch = build_claim_patch(task(stdin="in", timeoutSeconds=10), pod, now)
    meta = patch["metadata"]
    assert meta["resourceVersion"] == "42"  # the atomicity: 409 if the pod changed
    assert meta["labels"] == {"posttrain.io/task": "t", LABEL_ATTEMPT: "1"}
    assert [o["uid"] for o in meta["ownerReferences"]] == ["uid-t"]
    assert json.loads(meta["annotations"][ANNOTATION_CLAIM]) == {
        "task": "t",
        "command": ["python", "main.py"],
        "files": {"main.py": "print(1)"},
        "stdin": "in",
    }
    # The deadline counts from the pod's start: its age (rounded up) + the task's timeout.
    assert patch["spec"]["activeDeadlineSeconds"] == 31 + 10


def test_plan_fills_replaces_and_scales_down() -> None:
    assert plan_warm_pool(pool(3), [], HASH).create == 3
    # An idle pod that ended unclaimed and one from an old template are replaced.
    plan = plan_warm_pool(
        pool(2), [idle("a"), idle("b", phase="Failed"), idle("c", hash_="old")], HASH
    )
    assert sorted(plan.delete_pods) == ["b", "c"] and plan.create == 1
    # Scale-down: not-ready pods go first; a pod being claimed is never deleted.
    pods = [idle("a"), idle("b", ready=False), idle("c"), idle("d")]
    plan = plan_warm_pool(pool(1), pods, HASH, reserved=frozenset({"a"}))
    assert plan.delete_pods[0] == "b" and "a" not in plan.delete_pods
    assert len(plan.delete_pods) == 3 and plan.create == 0


def test_plan_status_counts_idle_ready_and_claimed() -> None:
    claimed = PodView(
        "x",
        {LABEL_WARM_POOL: "py", "posttrain.io/task": "t"},
        {ANNOTATION_SPEC_HASH: HASH},
        phase="Running",
        ready=True,
    )
    plan = plan_warm_pool(pool(2), [idle("a"), idle("b", ready=False), claimed], HASH)
    status = plan.status_patch
    assert (status["replicas"], status["readyReplicas"], status["claimed"]) == (2, 1, 1)
    ready = status["conditions"][0]
    assert (ready["status"], ready["reason"]) == ("False", "IdlePodsStarting")
    assert plan.create == 0


def test_plan_sandbox_follows_a_claimed_pod_by_its_attempt_label() -> None:
    claimed = PodView(
        "py-abc", {"posttrain.io/task": "t", LABEL_ATTEMPT: "1"}, phase="Running", ready=True
    )
    plan = plan_sandbox(task(), [claimed], datetime.now(UTC))
    assert plan.create_attempt is None
    assert plan.status_patch["phase"] == "Running"
    assert plan.status_patch["podName"] == "py-abc"


def start_entrypoint(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    claim = tmp_path / "claim"
    claim.write_text("")  # the kubelet projects an absent annotation as an empty file
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRYPOINT_SOURCE],
        text=True,
        stdout=subprocess.PIPE,
        env={
            "POSTTRAIN_CLAIM_FILE": str(claim),
            "POSTTRAIN_WORKDIR": str(workdir),
            "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin",
        },
    )
    return proc, claim


def test_entrypoint_waits_for_its_claim_then_becomes_the_program(tmp_path: Path) -> None:
    proc, claim = start_entrypoint(tmp_path)
    time.sleep(0.5)
    assert proc.poll() is None  # idle: waiting for a claim
    program = "import sys; print(sys.stdin.read()[::-1], open('lib/x.txt').read()); sys.exit(3)"
    claim.write_text(
        json.dumps(
            {
                "task": "t",
                "command": ["python3", "main.py"],
                "files": {"main.py": program, "lib/x.txt": "file"},
                "stdin": "abc",
            }
        )
    )
    out, _ = proc.communicate(timeout=10)
    assert out.split() == ["cba", "file"]
    assert proc.returncode == 3  # the program's own exit code


def test_entrypoint_refuses_paths_outside_the_workdir(tmp_path: Path) -> None:
    proc, claim = start_entrypoint(tmp_path)
    claim.write_text(json.dumps({"command": ["true"], "files": {"../escape": "x"}}))
    proc.communicate(timeout=10)
    assert proc.returncode != 0
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("bad", [{"replicas": -1}, {"network": "host"}, {"image": ""}])
def test_pool_spec_validation(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        pool(**{"replicas": 1, **bad})


def test_log_upload_needs_a_cold_pod() -> None:
    config = OperatorConfig(sandbox_artifacts_uri="s3://bucket/sandboxes")
    assert "cold pod" in claim_mismatch(task(), pool(), config)
