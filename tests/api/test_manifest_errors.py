"""Errors on bad manifests stay short and point at the fix: a typo gets "did you mean", and
an offending value is echoed cut to one line (not the whole input)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.api.manifests import SHOWN_VALUE_CHARS, parse_resource
from posttrain.errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def demo() -> dict[str, Any]:
    return yaml.safe_load((REPO_ROOT / "examples/local-demo.yaml").read_text())


def error_of(manifest: dict[str, Any]) -> str:
    with pytest.raises(UsageError) as info:
        parse_resource(manifest, "run.yaml")
    return str(info.value)


@pytest.mark.parametrize(
    ("path", "typo", "meant"),
    [
        (("spec", "domains", 0), "verfier", "verifier"),
        (("spec", "algorithm"), "learningrate", "learningRate"),
        (("spec",), "curiculum", "curriculum"),
        (("spec", "curriculum"), "promoteAT", "promoteAt"),
    ],
)
def test_a_typo_gets_did_you_mean(
    demo: dict[str, Any], path: tuple[Any, ...], typo: str, meant: str
) -> None:
    node: Any = demo
    for part in path:
        node = node[part]
    node[typo] = node.pop(meant) if meant in node else 1
    message = error_of(demo)
    assert f"did you mean {meant!r}?" in message, message


def test_a_huge_value_is_not_echoed_whole(demo: dict[str, Any]) -> None:
    """1001 domains broke a list limit: the message names it without printing 84 KB."""
    domain = demo["spec"]["domains"][0]
    demo["spec"]["domains"] = [{**copy.deepcopy(domain), "name": f"d{i}"} for i in range(1001)]
    message = error_of(demo)
    assert "spec.domains" in message, message
    longest = max(len(line) for line in message.splitlines())
    assert longest < SHOWN_VALUE_CHARS + 200, longest
    assert len(message) < 2000, len(message)
