"""Helpers for the chart tests: the real helm binary rendering charts/posttrain, and (for the
cluster tests) talking to the session control plane from tests/conftest.py."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "charts" / "posttrain"
VALUES_DIR = Path(__file__).parent / "values"
# Every values file the chart must lint, render and validate with (besides the defaults).
VALUES_FILES = sorted(VALUES_DIR.glob("*.yaml"))

Render = Callable[..., list[dict[str, Any]]]
Helm = Callable[..., subprocess.CompletedProcess[str]]


def run_helm(
    helm_bin: Path, *args: str, kubeconfig: Path | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    cmd = [str(helm_bin), *args]
    if kubeconfig is not None:
        cmd.append(f"--kubeconfig={kubeconfig}")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def helm_args(values: list[Path] | None = None, sets: dict[str, str] | None = None) -> list[str]:
    """-f / --set arguments, e.g. helm_args(sets={"operator.replicas": "2"})."""
    args: list[str] = []
    for path in values or []:
        args += ["-f", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


@pytest.fixture(scope="session")
def render(helm_bin: Path) -> Render:
    """`helm template` the chart (CRDs included) and return the objects it renders."""

    def _render(
        values: list[Path] | None = None,
        sets: dict[str, str] | None = None,
        api_versions: list[str] | None = None,
        namespace: str = "posttrain-system",
    ) -> list[dict[str, Any]]:
        args = ["template", "rel", str(CHART_DIR), "--namespace", namespace, "--include-crds"]
        for api in api_versions or []:
            args += ["--api-versions", api]
        out = run_helm(helm_bin, *args, *helm_args(values, sets)).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return _render


@pytest.fixture
def helm(helm_bin: Path, kubeconfig: Path) -> Helm:
    """The real helm against the test control plane: helm("list", "-A")."""

    def _helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_helm(helm_bin, *args, kubeconfig=kubeconfig, check=check)

    return _helm


@pytest.fixture
def release(helm: Helm, namespace: str) -> Iterator[str]:
    """A unique release name in the per-test namespace, uninstalled afterwards if still there."""
    name = f"pt-{uuid.uuid4().hex[:6]}"
    yield name
    helm("uninstall", name, "--namespace", namespace, "--wait", check=False)


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    """The single object of ``kind`` whose name ends with ``name_suffix``."""
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
    return found[0]
