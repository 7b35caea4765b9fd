"""Helpers for the user-command tests: run ``posttrain`` in-process against the session's
real control plane, and write TrainingRuns / status the way the operator and trainer do.

Test modules are imported with importlib (no package), so helpers are fixtures here.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from posttrain.api.base import GROUP, VERSION
from posttrain.cli import main


@dataclass
class CliResult:
    code: int
    out: str
    err: str


CliRunner = Callable[..., CliResult]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """``cli("get", "tr")`` -> exit code, stdout, stderr of the real CLI entry point."""
    monkeypatch.setenv("COLUMNS", "220")  # tables unwrapped, whatever the test terminal is

    def run(*args: str) -> CliResult:
        capsys.readouterr()  # drop anything printed before this command
        code = main(list(args))
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture
def kcli(cli: CliRunner, kubeconfig: Path, namespace: str, crds_installed: None) -> CliRunner:
    """The CLI pointed at the test cluster and the test's fresh namespace."""

    def run(command: str, *args: str) -> CliResult:
        return cli(command, "--kubeconfig", str(kubeconfig), "-n", namespace, *args)

    return run


def run_manifest(
    name: str, domains: tuple[str, ...] = ("arith", "code"), max_steps: int = 3
) -> dict[str, Any]:
    """A small valid TrainingRun document."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingRun",
        "metadata": {"name": name},
        "spec": {
            "model": "smollm2-135m-instruct",
            "algorithm": {"name": "grpo", "groupSize": 4, "maxSteps": max_steps},
            "domains": [
                {
                    "name": d,
                    "dataset": f"builtin:{d}",
                    "verifier": {"kind": "numeric"},
                    "weight": float(i + 1),
                }
                for i, d in enumerate(domains)
            ],
        },
    }


class Kube:
    """Write objects and status into one namespace the way each component does."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    run_manifest = staticmethod(run_manifest)

    def create_run(self, name: str, **kwargs: Any) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, "trainingruns", run_manifest(name, **kwargs)
        )

    def get_run(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
            GROUP, VERSION, self.namespace, "trainingruns", name
        )

    def run_names(self) -> list[str]:
        items = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "trainingruns"
        )["items"]
        return sorted(i["metadata"]["name"] for i in items)

    def report_progress(self, name: str, **fields: Any) -> None:
        """Patch /status through the trainer's own reporter (RunStatus -> merge patch); a
        ``phase`` is written as the operator writes it (the trainer never sends one)."""
        from posttrain.trainer.observe.status import KubeStatusReporter, RunStatus

        KubeStatusReporter(name, self.namespace, api=self.custom).report(RunStatus(**fields))
        if "phase" in fields:
            self.patch_status(name, {"phase": fields["phase"]})

    def patch_status(self, name: str, status: dict[str, Any]) -> None:
        """Merge-patch fields the operator owns (phase, conditions) into /status."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, "trainingruns", name, {"status": status}
        )

    def post_event(
        self, run: dict[str, Any], reason: str, message: str, type_: str = "Normal"
    ) -> None:
        """A core/v1 Event about the run, shaped like the ones the operator posts (events.py)."""
        from datetime import UTC, datetime

        from kubernetes import client

        now = datetime.now(UTC)
        meta = run["metadata"]
        self.core.create_namespaced_event(
            self.namespace,
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}."),
                involved_object=client.V1ObjectReference(
                    api_version=f"{GROUP}/{VERSION}",
                    kind="TrainingRun",
                    name=meta["name"],
                    namespace=self.namespace,
                    uid=meta["uid"],
                ),
                reason=reason,
                message=message,
                type=type_,
                source=client.V1EventSource(component="posttrain-operator"),
                first_timestamp=now,
                last_timestamp=now,
                count=1,
            ),
        )


@pytest.fixture
def kube(kube_api: Any, namespace: str, crds_installed: None) -> Kube:
    return Kube(kube_api, namespace)


class FakeKubelet:
    """The kubelet's log endpoint, so ``posttrain logs`` reads through the real apiserver.

    The test cluster has no kubelet; the apiserver proxies ``pods/log`` to the node's
    kubelet over HTTPS, so this serves ``/containerLogs/<ns>/<pod>/<container>`` on
    loopback behind a Node object that points at it. ``follow=true`` streams the lines
    with a pause between them (the apiserver passes each chunk straight through).
    """

    def __init__(self, workdir: Path) -> None:
        from posttrain.devenv.certs import make_pki

        self.logs: dict[tuple[str, str, str], list[str]] = {}
        self.requests: list[str] = []
        kubelet = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                kubelet.requests.append(self.path)
                parts = url.path.strip("/").split("/")
                lines = kubelet.logs.get(tuple(parts[1:4]))  # type: ignore[arg-type]
                if parts[0] != "containerLogs" or lines is None:
                    self.send_error(404, "no such container")
                    return
                query = parse_qs(url.query)
                if "tailLines" in query:
                    lines = lines[-int(query["tailLines"][0]) :]
                follow = query.get("follow") == ["true"]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                for line in lines:
                    self.wfile.write(line.encode() + b"\n")
                    self.wfile.flush()
                    if follow:
                        time.sleep(0.2)

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        pki = make_pki(workdir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.serving_cert, pki.serving_key)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="session")
def fake_kubelet_node(
    kube_api: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, FakeKubelet]]:
    """(node name, FakeKubelet): a Node whose kubelet endpoint is the fake one."""
    import uuid

    from kubernetes import client

    kubelet = FakeKubelet(tmp_path_factory.mktemp("kubelet-pki"))
    core = client.CoreV1Api(kube_api)
    name = f"fake-node-{uuid.uuid4().hex[:6]}"
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    core.patch_node_status(
        name,
        {
            "status": {
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet.port}},
            }
        },
    )
    yield name, kubelet
    core.delete_node(name)
    kubelet.stop()
