"""The ``posttrain operator`` command line (argument handling, the RBAC generator)."""

from __future__ import annotations

import pytest
import yaml

from posttrain.cli import main
from posttrain.operator.rbac import OPERATOR_RULES


def test_rbac_command_prints_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["operator", "rbac", "--name", "op"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert docs[0]["metadata"]["name"] == "op"
    assert docs[0]["rules"] == OPERATOR_RULES


def test_bad_configuration_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("POSTTRAIN_OPERATOR_RESYNC_SECONDS", "-1")
    assert main(["operator", "--standalone"]) == 2
    err = capsys.readouterr().err
    assert "resync_seconds" in err and "POSTTRAIN_OPERATOR_" in err


def test_peering_is_the_old_name_of_lease_and_priority_is_gone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--peering still names the Lease (a bad name reaches the config's check); --priority,
    Kopf peering's, is refused."""
    assert main(["operator", "--peering", "Bad Name"]) == 2
    assert "lease_name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["operator", "--priority", "5"])


def test_namespace_and_all_namespaces_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        main(["operator", "-n", "a", "--all-namespaces"])
