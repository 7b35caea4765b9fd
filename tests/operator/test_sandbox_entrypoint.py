"""The SandboxTask pod entrypoint (sandboxes/task_entrypoint.py) run as the pod runs it: a
separate python3 process holding only presigned URLs, against the real MinIO; and the pod
manifest and result parsing that go with it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from posttrain.api import SandboxTask
from posttrain.api import labels as api_labels
from posttrain.operator.config import OperatorConfig
from posttrain.operator.sandboxtask import builders as sandbox_builders
from posttrain.operator.sandboxtask.plan import parse_sandbox_result
from posttrain.operator.shared import builders as shared_builders
from posttrain.operator.shared import sandbox as b
from posttrain.operator.shared.views import PodView, Terminated
from posttrain.sandboxes import task_entrypoint
from posttrain.storage.store import S3Store, s3_store_from_env

ENTRYPOINT = Path(task_entrypoint.__file__)
BUCKET = "entrypoint-test"


@pytest.fixture
def store(minio_env: dict[str, str]) -> S3Store:
    return s3_store_from_env(BUCKET, env=minio_env)


def put_url(store: S3Store, key: str) -> str:
    return str(store.client.presigned_put_object(BUCKET, key, expires=timedelta(minutes=5)))


def get_url(store: S3Store, key: str) -> str:
    return str(store.client.presigned_get_object(BUCKET, key, expires=timedelta(minutes=5)))


def run_entrypoint(workdir: Path, command: list[str], **env: str) -> tuple[int, dict[str, Any]]:
    """Start the entrypoint the way the pod does (python3 FILE -- CMD) with no credentials in
    its environment; returns (exit code, result JSON)."""
    result_path = workdir.parent / f"{workdir.name}.result"
    proc_env = {
        "PATH": "/usr/bin:/bin",
        task_entrypoint.WORKDIR_ENV: str(workdir),
        task_entrypoint.RESULT_PATH_ENV: str(result_path),
        **env,
    }
    proc = subprocess.run(
        [sys.executable, str(ENTRYPOINT), "--", *command],
        cwd=workdir,
        env=proc_env,
        capture_output=True,
        timeout=60,
    )
    return proc.returncode, json.loads(result_path.read_text())


PROGRAM = """
import json, os, pathlib, sys
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
pathlib.Path("out").mkdir()
pathlib.Path("out/answer.txt").write_text("42")
pathlib.Path(os.environ["POSTTRAIN_SANDBOX_RESULT_PATH"]).write_text(json.dumps(
    {"reward": 0.25, "exit_code": 0, "logs_uploaded": True}))
sys.exit(3)
"""


@pytest.mark.minio
def test_entrypoint_stores_log_and_snapshot_then_restores_under_spec_files(
    store: S3Store, tmp_path: Path
) -> None:
    first = tmp_path / "first"
    first.mkdir()
    (first / "main.py").write_text(PROGRAM)
    code, result = run_entrypoint(
        first,
        [sys.executable, "main.py"],
        POSTTRAIN_SANDBOX_LOGS_URL=put_url(store, "t/1/logs.txt"),
        POSTTRAIN_SANDBOX_SNAPSHOT_URL=put_url(store, "t/1/snapshot.tar"),
    )
    assert code == 3
    # Measured facts are ours (the program claimed exit 0); its reward is kept.
    assert result["exit_code"] == 3 and result["reason"] == "Error"
    assert result["reward"] == 0.25
    assert result["logs_uploaded"] is True and result["snapshot_uploaded"] is True
    log = store.get_bytes("t/1/logs.txt").decode()
    assert "to stdout\n" in log and "to stderr\n" in log
    with tarfile.open(fileobj=io.BytesIO(store.get_bytes("t/1/snapshot.tar"))) as tar:
        names = sorted(tar.getnames())
        answer = tar.extractfile("out/answer.txt")
        assert answer is not None and answer.read() == b"42"
    assert names == ["main.py", "out", "out/answer.txt"]

    # Failure replay: a new workdir whose spec.files has a new main.py, restored from there.
    second = tmp_path / "second"
    second.mkdir()
    (second / "main.py").write_text("print(open('out/answer.txt').read())")
    code, result = run_entrypoint(
        second,
        [sys.executable, "main.py"],
        POSTTRAIN_SANDBOX_RESTORE_URL=get_url(store, "t/1/snapshot.tar"),
        POSTTRAIN_SANDBOX_LOGS_URL=put_url(store, "t/2/logs.txt"),
    )
    assert (code, result["reason"]) == (0, "Completed")
    assert store.get_bytes("t/2/logs.txt").decode().splitlines()[-1] == "42"
    assert (second / "main.py").read_text().startswith("print(")  # spec.files won
    assert "snapshot_uploaded" in result and result["snapshot_uploaded"] is False


@pytest.mark.minio
def test_timeout_kills_the_program_group_and_still_uploads_the_log(
    store: S3Store, tmp_path: Path
) -> None:
    started = time.monotonic()
    code, result = run_entrypoint(
        tmp_path,
        ["sh", "-c", "echo started; sleep 30 & sleep 30"],
        POSTTRAIN_SANDBOX_TIMEOUT="1",
        POSTTRAIN_SANDBOX_LOGS_URL=put_url(store, "timeout/logs.txt"),
    )
    assert time.monotonic() - started < 15  # the background sleep died with the group
    assert (code, result["exit_code"], result["reason"]) == (124, 124, "Timeout")
    assert 900 < result["duration_ms"] < 10_000
    assert store.get_bytes("timeout/logs.txt") == b"started\n"


@pytest.mark.minio
def test_log_limit_keeps_the_head_and_says_what_was_cut(store: S3Store, tmp_path: Path) -> None:
    code, _ = run_entrypoint(
        tmp_path,
        ["sh", "-c", "printf 'abcdefghijklmnopqrstuvwxyz'"],
        POSTTRAIN_SANDBOX_LOG_LIMIT="10",
        POSTTRAIN_SANDBOX_LOGS_URL=put_url(store, "limit/logs.txt"),
    )
    assert code == 0
    assert store.get_bytes("limit/logs.txt") == (
        b"abcdefghij\n[posttrain: 16 more byte(s) not kept]\n"
    )


def test_failed_upload_is_reported_not_fatal(tmp_path: Path) -> None:
    # Nothing listens on port 9 (discard): the PUT fails, the result says so.
    code, result = run_entrypoint(
        tmp_path, ["true"], POSTTRAIN_SANDBOX_LOGS_URL="http://127.0.0.1:9/x"
    )
    assert code == 0 and result["logs_uploaded"] is False and result["reason"] == "Completed"


def test_restore_skips_members_that_escape_the_workdir(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in (("ok/a.txt", b"a"), ("../evil.txt", b"x"), ("/abs.txt", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("link")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    workdir = tmp_path / "w"
    workdir.mkdir()
    assert task_entrypoint.restore(buffer.getvalue(), workdir) == 1
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "w",
        "w/ok",
        "w/ok/a.txt",
    ]


@pytest.mark.minio
def test_presigned_url_is_the_only_grant(minio_env: dict[str, str]) -> None:
    """A URL signed for one key cannot be reused for another (what the untrusted program
    could try with the URLs in its environment)."""
    store = s3_store_from_env(BUCKET, env=minio_env)
    url = put_url(store, "only/this.txt")
    forged = url.replace("only/this.txt", "only/other.txt")
    request = urllib.request.Request(forged, data=b"x", method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 403
    assert not store.exists("only/other.txt")


def storing_task(**spec: Any) -> SandboxTask:
    return SandboxTask.model_validate(
        {
            "metadata": {"name": "t", "namespace": "ns", "uid": "u"},
            "spec": {
                "command": ["python3", "main.py"],
                "files": {"main.py": "print(1)"},
                "timeoutSeconds": 40,
                **spec,
            },
        }
    )


def test_storing_pod_wraps_the_command_and_mounts_the_entrypoint_read_only() -> None:
    config = OperatorConfig(sandbox_artifacts_uri="s3://bkt/p", sandbox_upload_grace_seconds=20)
    artifacts = sandbox_builders.SandboxArtifacts(
        logs_uri="s3://b/p/ns/t/1/logs.txt",
        logs_url="http://l",
        snapshot_uri="s3://b/p/ns/t/1/snapshot.tar",
        snapshot_url="http://s",
        restore_url="http://r",
    )
    pod = sandbox_builders.build_sandbox_pod(
        storing_task(snapshot=True), config, 1, artifacts=artifacts
    )
    (container,) = pod["spec"]["containers"]
    assert container["command"] == [
        "python3",
        "/sandbox/entrypoint/entrypoint.py",
        "--",
        "python3",
        "main.py",
    ]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (
        env["POSTTRAIN_SANDBOX_LOGS_URL"],
        env["POSTTRAIN_SANDBOX_SNAPSHOT_URL"],
        env["POSTTRAIN_SANDBOX_RESTORE_URL"],
    ) == ("http://l", "http://s", "http://r")
    assert env["POSTTRAIN_SANDBOX_TIMEOUT"] == "40"
    assert pod["spec"]["activeDeadlineSeconds"] == 60
    mount = next(m for m in container["volumeMounts"] if m["name"] == "entrypoint")
    assert mount == {"name": "entrypoint", "mountPath": "/sandbox/entrypoint", "readOnly": True}
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "entrypoint")
    assert volume["configMap"]["name"] == b.sandbox_entrypoint_config_map_name()
    annotations = pod["metadata"]["annotations"]
    assert annotations[api_labels.ANNOTATION_LOGS_URI] == artifacts.logs_uri
    assert annotations[api_labels.ANNOTATION_SNAPSHOT_URI] == artifacts.snapshot_uri
    # Without artifacts nothing changes: the program is the container's command.
    plain = sandbox_builders.build_sandbox_pod(storing_task(), config, 1)
    assert plain["spec"]["containers"][0]["command"] == ["python3", "main.py"]
    assert plain["spec"]["activeDeadlineSeconds"] == 40


def test_entrypoint_config_map_is_named_by_its_content() -> None:
    config_map = b.build_sandbox_entrypoint_config_map("ns")
    assert config_map["data"]["entrypoint.py"] == ENTRYPOINT.read_text()
    assert config_map["metadata"]["name"] == (
        f"posttrain-sandbox-entrypoint-{shared_builders.spec_hash(ENTRYPOINT.read_text())[:10]}"
    )
    assert "ownerReferences" not in config_map["metadata"]  # shared by the namespace's tasks


def test_result_uris_come_from_the_pod_only_when_the_upload_worked() -> None:
    annotations = {
        api_labels.ANNOTATION_LOGS_URI: "s3://b/l",
        api_labels.ANNOTATION_SNAPSHOT_URI: "s3://b/s",
    }

    def result(message: str) -> tuple[str | None, str | None]:
        pod = PodView(
            "t-1", {}, annotations, phase="Succeeded", terminated=Terminated(0, message=message)
        )
        parsed = parse_sandbox_result(pod)
        return parsed.logs_uri, parsed.snapshot_uri

    ok = '{"exit_code": 0, "logs_uploaded": true, "snapshot_uploaded": true}'
    assert result(ok) == ("s3://b/l", "s3://b/s")
    assert result('{"exit_code": 0, "logs_uploaded": true, "snapshot_uploaded": false}') == (
        "s3://b/l",
        None,
    )
    assert result("plain crash text") == (None, None)
