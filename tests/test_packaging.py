"""The layout promises in the README hold: every component imports as posttrain.<name>,
and nothing in the repository can shadow the standard library's ``operator`` module."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_operator_folder_is_not_an_importable_package() -> None:
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()
    # From the repository root (where '' is first on sys.path), `operator` is still stdlib.
    out = subprocess.run(
        [sys.executable, "-c", "import operator, sys; print(operator.__file__)"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(out).parent == Path(
        subprocess.run(
            [sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )


def test_every_component_folder_is_packaged_and_linked() -> None:
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
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
    # Every folder with an __init__.py under posttrain/ (sub-packages too) reaches the wheel.
    for init in (REPO_ROOT / "posttrain").glob("**/__init__.py"):
        rel = init.parent.relative_to(REPO_ROOT)
        name = ".".join(rel.parts)
        assert name in packages, f"{name} has an __init__.py but is not in pyproject's packages"


def test_cli_lists_every_component_command() -> None:
    help_text = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("crds", "dev"):
        assert command in help_text


COMPONENT_MODULES = (
    "posttrain.api",
    "posttrain.api.labels",
    "posttrain.operator.handlers",
    "posttrain.operator.trainingrun.builders",
    "posttrain.trainer.run.loop",
    "posttrain.rollout.server",
    "posttrain.sandboxes.executor",
    "posttrain.storage.store",
    "posttrain.devenv.cli",
    "posttrain.ctl.commands",
)


@pytest.mark.slow
def test_the_built_wheel_works_in_a_clean_environment(tmp_path: Path) -> None:
    """The symlinked layout must survive packaging: build the wheel, install it (with the train
    extra) into a fresh venv, and use it from outside the checkout."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is missing: `make venv` installs it")
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=600)
    built = run(
        [uv, "build", "--quiet", "--wheel", "--out-dir", str(tmp_path / "dist"), str(REPO_ROOT)]
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("posttrain-*.whl")
    venv = tmp_path / "venv"
    made = run([uv, "venv", "--quiet", "--python", "3.11", str(venv)])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    installed = run([uv, "pip", "install", "--quiet", "-p", str(python), f"{wheel}[train]"])
    assert installed.returncode == 0, installed.stderr

    help_out = run([str(venv / "bin" / "posttrain"), "--help"], cwd=tmp_path)
    assert help_out.returncode == 0, help_out.stderr
    assert "crds" in help_out.stdout
    # Models from the installed wheel generate exactly the committed CRDs (cwd: the checkout,
    # whose crds/ are compared; the console script imports the installed package, not the tree).
    check = run([str(venv / "bin" / "posttrain"), "crds", "--check"], cwd=REPO_ROOT)
    assert check.returncode == 0, check.stdout + check.stderr
    probe = "import importlib, json, sys; print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))"
    imported = run([str(python), "-c", probe, *COMPONENT_MODULES], cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    site = str(venv)
    for module, path in json.loads(imported.stdout).items():
        assert path.startswith(site), f"{module} imported from {path}, not from the installed wheel"
    # The operator runs on its own loop and informers (#32): Kopf is no dependency any more,
    # and the operator's runtime imports without it.
    runtime = run([str(python), "-c", "import posttrain.operator.runtime"], cwd=tmp_path)
    assert runtime.returncode == 0, runtime.stderr
    kopf = run([str(python), "-c", "import kopf"], cwd=tmp_path)
    assert kopf.returncode != 0 and "No module named 'kopf'" in kopf.stderr, kopf.stderr
