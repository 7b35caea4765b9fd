"""``posttrain storage ...``: look at a run's artifacts without writing code.

    posttrain storage checkpoints s3://posttrain/runs/team-a/grpo-1
    posttrain storage spot-check s3://posttrain/runs/team-a/grpo-1 --n 20 --out sample.md

S3 endpoint and credentials come from the same environment the pods get
(POSTTRAIN_S3_ENDPOINT, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or
POSTTRAIN_S3_CREDENTIALS_DIR); see docs/storage.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from posttrain.storage.checkpoints import CheckpointManager
from posttrain.storage.commit import read_manifest
from posttrain.storage.errors import StorageError
from posttrain.storage.progress import format_bytes
from posttrain.storage.store import open_store
from posttrain.storage.trajectories import export_spot_check

_URI_HELP = "where the run's artifacts live: s3://BUCKET/runs/NAMESPACE/NAME or a directory"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("storage", help="inspect a run's checkpoints and trajectories")
    sub = parser.add_subparsers(dest="storage_command", metavar="SUBCOMMAND", required=True)

    checkpoints = sub.add_parser("checkpoints", help="list a run's committed checkpoints")
    checkpoints.add_argument("uri", help=_URI_HELP)
    checkpoints.set_defaults(func=_list_checkpoints)

    spot = sub.add_parser(
        "spot-check", help="write a random sample of a run's trajectories for people to read"
    )
    spot.add_argument("uri", help=_URI_HELP)
    spot.add_argument("--n", type=int, default=20, help="records to sample (default 20)")
    spot.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    spot.add_argument(
        "--out",
        type=Path,
        default=Path("spot-check.md"),
        help="output file: .md for Markdown, anything else for JSONL",
    )
    spot.set_defaults(func=_spot_check)


def _list_checkpoints(args: argparse.Namespace) -> int:
    try:
        store = open_store(args.uri, create_bucket=False)
        manager = CheckpointManager(store)
        latest = manager.latest_step()
        steps = manager.list_steps()
        if not steps:
            print(f"no committed checkpoints under {store.uri('checkpoints')}")
            return 0
        print(f"{'step':>10}  {'size':>10}  {'eval_score':>10}  created")
        for step in steps:
            manifest = read_manifest(store, manager.step_prefix(step))
            assert manifest is not None  # list_steps only returns committed steps
            score = manifest.metadata.get("eval_score")
            marker = "  <- latest" if step == latest else ""
            print(
                f"{step:>10}  {format_bytes(manifest.total_bytes):>10}  "
                f"{'-' if score is None else f'{score:.4g}':>10}  {manifest.created}{marker}"
            )
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _spot_check(args: argparse.Namespace) -> int:
    if args.n < 1:
        from posttrain.errors import UsageError

        raise UsageError(f"--n must be at least 1, got {args.n}")
    try:
        store = open_store(args.uri, create_bucket=False)
        sample = export_spot_check(store, "trajectories", args.n, args.seed, args.out)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(sample)} trajectories to {args.out}")
    return 0
