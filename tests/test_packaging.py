"""The layout promises in the README hold: every component imports as posttrain.<name>,
and nothing in the repository can shadow the standard library's ``operator`` module."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_operator_folder_is_not_an_importable_package() -> None:
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()
    # From the repository root (where '' is first on sys.path), `operator` is still stdlib.
    out = subprocess.run(
        [sys.executable, "-c", "import operator, sys; print(operator.__file__)"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert Path(out).parent == Path(subprocess.run(
        [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
        capture_output=True, text=True, check=True).stdout.strip())


def test_every_component_folder_is_packaged_and_linked() -> None:
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    for package in packages:
        parts = package.split(".")
        assert parts[0] == "posttrain"
        path = REPO_ROOT.joinpath(*parts)
        assert path.is_dir(), f"{package} listed in pyproject.toml but {path} is missing"
        if len(parts) == 2 and path.is_symlink():
            assert (REPO_ROOT / parts[1]).is_dir()
    for link in (REPO_ROOT / "posttrain").iterdir():
        if link.is_symlink():
            assert f"posttrain.{link.name}" in packages, f"{link.name} is not packaged"


def test_cli_lists_every_component_command() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("crds", "dev"):
        assert command in help_text
