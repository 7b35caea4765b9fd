"""``posttrain operator`` (run the operator) and ``posttrain operator rbac``."""

from __future__ import annotations

import argparse
from typing import Any

from posttrain.api.env import OPERATOR_PREFIX


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator (TrainingRun, RolloutPool, SandboxTask)",
        description="Reconcile posttrain resources into pods, Deployments and Services. "
        f"Every flag can also be set as {OPERATOR_PREFIX}<FIELD> (see docs/operator.md).",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="namespace to watch (repeatable; default: default)",
    )
    where.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        default=None,
        help="watch every namespace (needs the ClusterRole bound cluster-wide)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        default=None,
        help="no leader election (single replica, tests)",
    )
    parser.add_argument(
        "--lease",
        "--peering",  # its name until Kopf's peering gave way to a Lease (docs/cli.md)
        dest="lease_name",
        metavar="NAME",
        default=None,
        help="Lease the replicas elect their leader on, in the operator's namespace "
        "(default posttrain-operator; --peering is its old name)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="P",
        help="serve Prometheus metrics on :P/metrics (0 = off)",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=None,
        metavar="P",
        help="serve the liveness endpoint on :P/healthz (0 = off)",
    )
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    parser.add_argument(
        "--max-workers", type=int, default=None, help="reconciler threads (default 32)"
    )
    parser.set_defaults(func=_run)
    sub = parser.add_subparsers(dest="operator_command", metavar="SUBCOMMAND")
    rbac = sub.add_parser(
        "rbac",
        help="print the operator's ClusterRole (and the trainer's "
        "rules) as YAML, the one source of truth for the Helm chart",
    )
    rbac.add_argument("--name", default="posttrain-operator", help="ClusterRole name")
    rbac.set_defaults(func=_rbac)


def _run(args: argparse.Namespace) -> int:
    from .config import load_config
    from .runtime import run_forever

    config = load_config(
        namespaces=tuple(args.namespaces) if args.namespaces else None,
        all_namespaces=args.all_namespaces,
        standalone=args.standalone,
        lease_name=args.lease_name,
        metrics_port=args.metrics_port,
        liveness_port=args.liveness_port,
        kubeconfig=args.kubeconfig,
        max_workers=args.max_workers,
    )
    run_forever(config)
    return 0


def _rbac(args: argparse.Namespace) -> int:
    from .rbac import rbac_yaml

    print(rbac_yaml(args.name), end="")
    return 0
