"""The sandbox image: the runner pod the operator builds serves hostile programs in bubblewrap."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from posttrain.api.manifests import parse_resource
from posttrain.operator.config import OperatorConfig
from posttrain.operator.trainingrun import sandbox_runner

from .podman import PodContainer, image_ref, run_simple, start

IMAGES = ("sandbox",)  # what images_built checks

pytestmark = [pytest.mark.images, pytest.mark.usefixtures("images_built")]

RUN = {
    "apiVersion": "posttrain.io/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "smoke", "namespace": "default", "uid": "u-1"},
    "spec": {
        "model": "smollm2-135m-instruct",
        "domains": [
            {"name": "code", "dataset": "builtin:code", "verifier": {"kind": "unit_tests"}}
        ],
        "sandbox": {"mode": "runner", "maxConcurrency": 2},
    },
}

# Each program tries one escape; the runner must contain it and report what happened.
HOSTILE: dict[str, tuple[str, dict[str, Any]]] = {
    "reach the host's loopback": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
        {"status": "error"},
    ),
    "write the image": (
        "open('/opt/posttrain/pwned', 'w').write('x')",
        {"status": "error"},
    ),
    "fork bomb": (
        "import os\nwhile True:\n    os.fork()",
        {"status": {"killed", "error", "timeout"}},
    ),
    "memory hog": (
        "b = []\nwhile True:\n    b.append(bytearray(16 << 20))",
        {"status": {"oom", "killed"}},
    ),
    "never ends": ("while True:\n    pass", {"status": "timeout"}),
}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())  # type: ignore[no-any-return]


def test_runner_pod_contains_hostile_programs(workdir: Path) -> None:
    run = parse_resource(RUN)
    deployment = sandbox_runner.build_runner_deployment(run, OperatorConfig())  # type: ignore[arg-type]
    pod = PodContainer(
        pod_spec=deployment["spec"]["template"]["spec"],
        container_name="runner",
        field_refs={"status.podIP": "127.0.0.1"},
    )
    running = start(pod, image_ref("sandbox"), workdir)
    base = f"http://127.0.0.1:{sandbox_runner.SANDBOX_RUNNER_PORT}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert running.exit_code() is None, f"runner exited:\n{running.logs()}"
                assert time.monotonic() < deadline, f"runner not healthy:\n{running.logs()}"
                time.sleep(0.5)
        honest = _post(f"{base}/v1/exec", {"command": ["python3", "-c", "print(6 * 7)"]})
        assert honest["status"] == "ok" and honest["stdout"] == "42\n", honest
        # A port that listens on the host's loopback, which the container shares.
        health_port = sandbox_runner.SANDBOX_RUNNER_PORT
        for what, (source, expected) in HOSTILE.items():
            result = _post(
                f"{base}/v1/exec",
                {
                    "command": ["python3", "-c", source.format(port=health_port)],
                    "timeout_s": 5,
                    "memory_mb": 256,
                },
            )
            allowed = expected["status"]
            allowed = allowed if isinstance(allowed, set) else {allowed}
            assert result["status"] in allowed, (what, result)
            assert "connected" not in result["stdout"], (what, result)
        # Nothing a program wrote reached the image.
        assert "pwned" not in running.logs()
    finally:
        running.stop()


def test_image_serves_as_sandbox_task_image_and_file_copier() -> None:
    """SandboxTask pods default to this image for the program and the file-copy step."""
    result = run_simple(
        image_ref("sandbox"),
        ["-c", "import sys; print(sys.version_info[:2])"],
        extra=["--read-only", "--user", "65534:65534", "--entrypoint", "python3"],
    )
    assert result.returncode == 0 and result.stdout.strip() == "(3, 11)", result
    copier = run_simple(image_ref("sandbox"), ["--version"], extra=["--entrypoint", "cp"])
    assert copier.returncode == 0 and "coreutils" in copier.stdout, copier
