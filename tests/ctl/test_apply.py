"""``posttrain apply``: local validation first (nothing sent when anything is invalid),
then server-side apply against the real apiserver."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.cluster
CliRunner = Any


def test_apply_creates_then_reports_unchanged_and_configured(
    kcli: CliRunner, kube: Any, tmp_path: Path
) -> None:
    manifest = tmp_path / "run.yaml"
    doc = kube.run_manifest("demo")
    manifest.write_text(yaml.safe_dump(doc))

    first = kcli("apply", "-f", str(manifest))
    assert first.code == 0, first.err
    assert first.out.strip() == "trainingrun.posttrain.io/demo created"
    assert (
        kcli("apply", "-f", str(manifest)).out.strip() == "trainingrun.posttrain.io/demo unchanged"
    )

    doc["spec"]["algorithm"]["maxSteps"] = 7
    manifest.write_text(yaml.safe_dump(doc))
    dry = kcli("apply", "-f", str(manifest), "--dry-run")
    assert dry.out.strip() == "trainingrun.posttrain.io/demo configured (server dry run)"
    assert kube.get_run("demo")["spec"]["algorithm"]["maxSteps"] == 3  # not persisted
    third = kcli("apply", "-f", str(manifest))
    assert third.out.strip() == "trainingrun.posttrain.io/demo configured"

    live = kube.get_run("demo")
    assert live["spec"]["algorithm"]["maxSteps"] == 7
    managers = {m["manager"]: m["operation"] for m in live["metadata"]["managedFields"]}
    assert managers.get("posttrain") == "Apply"  # server-side apply, our field manager


def test_apply_directory_of_examples(kcli: CliRunner, kube: Any, repo_root: Path) -> None:
    from posttrain.api import TrainingRun, load_manifests

    examples = sorted((repo_root / "examples").glob("*.yaml"))
    resources = [r for path in examples for r in load_manifests(path)]
    result = kcli("apply", "-f", str(repo_root / "examples"))
    assert result.code == 0, result.err
    assert sorted(result.out.splitlines()) == sorted(
        f"{r.kind.lower()}.posttrain.io/{r.metadata.name} created" for r in resources
    )
    assert kube.run_names() == sorted(
        r.metadata.name for r in resources if isinstance(r, TrainingRun)
    )


def test_invalid_document_names_the_field_and_nothing_is_created(
    kcli: CliRunner, kube: Any, tmp_path: Path
) -> None:
    good = kube.run_manifest("good")
    bad = kube.run_manifest("bad")
    bad["spec"]["algorithm"]["groupSize"] = 1  # advantages need >= 2 per group
    bad["spec"]["domains"][0]["verfier"] = bad["spec"]["domains"][0].pop("verifier")  # typo
    manifest = tmp_path / "runs.yaml"
    manifest.write_text(yaml.safe_dump_all([good, bad]))

    result = kcli("apply", "-f", str(manifest))
    assert result.code == 2
    assert "(document 2)" in result.err
    assert "spec.algorithm.groupSize" in result.err
    assert "spec.domains[0].verfier" in result.err  # the typo, by its path
    assert "nothing was applied" in result.err
    assert result.out == ""
    assert kube.run_names() == []  # the valid document was not sent either


def test_apiserver_rejection_is_exit_1_with_its_message(
    kcli: CliRunner, kube: Any, tmp_path: Path
) -> None:
    manifest = tmp_path / "run.yaml"
    doc = kube.run_manifest("immutable")
    manifest.write_text(yaml.safe_dump(doc))
    assert kcli("apply", "-f", str(manifest)).code == 0
    doc["spec"]["model"] = "another-model"  # valid locally, but the CRD's CEL rule forbids it
    manifest.write_text(yaml.safe_dump(doc))
    result = kcli("apply", "-f", str(manifest))
    assert result.code == 1
    assert "model is immutable" in result.err


def test_bad_paths_and_namespace_conflicts_are_usage_errors(
    kcli: CliRunner, kube: Any, tmp_path: Path
) -> None:
    missing = kcli("apply", "-f", str(tmp_path / "nope.yaml"))
    assert missing.code == 2 and "no such file or directory" in missing.err
    doc = kube.run_manifest("elsewhere")
    doc["metadata"]["namespace"] = "some-other-namespace"
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    conflict = kcli("apply", "-f", str(manifest))
    assert conflict.code == 2
    assert f"-n says {kube.namespace!r}" in conflict.err


def test_apply_reads_stdin_with_dash(
    kcli: CliRunner, kube: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(yaml.safe_dump(kube.run_manifest("piped"))))
    result = kcli("apply", "-f", "-", "--dry-run")
    assert result.code == 0, result.err
    assert result.out.strip() == "trainingrun.posttrain.io/piped created (server dry run)"
    assert kube.run_names() == []  # a dry run persists nothing


def test_validation_runs_before_any_cluster_is_needed(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No kubeconfig anywhere: an invalid manifest still gets its field errors (exit 2),
    and a valid one gets the clear no-kubeconfig message instead of a traceback."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("POSTTRAIN_DEV_DIR", str(tmp_path / "dev"))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    doc = {
        "apiVersion": "posttrain.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "x"},
        "spec": {
            "model": "m",
            "domains": [{"name": "a", "dataset": "d", "verifier": {"kind": "numeric"}}],
        },
    }
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(doc))
    doc["spec"]["algorithm"] = {"name": "ppo"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))

    invalid = cli("apply", "-f", str(bad))
    assert invalid.code == 2 and "spec.algorithm.name" in invalid.err
    offline = cli("apply", "-f", str(good))
    assert offline.code == 2 and "no kubeconfig found" in offline.err
    assert "posttrain dev up" in offline.err
