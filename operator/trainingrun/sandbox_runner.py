"""Builders for a run's own sandbox runner and for what ``spec.sandbox`` asks of the trainer.

``sandbox.mode: runner`` without ``runnerUrl``: the operator runs ``posttrain sandbox serve``
for the run, as a Deployment ``<run>-sandbox-runner`` behind a Service of that name, and hands
the Service URL to the trainer (``$POSTTRAIN_SANDBOX_RUNNER_URL``). Its pods hold no
ServiceAccount token, run as nobody with every capability dropped and no way to escalate, and
a NetworkPolicy lets only the run's trainer pods in and nothing out. Bubblewrap inside them
needs two things the Pod Security "restricted" profile does not give, and only those: a
seccomp profile that allows creating user namespaces (Unconfined: the default profiles refuse
``clone(CLONE_NEWUSER)``) and an unmasked ``/proc`` inside the pod's own user namespace
(``procMount: Unmasked`` with ``hostUsers: false``), so bwrap can mount a fresh ``/proc``.

``sandbox.mode: local`` runs bubblewrap inside the trainer itself, so a trainer pod whose
domains execute code gets the same two relaxations; ``task`` gives the trainer the right to
create SandboxTasks in its namespace instead.
"""

from __future__ import annotations

from typing import Any

from posttrain.api import TrainingRun

from ..config import OperatorConfig
from ..shared.builders import apply_sandbox_runtime, child_metadata, resources

Manifest = dict[str, Any]

COMPONENT_SANDBOX_RUNNER = "sandbox-runner"
SANDBOX_RUNNER_PORT = 8090
EXECUTION_VERIFIERS = frozenset({"unit_tests", "shell"})
# Builtin datasets whose tasks carry their own execution verifier when the domain names none.
EXECUTING_BUILTINS = frozenset({"builtin:code"})
# The SandboxTasks a task-mode trainer creates, reads and deletes (no resourceNames: their
# names are not known in advance; only SandboxTasks, only in the run's namespace).
TRAINER_TASK_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["posttrain.io"],
        "resources": ["sandboxtasks"],
        "verbs": ["get", "create", "delete"],
    },
]


def runner_name(run: TrainingRun) -> str:
    """``<run>-sandbox-runner``.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> runner_name(_example_run())
    'demo-sandbox-runner'
    """
    return f"{run.metadata.name}-sandbox-runner"


def needs_own_runner(run: TrainingRun) -> bool:
    """mode runner with no runnerUrl: the operator runs the runner."""
    sandbox = run.spec.sandbox
    return sandbox.mode == "runner" and not sandbox.runner_url


def runner_url(run: TrainingRun) -> str:
    """The in-cluster URL of the run's own runner."""
    return f"http://{runner_name(run)}.{run.metadata.namespace}.svc:{SANDBOX_RUNNER_PORT}"


def executes_code(run: TrainingRun) -> bool:
    """Whether any domain runs model output: a verifier that executes the completion
    (unit_tests, shell), an executing builtin dataset, or a terminal environment (its
    commands run in the sandbox)."""
    return any(
        (d.verifier is not None and d.verifier.kind in EXECUTION_VERIFIERS)
        or d.dataset in EXECUTING_BUILTINS
        or (d.environment is not None and d.environment.kind == "terminal")
        for d in run.spec.domains
    )


def bubblewrap_container_context(run_as_nobody: bool) -> Manifest:
    """What bubblewrap needs of a container, and nothing more (module docstring)."""
    context: Manifest = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "Unconfined"},
        "procMount": "Unmasked",
    }
    if run_as_nobody:
        context.update(runAsNonRoot=True, runAsUser=65534, runAsGroup=65534)
    return context


def own_runner_url(run: TrainingRun) -> str | None:
    """The runner URL the trainer's contract carries: the operator's own runner, if any."""
    return runner_url(run) if needs_own_runner(run) else None


def apply_local_sandbox_context(run: TrainingRun, pod_spec: Manifest) -> None:
    """mode local with code-executing domains: the trainer container can run bubblewrap."""
    if run.spec.sandbox.mode != "local" or not executes_code(run):
        return
    pod_spec["hostUsers"] = False
    container = pod_spec["containers"][0]
    container["securityContext"] = {
        **container.get("securityContext", {}),
        **bubblewrap_container_context(run_as_nobody=False),
    }


def _labels(run: TrainingRun) -> dict[str, str]:
    from posttrain.api.labels import LABEL_COMPONENT, LABEL_RUN

    return {LABEL_COMPONENT: COMPONENT_SANDBOX_RUNNER, LABEL_RUN: run.metadata.name}


def runner_limit_args(run: TrainingRun) -> list[str]:
    """``posttrain sandbox serve`` flags that make ``spec.sandbox`` the runner's own policy, so
    the runner refuses what the run's trainer would never send (it caps requests to the same
    values). No ``--allow-host-network``: the runner's NetworkPolicy lets nothing out anyway.

    >>> from posttrain.operator.trainingrun.names import _example_run
    >>> runner_limit_args(_example_run())
    ['--max-timeout-s', '60.0', '--max-memory-mb', '512']
    """
    sandbox = run.spec.sandbox
    # str(float) round-trips exactly: a rounded cap could fall below what the trainer sends.
    return [
        *("--max-timeout-s", str(float(sandbox.timeout_seconds))),
        *("--max-memory-mb", str(sandbox.memory_mb)),
    ]


def build_runner_deployment(run: TrainingRun, config: OperatorConfig) -> Manifest:
    """The run's sandbox runner: one replica with ``maxConcurrency`` slots."""
    sandbox = run.spec.sandbox
    slots = sandbox.max_concurrency
    labels = _labels(run)
    # Each slot may hold memoryMb of address space; the server itself needs a little more.
    memory = f"{slots * sandbox.memory_mb + 256}Mi"
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostUsers": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "fsGroup": 65534,
        },
        "containers": [
            {
                "name": "runner",
                "image": config.sandbox_runner_image,
                "imagePullPolicy": config.image_pull_policy,
                "command": [
                    "posttrain",
                    "sandbox",
                    "serve",
                    "--host",
                    "$(POD_IP)",
                    "--port",
                    str(SANDBOX_RUNNER_PORT),
                    *runner_limit_args(run),
                    "--concurrency",
                    str(slots),
                ],
                "env": [
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
                ],
                "ports": [{"name": "http", "containerPort": SANDBOX_RUNNER_PORT}],
                "readinessProbe": {
                    "httpGet": {"path": "/health", "port": SANDBOX_RUNNER_PORT},
                    "periodSeconds": 2,
                },
                "resources": resources(str(slots), memory),
                "securityContext": bubblewrap_container_context(run_as_nobody=True),
            }
        ],
    }
    apply_sandbox_runtime(pod_spec, sandbox.runtime_class_name, config)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(run, runner_name(run), labels),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


def build_runner_service(run: TrainingRun) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(run, runner_name(run), _labels(run)),
        "spec": {
            "selector": _labels(run),
            "ports": [
                {"name": "http", "port": SANDBOX_RUNNER_PORT, "targetPort": SANDBOX_RUNNER_PORT}
            ],
        },
    }


def build_runner_network_policy(run: TrainingRun) -> Manifest:
    """Only this run's trainer pods may reach the runner; the runner reaches nothing."""
    from posttrain.api.labels import COMPONENT_TRAINER, LABEL_COMPONENT, LABEL_RUN

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(run, runner_name(run), _labels(run)),
        "spec": {
            "podSelector": {"matchLabels": _labels(run)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {
                    "from": [
                        {
                            "podSelector": {
                                "matchLabels": {
                                    LABEL_COMPONENT: COMPONENT_TRAINER,
                                    LABEL_RUN: run.metadata.name,
                                }
                            }
                        }
                    ],
                    "ports": [{"port": SANDBOX_RUNNER_PORT}],
                }
            ],
        },
    }


def build_runner_children(run: TrainingRun, config: OperatorConfig) -> list[Manifest]:
    """What mode runner without runnerUrl adds to the run's children (else nothing)."""
    if not needs_own_runner(run):
        return []
    return [
        build_runner_network_policy(run),
        build_runner_service(run),
        build_runner_deployment(run, config),
    ]


def trainer_rbac_rules(run: TrainingRun) -> list[dict[str, Any]]:
    """Rules the trainer's Role needs for its sandbox mode, beyond its own run's status."""
    return [dict(rule) for rule in TRAINER_TASK_RULES] if run.spec.sandbox.mode == "task" else []
