"""The operator image: its entrypoint answers, and the chart's operator container reconciles."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from posttrain.devenv.process import free_port

from .podman import PodContainer, image_ref, run_simple, start

IMAGES = ("operator", "trainer")  # what images_built checks

pytestmark = [pytest.mark.images, pytest.mark.cluster, pytest.mark.usefixtures("images_built")]


def test_entrypoint_answers_help_as_non_root_on_a_read_only_root() -> None:
    result = run_simple(image_ref("operator"), ["--help"], extra=["--read-only"])
    assert result.returncode == 0, result.stderr
    assert "usage: posttrain" in result.stdout
    whoami = run_simple(image_ref("operator"), [], extra=["--entrypoint", "id"])
    assert whoami.stdout.startswith("uid=10001"), whoami.stdout


def _rendered_chart(helm_bin: Path, health_port: int) -> dict[tuple[str, str], dict[str, Any]]:
    rendered = subprocess.run(
        [
            str(helm_bin), "template", "smoke", "charts/posttrain", "--namespace", "posttrain",
            "--set", "operator.leaderElection.enabled=false",
            "--set", f"operator.healthPort={health_port}",
            "--set", "metrics.enabled=false",
            # No MinIO runs here to mint per-run users in (test_storage_credentials_cluster).
            "--set", "storage.scopedCredentials=false",
        ],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}


def test_the_charts_operator_container_reconciles_against_the_apiserver(
    helm_bin: Path, kubeconfig: Path, kube_api: Any, crds_installed: None, namespace: str,
    workdir: Path,
) -> None:  # fmt: skip
    """The chart's exact container (command, env from its ConfigMap, read-only root, uid 10001,
    no capabilities) connects to the apiserver and turns a RolloutPool into its Deployment."""
    from kubernetes import client

    health_port = free_port()
    docs = _rendered_chart(helm_bin, health_port)
    deployment = docs[("Deployment", "smoke-posttrain-operator")]
    config_map = docs[("ConfigMap", "smoke-posttrain-operator")]
    pod_spec = deployment["spec"]["template"]["spec"]
    s3_secret = next(v["secret"]["secretName"] for v in pod_spec["volumes"] if "secret" in v)
    pod = PodContainer(
        pod_spec=pod_spec,
        container_name="operator",
        field_refs={"metadata.name": "smoke-operator-0"},
        config_maps={"smoke-posttrain-operator": config_map["data"]},
        secrets={
            (s3_secret, "AWS_ACCESS_KEY_ID"): "unused",
            (s3_secret, "AWS_SECRET_ACCESS_KEY"): "unused",
        },
        kubeconfig=kubeconfig,
    )
    running = start(pod, image_ref("operator"), workdir)
    try:
        pool = {
            "apiVersion": "posttrain.io/v1alpha1",
            "kind": "RolloutPool",
            "metadata": {"name": "smoke-pool", "namespace": namespace},
            "spec": {"model": "smollm2-135m-instruct", "engine": "cpu", "replicas": 1},
        }
        client.CustomObjectsApi(kube_api).create_namespaced_custom_object(
            "posttrain.io", "v1alpha1", namespace, "rolloutpools", pool
        )
        apps = client.AppsV1Api(kube_api)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            found = apps.list_namespaced_deployment(namespace).items
            if found:
                break
            assert running.exit_code() is None, f"the operator exited:\n{running.logs()}"
            time.sleep(1)
        else:
            pytest.fail(f"no Deployment for the pool after 120 s; operator log:\n{running.logs()}")
        container = found[0].spec.template.spec.containers[0]
        # The chart's images reach the pods the operator creates.
        assert container.image == image_ref("trainer"), container.image
        # The operator's health endpoint, which the chart's probes read, answers from the container.
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/healthz", timeout=10) as r:
            assert r.status == 200
    finally:
        running.stop()
