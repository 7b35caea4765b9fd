"""Invalid manifests are rejected by the REAL kube-apiserver (generated CRD schemas and
CEL rules) and by the same pydantic models locally, both naming the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.api import parse_resource
from posttrain.errors import UsageError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def run_with(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(example("arith-code-run.yaml"))
    mutate(doc["spec"])
    return doc


def task_with(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(example("sandbox-task.yaml"))
    mutate(doc["spec"])
    return doc


def pool_with(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(example("rollout-pool.yaml"))
    mutate(doc["spec"])
    return doc


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        node: Any = spec
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(leaf) if leaf.isdigit() else leaf] = value

    return mutate


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda spec: spec.pop(key)


def _duplicate_domain(spec: dict[str, Any]) -> None:
    spec["domains"].append(copy.deepcopy(spec["domains"][0]))


def _zero_weights(spec: dict[str, Any]) -> None:
    for domain in spec["domains"]:
        domain["weight"] = 0


def _no_command_no_files(spec: dict[str, Any]) -> None:
    spec.pop("command")
    spec.pop("files")


# (id, manifest, what the apiserver says, what the local models say)
JUDGE = {"url": "http://judge:8000/v1", "rubric": "Grade {answer}"}

CASES: list[tuple[str, dict[str, Any], list[str], list[str]]] = [
    (
        "judge-kind-without-judge",
        run_with(_set("domains.0.verifier", {"kind": "judge"})),
        ["spec.domains[0].verifier.judge", "judge is required for kind judge"],
        ["domains[0].verifier", "judge is required for kind judge"],
    ),
    (
        "judge-with-pool-and-url",
        run_with(_set("domains.0.verifier", {"kind": "judge", "judge": {**JUDGE, "pool": "p"}})),
        ["spec.domains[0].verifier.judge", "set exactly one of pool and url"],
        ["domains[0].verifier.judge", "set exactly one of pool and url"],
    ),
    (
        "judge-secret-without-env",
        run_with(
            _set(
                "domains.0.verifier",
                {"kind": "judge", "judge": {**JUDGE, "apiKeySecret": {"name": "s", "key": "k"}}},
            )
        ),
        ["spec.domains[0].verifier.judge.apiKeyEnv", "apiKeySecret needs apiKeyEnv"],
        ["domains[0].verifier.judge", "apiKeySecret needs apiKeyEnv"],
    ),
    (
        "reward-model-on-numeric",
        run_with(_set("domains.0.verifier.rewardModel", {"url": "http://rm:8000/v1"})),
        ["spec.domains[0].verifier.rewardModel", "rewardModel is required for kind reward_model"],
        ["domains[0].verifier", "rewardModel is required for kind reward_model"],
    ),
    (
        "negative-weight",
        run_with(_set("domains.0.weight", -1)),
        ["spec.domains[0].weight", "greater than or equal to 0"],
        ["domains[0].weight"],
    ),
    (
        "unknown-verifier",
        run_with(_set("domains.1.verifier.kind", "magic")),
        ["spec.domains[1].verifier.kind", "Unsupported value", "magic"],
        ["domains[1].verifier.kind"],
    ),
    (
        "group-size-1",
        run_with(_set("algorithm.groupSize", 1)),
        ["spec.algorithm.groupSize", "greater than or equal to 2"],
        ["algorithm.groupSize"],
    ),
    (
        "missing-model",
        run_with(_delete("model")),
        ["spec.model", "Required value"],
        ["spec.model", "Field required"],
    ),
    (
        "no-domains",
        run_with(_set("domains", [])),
        ["spec.domains", "at least 1 item"],
        ["spec.domains"],
    ),
    (
        "duplicate-domain",
        run_with(_duplicate_domain),
        ["spec.domains[2]", "Duplicate value"],
        ["names must be unique", "arithmetic"],
    ),
    (
        "all-weights-zero",
        run_with(_zero_weights),
        ["at least one domain needs weight > 0"],
        ["at least one domain needs weight > 0"],
    ),
    (
        "zero-learning-rate",
        run_with(_set("algorithm.learningRate", 0)),
        ["spec.algorithm.learningRate", "greater than 0"],
        ["algorithm.learningRate"],
    ),
    (
        "bad-quantity",
        run_with(_set("resources.memory", "lots")),
        ["spec.resources.memory", "should match"],
        ["resources.memory"],
    ),
    (
        "unknown-field",
        run_with(_set("algoritm", {"groupSize": 4})),
        ['unknown field "spec.algoritm"'],
        ["spec.algoritm", "Extra inputs are not permitted"],
    ),
    (
        "runner-url-without-scheme",  # no URL at all is fine: the operator runs a runner
        run_with(_set("sandbox.runnerUrl", "sandbox-runner:8090")),
        ["spec.sandbox.runnerUrl", "should match"],
        ["sandbox.runnerUrl"],
    ),
    (
        "stage-rl-not-last",
        run_with(
            _set(
                "stages",
                [
                    {"name": "rl", "type": "rl"},
                    {"name": "tune", "type": "sft", "datasets": ["d.jsonl"], "maxSteps": 2},
                ],
            )
        ),
        ["spec.stages", "stages: the rl stage must be the last one"],
        ["stages: the rl stage must be the last one"],
    ),
    (
        "domain-without-verifier-or-environment",
        run_with(lambda spec: spec["domains"][0].pop("verifier")),
        ["spec.domains[0].verifier", "verifier is required unless environment is set"],
        ["spec.domains[0]", "verifier is required unless environment is set"],
    ),
    (
        "stage-two-rl",
        run_with(_set("stages", [{"name": "rl", "type": "rl"}, {"name": "rl2", "type": "rl"}])),
        ["spec.stages", "stages: at most one rl stage"],
        ["stages: at most one rl stage"],
    ),
    (
        "stage-dpo-without-datasets",
        run_with(_set("stages", [{"name": "prefs", "type": "dpo", "maxSteps": 2}])),
        ["spec.stages[0].datasets", "datasets is required for sft and dpo stages"],
        ["stages[0].datasets", "datasets is required for sft and dpo stages"],
    ),
    (
        "stage-beta-on-sft",
        run_with(
            _set(
                "stages",
                [
                    {
                        "name": "tune",
                        "type": "sft",
                        "datasets": ["d.jsonl"],
                        "maxSteps": 2,
                        "beta": 0.1,
                    }
                ],
            )
        ),
        ["spec.stages[0].beta", "beta applies to dpo stages only"],
        ["stages[0].beta", "beta applies to dpo stages only"],
    ),
    (
        "stage-sft-without-length",
        run_with(_set("stages", [{"name": "tune", "type": "sft", "datasets": ["d.jsonl"]}])),
        ["spec.stages[0].maxSteps", "maxSteps is required for sft and dpo stages"],
        ["stages[0].maxSteps", "maxSteps is required for sft and dpo stages"],
    ),
    (
        "stage-duplicate-name",
        run_with(
            _set(
                "stages",
                [
                    {"name": "a", "type": "sft", "datasets": ["d"], "maxSteps": 1},
                    {"name": "a", "type": "dpo", "datasets": ["d"], "maxSteps": 1},
                ],
            )
        ),
        ["spec.stages[1]", "Duplicate value"],
        ["stages: names must be unique", "'a'"],
    ),
    (
        "stage-unknown-type",
        run_with(_set("stages", [{"name": "a", "type": "ppo"}])),
        ["spec.stages[0].type", "Unsupported value", "ppo"],
        ["spec.stages[0].type", "ppo"],
    ),
    (
        "task-without-command",
        task_with(_no_command_no_files),
        ["one of command or files is required"],
        ["one of command or files is required"],
    ),
    (
        "task-zero-timeout",
        task_with(_set("timeoutSeconds", 0)),
        ["spec.timeoutSeconds", "greater than or equal to 1"],
        ["spec.timeoutSeconds"],
    ),
    (
        "colocated-without-pool",
        run_with(_set("rollout", {"colocated": {"replicas": 2}})),
        [
            "spec.rollout.colocated",
            "rollout.colocated takes its replicas' template from a RolloutPool: set rollout.pool",
        ],
        ["rollout.colocated takes its replicas' template from a RolloutPool: set rollout.pool"],
    ),
    (
        "colocated-with-endpoints",
        run_with(
            _set(
                "rollout", {"pool": "smollm2-pool", "endpoints": ["http://a:8000"], "colocated": {}}
            )
        ),
        ["spec.rollout.endpoints", "rollout.colocated and rollout.endpoints exclude each other"],
        ["rollout.colocated and rollout.endpoints exclude each other"],
    ),
    (
        "colocated-on-two-nodes",
        run_with(
            lambda spec: spec.update(
                rollout={"pool": "smollm2-pool", "colocated": {"replicas": 1}},
                resources={**spec["resources"], "nodes": 2},
            )
        ),
        [
            "spec.rollout.colocated",
            "rollout.colocated runs the replicas inside the one trainer "
            "pod, so it needs resources.nodes: 1",
        ],
        ["so it needs resources.nodes: 1", "drop rollout.colocated"],
    ),
    (
        "colocated-nine-replicas",
        run_with(_set("rollout", {"pool": "smollm2-pool", "colocated": {"replicas": 9}})),
        ["spec.rollout.colocated.replicas", "less than or equal to 8"],
        ["rollout.colocated.replicas"],
    ),
    (
        "colocated-bad-shm-size",
        run_with(
            _set("rollout", {"pool": "smollm2-pool", "colocated": {"shmSizeLimit": "two gigs"}})
        ),
        ["spec.rollout.colocated.shmSizeLimit", "should match"],
        ["rollout.colocated.shmSizeLimit"],
    ),
    (
        "pool-negative-replicas",
        pool_with(_set("replicas", -1)),
        ["spec.replicas", "greater than or equal to 0"],
        ["spec.replicas"],
    ),
    (
        "pool-unknown-engine",
        pool_with(_set("engine", "tgi")),
        ["spec.engine", "Unsupported value"],
        ["spec.engine"],
    ),
]


@pytest.mark.parametrize(
    ("manifest", "local_expect"), [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_local_models_reject_with_field_path(
    manifest: dict[str, Any], local_expect: list[str]
) -> None:
    with pytest.raises(UsageError) as info:
        parse_resource(manifest, "bad.yaml")
    for expected in local_expect:
        assert expected in str(info.value)


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("manifest", "server_expect"), [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_apiserver_rejects_with_field_path(
    manifest: dict[str, Any],
    server_expect: list[str],
    crds_installed: None,
    namespace: str,
    kubectl: Any,
) -> None:
    result = kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0, result.stdout
    for expected in server_expect:
        assert expected in result.stderr, result.stderr
    kind = manifest["kind"].lower()
    listed = kubectl("get", kind, "-n", namespace, "-o", "name")
    assert listed.stdout.strip() == "", "a rejected object must not be stored"


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("field", "new_value", "message"),
    [
        ("model", "s3://models/other", "model is immutable"),
        ("managedBy", "kueue.x-k8s.io/multikueue", "managedBy is immutable"),
    ],
)
def test_immutable_fields_cannot_change(
    field: str, new_value: str, message: str, crds_installed: None, namespace: str, kubectl: Any
) -> None:
    manifest = example("arith-code-run.yaml")
    kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest))
    manifest["spec"][field] = new_value
    result = kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(manifest), check=False
    )
    assert result.returncode != 0
    assert message in result.stderr
    stored = kubectl(
        "get", "tr", "arith-code", "-n", namespace, "-o", f"jsonpath={{.spec.{field}}}"
    ).stdout
    assert stored != new_value
