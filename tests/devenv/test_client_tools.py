"""kubectl and helm under the names the docs use: ``make venv`` links them into ``.venv/bin``
(the Makefile's own line is run here), so a fresh shell that sources ``.venv/bin/activate``
runs ``kubectl`` and ``helm``, and ``.venv/bin/kubectl`` works without it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.devenv.binaries import client_binary, link_client_tools

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = REPO_ROOT / ".venv" / "bin"


def makefile_link_line() -> str:
    """The recipe line of ``make venv`` that links the tools, with ``$(PY)`` spelled out."""
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    line = next(line.strip() for line in lines if "link_client_tools" in line)
    assert line.startswith("$(PY) "), line
    return line.replace("$(PY)", ".venv/bin/python", 1)


def fresh_shell(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a new bash in the repository root, with a PATH holding no kubectl."""
    env = {"HOME": os.environ["HOME"], "PATH": "/usr/bin:/bin"}
    if "POSTTRAIN_BIN_DIR" in os.environ:  # where client_binary extracts to
        env["POSTTRAIN_BIN_DIR"] = os.environ["POSTTRAIN_BIN_DIR"]
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_links_are_made_once_and_a_stale_one_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "kubectl").symlink_to(tmp_path / "elsewhere")
    links = link_client_tools(tmp_path)
    assert [link.name for link in links] == ["kubectl", "helm"]
    for link in links:
        assert link.readlink() == client_binary(link.name).absolute()
    before = [link.lstat().st_ino for link in links]
    link_client_tools(tmp_path)
    assert [link.lstat().st_ino for link in links] == before  # left alone when right
    assert sorted(p.name for p in tmp_path.iterdir()) == ["helm", "kubectl"]  # no .partial


def test_make_venv_puts_kubectl_and_helm_on_the_venvs_path() -> None:
    if Path(sys.executable).parent != VENV_BIN:
        pytest.skip("needs the repository's own .venv (make venv)")
    linked = fresh_shell(makefile_link_line())
    assert linked.returncode == 0, linked.stderr

    direct = fresh_shell(".venv/bin/kubectl version --client && .venv/bin/helm version")
    assert direct.returncode == 0, direct.stderr
    assert "Client Version: v1.37" in direct.stdout, direct.stdout
    assert "version.BuildInfo" in direct.stdout, direct.stdout

    activated = fresh_shell(
        "source .venv/bin/activate\n"
        "command -v kubectl helm\n"
        "kubectl version --client\n"
        "helm version --short\n"
    )
    assert activated.returncode == 0, activated.stderr
    found = activated.stdout.splitlines()[:2]
    assert found == [str(VENV_BIN / "kubectl"), str(VENV_BIN / "helm")], activated.stdout
