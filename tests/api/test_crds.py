"""The CRDs are generated from the models: committed YAML must not drift, and the real
apiserver accepts them and every example, showing the printer columns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.api import TrainingRun, load_manifests
from posttrain.api.crdgen import RESOURCES, build_crd, drifted_files, structural_schema

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_committed_crds_match_the_models(repo_root: Path) -> None:
    assert drifted_files(repo_root) == [], "run `posttrain crds` and commit the result"


def _walk(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


@pytest.mark.parametrize("res", RESOURCES, ids=lambda r: r.kind)
def test_schema_is_structural(res: Any) -> None:
    schema = build_crd(res)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for node in _walk(schema):
        assert "$ref" not in node and "title" not in node and "anyOf" not in node
        assert "allOf" not in node and "$defs" not in node
        if "properties" in node:
            assert node.get("type") == "object"
            assert "additionalProperties" not in node
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node


def test_docstrings_become_descriptions() -> None:
    schema = structural_schema(TrainingRun.model_fields["spec"].annotation)  # type: ignore[arg-type]
    group = schema["properties"]["algorithm"]["properties"]["groupSize"]
    assert "Completions sampled per prompt" in group["description"]
    assert group["minimum"] == 2


def test_pool_has_scale_subresource_and_columns() -> None:
    crd = build_crd(next(r for r in RESOURCES if r.kind == "RolloutPool"))
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == [
        "Ready",
        "Desired",
        "Version",
    ]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_locally(path: Path) -> None:
    assert load_manifests(path)


@pytest.mark.cluster
def test_apiserver_accepts_examples_and_prints_columns(
    crds_installed: None, namespace: str, kubectl: Any
) -> None:
    for path in EXAMPLES:
        kubectl("apply", "-n", namespace, "-f", str(path))
    api_resources = kubectl("api-resources", "--api-group=posttrain.io").stdout
    for short in ("tr", "rp", "st"):
        assert f" {short} " in api_resources
    table = kubectl("get", "tr", "-n", namespace).stdout
    assert table.split()[:7] == ["NAME", "PHASE", "STEP", "MAX", "REWARD", "STAGE", "AGE"]
    pools = kubectl("get", "rp", "-n", namespace).stdout.splitlines()
    assert pools[0].split()[:4] == ["NAME", "READY", "DESIRED", "VERSION"]
    # Ready and Version are empty until the operator reports; Desired comes from the spec.
    desired_at = pools[0].index("DESIRED")
    desired = {row.split()[0]: row[desired_at:].split()[0] for row in pools[1:]}
    assert desired == {"dev-pool": "1", "dev-vllm-pool": "1", "smollm2-pool": "2"}
    tasks = kubectl("get", "st", "-n", namespace).stdout
    assert tasks.split()[:4] == ["NAME", "PHASE", "REWARD", "DURATION-MS"]
    everything = kubectl("get", "posttrain", "-n", namespace, "-o", "name").stdout.split()
    assert len(everything) == sum(len(load_manifests(p)) for p in EXAMPLES)
    # The stored object round-trips through the local models (same source of truth).
    stored = yaml.safe_load(
        kubectl("get", "tr", "arith-code", "-n", namespace, "-o", "yaml").stdout
    )
    run = TrainingRun.model_validate(
        {k: v for k, v in stored.items() if k in ("apiVersion", "kind", "spec")}
        | {"metadata": {"name": stored["metadata"]["name"]}}
    )
    assert run.spec.algorithm.group_size == 8
    assert run.spec.algorithm.top_p == 1.0  # a default the apiserver filled in
