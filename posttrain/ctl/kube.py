"""The cluster side of the ``posttrain`` user commands: which kubeconfig, which kind,
which namespace, and API errors turned into messages a person can act on.

The commands stay thin over the Kubernetes API, so everything here is either a pure
helper (kind aliases, kubeconfig order) or a one-line wrapper around the official
client; there is no cache or second source of truth between the user and the apiserver.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.api.base import GROUP, VERSION

# The label keys the operator writes (api/labels.py), so the CLI finds exactly the
# pods and jobs the operator builds.
from posttrain.api.labels import (
    COMPONENT_TRAINER,
    LABEL_COMPONENT,
    LABEL_POOL,
    LABEL_RUN,
    LABEL_TASK,
    LABEL_WARM_POOL,
)
from posttrain.ctl.parsers import KIND_CHOICES  # written out there: --help imports no kinds
from posttrain.errors import UsageError

TRAINER_CONTAINER = "trainer"


@dataclass(frozen=True)
class Kind:
    """One posttrain resource type as the apiserver and the user name it."""

    kind: str
    plural: str
    singular: str
    short: str

    @property
    def qualified(self) -> str:
        """The ``kubectl``-style name printed by apply: ``trainingrun.posttrain.io``."""
        return f"{self.singular}.{GROUP}"


TRAINING_RUN = Kind("TrainingRun", "trainingruns", "trainingrun", "tr")
ROLLOUT_POOL = Kind("RolloutPool", "rolloutpools", "rolloutpool", "rp")
SANDBOX_TASK = Kind("SandboxTask", "sandboxtasks", "sandboxtask", "st")
SANDBOX_WARM_POOL = Kind("SandboxWarmPool", "sandboxwarmpools", "sandboxwarmpool", "swp")
KINDS: tuple[Kind, ...] = (TRAINING_RUN, ROLLOUT_POOL, SANDBOX_TASK, SANDBOX_WARM_POOL)


def child_selector(kind: Kind, name: str) -> str:
    """The label selector of the pods and jobs an object of ``kind`` named ``name`` owns.

    >>> child_selector(TRAINING_RUN, "demo"), child_selector(SANDBOX_WARM_POOL, "py")
    ('posttrain.io/run=demo', 'posttrain.io/warm-pool=py')
    """
    label = {
        TRAINING_RUN: LABEL_RUN,
        ROLLOUT_POOL: LABEL_POOL,
        SANDBOX_TASK: LABEL_TASK,
        SANDBOX_WARM_POOL: LABEL_WARM_POOL,
    }[kind]
    return f"{label}={name}"


def trainer_selector(run_name: str) -> str:
    """Label selector of a run's trainer pods (every rank).

    >>> trainer_selector("demo")
    'posttrain.io/component=trainer,posttrain.io/run=demo'
    """
    return f"{LABEL_COMPONENT}={COMPONENT_TRAINER},{LABEL_RUN}={run_name}"


def resolve_kind(word: str) -> Kind:
    """The kind a user typed, accepting the same names kubectl does.

    >>> resolve_kind("tr").kind, resolve_kind("TrainingRuns").plural
    ('TrainingRun', 'trainingruns')
    >>> resolve_kind("trainingrun.posttrain.io").short
    'tr'
    """
    lowered = word.lower().removesuffix(f".{GROUP}")
    for kind in KINDS:
        if lowered in (kind.short, kind.singular, kind.plural, kind.kind.lower()):
            return kind
    raise UsageError(f"unknown resource type {word!r}; expected {KIND_CHOICES}")


def kind_by_name(kind_name: str) -> Kind:
    """The Kind for a manifest's ``kind`` field (``TrainingRun``)."""
    for kind in KINDS:
        if kind.kind == kind_name:
            return kind
    raise UsageError(f"unknown kind {kind_name!r}; expected one of {[k.kind for k in KINDS]}")


def dev_state_kubeconfig() -> Path | None:
    """The kubeconfig recorded by ``posttrain dev up`` (None when no dev env was started)."""
    from posttrain.devenv.cli import state_dir

    state = state_dir() / "state.json"
    if not state.is_file():
        return None
    try:
        return Path(json.loads(state.read_text())["kubeconfig"])
    except (ValueError, KeyError):
        return None


def find_kubeconfig(explicit: str | None, environ: dict[str, str] | None = None) -> Path:
    """The kubeconfig to use: --kubeconfig, $KUBECONFIG, the dev state file, ~/.kube/config.

    $KUBECONFIG may list several files (``a:b``); the first one that exists is used.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile() as f:
    ...     find_kubeconfig(None, {"KUBECONFIG": f"/absent:{f.name}"}) == Path(f.name)
    True
    """
    env = os.environ if environ is None else environ
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise UsageError(f"--kubeconfig {explicit}: no such file")
        return path
    tried: list[str] = []
    for entry in env.get("KUBECONFIG", "").split(os.pathsep):
        if entry.strip():
            path = Path(entry).expanduser()
            if path.is_file():
                return path
            tried.append(f"$KUBECONFIG entry {entry}")
    dev = dev_state_kubeconfig()
    if dev is not None and dev.is_file():
        return dev
    if dev is not None:
        tried.append(f"dev environment kubeconfig {dev}")
    home = Path(env.get("HOME", str(Path.home()))) / ".kube" / "config"
    if home.is_file():
        return home
    tried.append(str(home))
    raise UsageError(
        "no kubeconfig found (tried: " + ", ".join(tried) + "); pass --kubeconfig FILE, "
        "set $KUBECONFIG, or start a local cluster with `posttrain dev up`"
    )


@dataclass
class Cluster:
    """A logged-in API client plus the namespace the command works in."""

    api_client: Any
    namespace: str
    kubeconfig: Path

    @property
    def custom(self) -> Any:
        from kubernetes import client

        return client.CustomObjectsApi(self.api_client)

    @property
    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    @property
    def batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.api_client)

    @property
    def server(self) -> str:
        return str(self.api_client.configuration.host)

    def get(self, kind: Kind, name: str, namespace: str | None = None) -> dict[str, Any]:
        """One object as a dict; a missing one is a clean exit-1 error, not a traceback."""
        namespace = namespace or self.namespace
        try:
            return self.custom.get_namespaced_custom_object(  # type: ignore[no-any-return]
                GROUP, VERSION, namespace, kind.plural, name
            )
        except Exception as exc:
            raise api_failure(exc, f"{kind.singular} {name!r} in namespace {namespace!r}") from None

    def list(self, kind: Kind, all_namespaces: bool = False) -> list[dict[str, Any]]:
        """Every object of ``kind`` in the namespace (or all namespaces), sorted by name."""
        try:
            if all_namespaces:
                result = self.custom.list_cluster_custom_object(GROUP, VERSION, kind.plural)
            else:
                result = self.custom.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, kind.plural
                )
        except Exception as exc:
            raise api_failure(exc, f"{kind.plural}") from None
        items: list[dict[str, Any]] = result.get("items", [])
        return sorted(
            items, key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"])
        )


class CommandFailed(Exception):
    """The command could not do its work (exit 1): not found, unreachable, rejected."""


def api_failure(exc: Exception, what: str) -> Exception:
    """Turn a client exception into a message naming the object and a next step.

    >>> from kubernetes.client.rest import ApiException
    >>> str(api_failure(ApiException(status=404, reason="Not Found"), "trainingrun 'x'"))
    "trainingrun 'x' not found (posttrain get tr lists what exists)"
    """
    from kubernetes.client.rest import ApiException

    if isinstance(exc, ApiException):
        if exc.status == 404:
            if "the server could not find the requested resource" in str(exc.body or ""):
                return CommandFailed(
                    f"{what}: the posttrain CRDs are not installed on this cluster; "
                    "install them with `kubectl apply --server-side -f crds/` or the Helm chart"
                )
            return CommandFailed(f"{what} not found (posttrain get tr lists what exists)")
        return CommandFailed(f"{what}: the apiserver said {exc.status} {server_message(exc)}")
    if isinstance(exc, CommandFailed | UsageError):
        return exc
    reason = getattr(exc, "reason", None) or exc  # urllib3's MaxRetryError wraps the cause
    return CommandFailed(
        f"{what}: cannot reach the apiserver ({reason}); is the cluster running? "
        "(`posttrain dev status`, or check --kubeconfig / --context)"
    )


def server_message(exc: Any) -> str:
    """The ``message`` of a Status body, else the HTTP reason.

    >>> class E: body = '{"kind": "Status", "message": "spec.x: Invalid"}'; reason = "Bad"
    >>> server_message(E())
    'spec.x: Invalid'
    """
    try:
        body = json.loads(exc.body or "{}")
        return str(body.get("message") or exc.reason)
    except (TypeError, ValueError):
        return str(exc.reason)


def connect(kubeconfig: str | None, namespace: str | None, context: str | None = None) -> Cluster:
    """Log in with the resolved kubeconfig; namespace: -n, else the context's, else default."""
    from kubernetes import config

    # urllib3 logs a warning per connection retry; the one error message below says it all.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    path = find_kubeconfig(kubeconfig)
    try:
        api_client = config.new_client_from_config(config_file=str(path), context=context)
        contexts, current = config.list_kube_config_contexts(config_file=str(path))
    except config.ConfigException as exc:
        raise UsageError(f"kubeconfig {path} is not usable: {exc}") from None
    active = next((c for c in contexts if c["name"] == context), current) if context else current
    context_namespace = (active or {}).get("context", {}).get("namespace")
    return Cluster(api_client, namespace or context_namespace or "default", path)
