"""The argparse side of ``posttrain apply | get | describe | watch | logs | report``.

Kept apart from the commands so that ``posttrain get --help`` imports argparse and nothing
else: a command's own module (the pydantic API models, rich, the Kubernetes client, the
trainer's plotting) is imported by :func:`runs` only when the command is run.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

# Server-side apply's field manager: the owner of the fields a user sets with `posttrain apply`.
FIELD_MANAGER = "posttrain"
KIND_CHOICES = (
    "tr|rp|st|swp (or trainingrun(s), rolloutpool(s), sandboxtask(s), sandboxwarmpool(s))"
)
OUTPUT_FORMATS = ("table", "json", "yaml")


def runs(module: str, function: str) -> Callable[[argparse.Namespace], int]:
    """The handler ``posttrain.ctl.<module>.<function>``, imported when the command runs.

    >>> runs("commands", "get_command").__name__
    'get_command'
    """

    def run(args: argparse.Namespace) -> int:
        handler = getattr(importlib.import_module(f"posttrain.ctl.{module}"), function)
        return int(handler(args))

    run.__name__ = run.__qualname__ = function
    return run


def _cluster_flags() -> argparse.ArgumentParser:
    """Flags every cluster command shares (same names and meaning as kubectl)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig to use (default: $KUBECONFIG, then the `posttrain dev up` cluster, "
        "then ~/.kube/config)",
    )
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument(
        "-n", "--namespace", help="namespace (default: the context's namespace, else 'default')"
    )
    return common


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add apply, get, describe, watch, logs and report to the ``posttrain`` CLI."""
    common = _cluster_flags()

    apply = sub.add_parser(
        "apply",
        parents=[common],
        help="validate manifests locally, then server-side apply them",
        description="Validate every TrainingRun, RolloutPool, SandboxTask and SandboxWarmPool "
        "in FILE or DIR with the API models (nothing is sent if any document is invalid), then "
        f"server-side apply each one with field manager {FIELD_MANAGER!r}.",
        epilog="example: posttrain apply -f examples/arith-code-run.yaml",
    )
    apply.add_argument(
        "-f",
        "--filename",
        action="append",
        required=True,
        metavar="FILE|DIR",
        help="manifest file, directory of *.yaml/*.yml/*.json, or - for stdin (repeatable)",
    )
    apply.add_argument(
        "--dry-run",
        action="store_true",
        help="server-side dry run: validated and admitted by the apiserver, not persisted",
    )
    apply.add_argument(
        "--force-conflicts",
        action="store_true",
        help="take ownership of fields another manager (e.g. kubectl) set",
    )
    apply.set_defaults(func=runs("commands", "apply_command"))

    get = sub.add_parser(
        "get",
        parents=[common],
        help="list runs, pools and tasks with their progress",
        description="A table of TrainingRuns (phase, step/max, reward, per-domain reward, eval "
        "accuracy, last checkpoint), RolloutPools (ready/desired, weights version), "
        "SandboxTasks (phase, reward, duration, exit code, reason) and SandboxWarmPools "
        "(ready/desired, claimed).",
        epilog="examples: posttrain get; posttrain get tr demo -o yaml; posttrain get rp -A",
    )
    get.add_argument("kind", nargs="?", default="all", help=f"{KIND_CHOICES} or all (default)")
    get.add_argument("name", nargs="?", help="one object's name (default: all of the kind)")
    get.add_argument("-A", "--all-namespaces", action="store_true", help="list every namespace")
    get.add_argument(
        "-o", "--output", choices=OUTPUT_FORMATS, default="table", help="output format"
    )
    get.set_defaults(func=runs("commands", "get_command"))

    describe = sub.add_parser(
        "describe",
        parents=[common],
        help="explain one object: spec, status, conditions, events, children",
        description="One screen that explains an object's state: spec summary, status figures, "
        "conditions with reasons and messages, recent Events, and the pods/jobs it owns.",
        epilog="example: posttrain describe tr demo",
    )
    describe.add_argument("kind", help=KIND_CHOICES)
    describe.add_argument("name", help="object name")
    describe.set_defaults(func=runs("commands", "describe_command"))

    watch = sub.add_parser(
        "watch",
        parents=[common],
        help="follow a run live until it Succeeds (exit 0) or Fails (exit 1)",
        description="A live table fed by the Kubernetes watch API (no polling): step, reward "
        "per domain, eval accuracy and checkpoint as the trainer reports them. Exit 0 when the "
        "run Succeeded, 1 when it Failed, was deleted, or --timeout passed.",
        epilog="example: posttrain watch tr demo --timeout 3600",
    )
    watch.add_argument("kind", help="tr (only TrainingRuns have progress to watch)")
    watch.add_argument("name", help="run name")
    watch.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS", help="give up after this long"
    )
    watch.set_defaults(func=runs("follow", "watch_command"))

    logs = sub.add_parser(
        "logs",
        parents=[common],
        help="print (or follow, -f) the trainer pod's logs",
        description="Find the run's trainer pod by its posttrain.io/run label and print its logs.",
        epilog="example: posttrain logs tr demo -f",
    )
    logs.add_argument("kind", help="tr")
    logs.add_argument("name", help="run name")
    logs.add_argument("-f", "--follow", action="store_true", help="stream new lines as they come")
    logs.add_argument("--tail", type=int, default=None, metavar="N", help="only the last N lines")
    logs.add_argument("-c", "--container", help="container (default: trainer, else the first)")
    logs.set_defaults(func=runs("follow", "logs_command"))

    report = sub.add_parser(
        "report",
        help="build an HTML or Markdown report with plots from a local run directory",
        description="Read what `posttrain run --local --out DIR` wrote (metrics.jsonl, eval/) and "
        "write one self-contained report: reward and held-out accuracy per domain, KL, response "
        "length, rollout throughput and, if recorded, the sandbox latency histogram.",
        epilog="example: posttrain report runs/local --out report.html",
    )
    report.add_argument(
        "run_dir",
        metavar="RUN_DIR|S3_URI",
        help="the run's --out directory, or where a cluster run uploads its outputs "
        "(status.reportsUri, shown by `posttrain describe tr NAME`: s3://BUCKET/runs/NS/NAME"
        "/UID/reports, or the run's prefix above it)",
    )
    report.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="FILE.html|FILE.md",
        help="report file; the suffix picks the format (default: RUN_DIR/report.html; for an "
        "s3:// URI, <run name>-report.html here)",
    )
    report.add_argument(
        "--manifest",
        type=Path,
        default=None,
        metavar="RUN.yaml",
        help="the run's TrainingRun manifest (its groupSize lets throughput be derived when "
        "metrics.jsonl has no tokens_per_s; default: RUN_DIR/run.yaml if present)",
    )
    report.set_defaults(func=runs("report", "report_command"))
