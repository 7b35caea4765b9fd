"""The node agent's pure helpers (no cluster): env expansion, downward API, bwrap argv."""

from __future__ import annotations

import doctest
import subprocess
from pathlib import Path

import pytest

from posttrain.devenv import nodeagent, podprocess
from posttrain.devenv.podprocess import PodSpecError, bwrap_prefix, field_ref_value


@pytest.mark.parametrize("module", [nodeagent, podprocess])
def test_docstring_examples_hold(module: object) -> None:
    result = doctest.testmod(module)  # type: ignore[arg-type]
    assert result.attempted >= 2
    assert result.failed == 0


def test_unsupported_field_ref_names_the_supported_ones() -> None:
    with pytest.raises(PodSpecError, match=r"metadata\.name"):
        field_ref_value({"metadata": {}}, "spec.containers[0].image")


def test_mount_points_are_made_in_the_sandbox_not_on_the_host(tmp_path: Path) -> None:
    volume = tmp_path / "vol"
    volume.mkdir()
    (volume / "run.yaml").write_text("steps: 1\n")
    target = "/posttrain-nodeagent-test/etc/posttrain"
    argv = bwrap_prefix([(str(volume), target, True)])
    # The new top-level directory is created on bwrap's tmpfs root, never bound from the host.
    top = argv.index("/posttrain-nodeagent-test")
    assert argv[top - 3 : top + 1] == ["--perms", "0755", "--dir", "/posttrain-nodeagent-test"]
    seen = subprocess.run(
        [*argv, "--", "cat", f"{target}/run.yaml"], capture_output=True, text=True, check=True
    )
    assert seen.stdout == "steps: 1\n"
    assert not Path("/posttrain-nodeagent-test").exists()
