"""The images install from tools/images/deps/pyproject.toml, generated from pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from .podman import REPO_ROOT


def test_the_images_dependency_file_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "images" / "deps.py"), "--check"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_it_holds_exactly_the_projects_dependencies() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    generated = tomllib.loads(
        (REPO_ROOT / "tools" / "images" / "deps" / "pyproject.toml").read_text()
    )["project"]
    assert generated["dependencies"] == project["dependencies"]
    assert generated["optional-dependencies"] == project["optional-dependencies"]
