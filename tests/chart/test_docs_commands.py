"""docs/chart.md's install and uninstall commands, run exactly as written (bash, with the
real helm and kubectl on PATH) against the test control plane."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

pytestmark = pytest.mark.cluster

DOC = REPO_ROOT / "docs" / "chart.md"


def bash_blocks(markdown: str) -> list[str]:
    """The ```bash blocks of a Markdown file, in order."""
    return re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL)


def paragraph(block: str, starting_with: str) -> str:
    """The lines of ``block`` from the comment line ``starting_with`` to the next blank line."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(starting_with))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return "\n".join(lines[start:end]) + "\n"


def run_bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_evaluation_install_and_uninstall_work_as_written(
    helm_bin: Path, kubectl_bin: Path, kubeconfig: Path, tmp_path: Path
) -> None:
    block = bash_blocks(DOC.read_text())[0]
    install = paragraph(block, "# Evaluation")
    uninstall = next(line for line in block.splitlines() if line.startswith("helm uninstall"))
    bindir = tmp_path / "bin"  # the docs say `helm` and `kubectl`: put those names on PATH
    bindir.mkdir()
    for name, binary in (("helm", helm_bin), ("kubectl", kubectl_bin)):
        (bindir / name).symlink_to(binary)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PATH": f"{bindir}:{os.environ['PATH']}"}
    try:
        installed = run_bash(install, env)
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert "STATUS: deployed" in installed.stdout, installed.stdout
        # MinIO's admin keys stay in the release namespace: runs get keys of their own.
        secrets = run_bash("kubectl -n ml-demo get secrets -o name", env)
        assert "secret/posttrain-minio-credentials" not in secrets.stdout.split(), secrets
        kept = run_bash("kubectl -n posttrain-system get secrets -o name", env)
        assert "secret/posttrain-minio-credentials" in kept.stdout.split(), kept
        removed = run_bash(uninstall, env)
        assert removed.returncode == 0, removed.stderr
        left = run_bash("helm list -n posttrain-system -q", env)
        assert left.stdout.strip() == ""
    finally:
        run_bash(
            "helm uninstall posttrain -n posttrain-system --ignore-not-found; "
            "kubectl delete namespace ml-demo posttrain-system --ignore-not-found "
            "--wait=false",
            env,
        )
