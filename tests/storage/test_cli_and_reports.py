"""``posttrain storage`` subcommands and report uploads, on real stores."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from posttrain.devenv.minio import MinioServer
from posttrain.errors import UsageError
from posttrain.storage import cli
from posttrain.storage.checkpoints import CheckpointManager
from posttrain.storage.reports import upload_reports
from posttrain.storage.store import ArtifactStore, LocalStore, S3Store
from posttrain.storage.trajectories import TrajectoryWriter


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="posttrain")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_checkpoints_and_spot_check_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = LocalStore(tmp_path / "runs" / "ns" / "a")
    assert run_cli(["storage", "checkpoints", str(run.root)]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.safetensors").write_bytes(b"w" * 2048)
    manager = CheckpointManager(run)
    manager.save(3, tmp_path / "ck", eval_score=0.5)
    manager.save(7, tmp_path / "ck")
    assert run_cli(["storage", "checkpoints", f"file://{run.root}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[:3] == ["3", "2.0", "KiB"] and "0.5" in out[1]
    assert out[2].endswith("<- latest") and out[2].split()[0] == "7"

    with TrajectoryWriter(run, "trajectories", tmp_path / "spool", writer_id="w") as writer:
        for i in range(30):
            writer.append({"prompt": f"q{i}", "completion": f"a{i}", "reward": 1.0})
    out_file = tmp_path / "sample.md"
    assert (
        run_cli(["storage", "spot-check", str(run.root), "--n", "4", "--out", str(out_file)]) == 0
    )
    assert out_file.read_text().count("\n## ") == 4
    with pytest.raises(UsageError, match="--n must be at least 1"):
        run_cli(["storage", "spot-check", str(run.root), "--n", "0"])


@pytest.mark.minio
def test_cli_reports_storage_errors_without_traceback(
    s3_server: MinioServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-abc")
    assert run_cli(["storage", "checkpoints", "s3://posttrain/runs/ns/a"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and s3_server.endpoint in err
    assert "wrong-secret-abc" not in err


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.minio)])
def run_store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    if request.param == "local":
        return LocalStore(tmp_path / "bucket")
    server: MinioServer = request.getfixturevalue("s3_server")
    factory: Callable[..., S3Store] = request.getfixturevalue("s3_store_factory")
    return factory(server, f"t-{uuid.uuid4().hex[:12]}")


def test_upload_reports_beside_the_run(run_store: ArtifactStore, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    (reports / "plots").mkdir(parents=True)
    (reports / "eval-step-12.md").write_text("# Eval at step 12\naccuracy 0.41\n")
    (reports / "plots" / "reward.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)
    keys = upload_reports(run_store, "runs/ns/a", reports)
    assert keys == ["runs/ns/a/reports/eval-step-12.md", "runs/ns/a/reports/plots/reward.png"]
    assert run_store.get_bytes(keys[0]).startswith(b"# Eval at step 12")
    if isinstance(run_store, S3Store):  # served with a type the MinIO console can render
        stat = run_store.client.stat_object(run_store.bucket, keys[1])
        assert stat.content_type == "image/png"
