"""The pure parts of the user commands: kubeconfig order, kind names, trainer pod choice,
and the worked examples in every helper's docstring."""

from __future__ import annotations

import doctest
import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from posttrain.ctl.follow import pick_trainer_pod
from posttrain.ctl.kube import KINDS, find_kubeconfig, resolve_kind
from posttrain.ctl.parsers import KIND_CHOICES
from posttrain.errors import UsageError


@pytest.mark.parametrize(
    "module",
    [
        "posttrain.ctl.render",
        "posttrain.ctl.report",
        "posttrain.ctl.kube",
        "posttrain.ctl.follow",
        "posttrain.ctl.commands",
        "posttrain.ctl.parsers",
        "posttrain.cli",
        "posttrain.progresslog",
        "posttrain.api.manifests",
    ],
)
def test_worked_examples_in_docstrings(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_kubeconfig_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit, env_file, dev_file = (tmp_path / n for n in ("explicit", "env", "dev"))
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    home_file = home / ".kube" / "config"
    for path in (explicit, env_file, dev_file, home_file):
        path.write_text("apiVersion: v1\n")
    dev_dir = tmp_path / "devstate"
    dev_dir.mkdir()
    (dev_dir / "state.json").write_text(json.dumps({"kubeconfig": str(dev_file)}))
    monkeypatch.setenv("POSTTRAIN_DEV_DIR", str(dev_dir))
    env = {"KUBECONFIG": f"{tmp_path / 'absent'}:{env_file}", "HOME": str(home)}

    assert find_kubeconfig(str(explicit), env) == explicit
    assert find_kubeconfig(None, env) == env_file  # first existing entry of $KUBECONFIG
    assert find_kubeconfig(None, {"HOME": str(home)}) == dev_file
    (dev_dir / "state.json").unlink()
    assert find_kubeconfig(None, {"HOME": str(home)}) == home_file
    home_file.unlink()
    with pytest.raises(UsageError, match="posttrain dev up"):
        find_kubeconfig(None, {"HOME": str(home)})
    with pytest.raises(UsageError, match="no such file"):
        find_kubeconfig(str(tmp_path / "nope"), env)


def test_kind_names() -> None:
    assert resolve_kind("rp").plural == "rolloutpools"
    assert resolve_kind("SandboxTask").short == "st"
    assert resolve_kind("swp").kind == resolve_kind("sandboxwarmpools").kind == "SandboxWarmPool"
    # the help lists every kind the commands accept (it is written out to keep --help light)
    assert KIND_CHOICES.split(" ")[0].split("|") == [kind.short for kind in KINDS]
    for kind in KINDS:
        assert f"{kind.singular}(s)" in KIND_CHOICES
    with pytest.raises(UsageError, match="unknown resource type 'pods'"):
        resolve_kind("pods")


def pod(name: str, gang: str, rank: str) -> SimpleNamespace:
    labels = {"posttrain.io/gang": gang, "posttrain.io/rank": rank}
    return SimpleNamespace(metadata=SimpleNamespace(name=name, labels=labels))


def test_logs_pick_rank_0_of_the_newest_gang() -> None:
    pods = [pod("r-g1-0", "1", "0"), pod("r-g2-1", "2", "1"), pod("r-g2-0", "2", "0")]
    assert pick_trainer_pod(pods).metadata.name == "r-g2-0"
    assert pick_trainer_pod([]) is None


def test_unreachable_apiserver_is_exit_1_with_a_next_step(cli: Any, tmp_path: Path) -> None:
    """Port 1 on loopback refuses connections: the error says so and what to check."""
    dead = tmp_path / "kubeconfig"
    dead.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u, namespace: team-a}}]\n"
    )
    result = cli("get", "tr", "--kubeconfig", str(dead))
    assert result.code == 1
    assert "cannot reach the apiserver" in result.err and "Connection refused" in result.err
    assert "posttrain dev status" in result.err
    from posttrain.ctl.kube import connect

    assert connect(str(dead), None).namespace == "team-a"  # the context's namespace
    assert connect(str(dead), "other").namespace == "other"  # -n wins
