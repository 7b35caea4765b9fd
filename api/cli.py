"""``posttrain crds``: regenerate (or --check) the CRD YAML from the models."""

from __future__ import annotations

import argparse
from pathlib import Path

from .crdgen import drifted_files, write_crds


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "crds",
        help="write crds/ and the chart's CRDs from the API models",
        description="Regenerate crds/*.yaml and charts/posttrain/crds/*.yaml from api/.",
    )
    parser.add_argument("--root", type=Path, default=Path("."), help="repository root")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed files drift from the models"
    )
    parser.set_defaults(func=run_crds)


def run_crds(args: argparse.Namespace) -> int:
    if args.check:
        stale = drifted_files(args.root)
        for path in stale:
            print(f"drifted: {path} (run `posttrain crds`)")
        return 1 if stale else 0
    for path in write_crds(args.root):
        print(f"wrote {path}")
    return 0
