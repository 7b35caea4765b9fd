"""The ``posttrain`` command line.

Each component contributes its subcommands through a ``register(subparsers)``
function in its own ``cli`` module, so this file only wires them together and
owns the exit-code convention: 0 success, 1 the work failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from posttrain.errors import UsageError

# Modules that expose ``register(subparsers)``; each must import only light
# dependencies at module level (torch is imported inside the command).
COMMAND_MODULES: tuple[str, ...] = (
    "posttrain.trainer.cli",  # run, eval
    "posttrain.rollout.cli",  # serve
    "posttrain.sandboxes.cli",  # sandbox exec | serve
    "posttrain.operator.cli",  # operator
    "posttrain.ctl",  # apply, get, describe, watch, logs, report
    "posttrain.devenv.cli",  # dev up | down | status
    "posttrain.api.cli",  # crds
    "posttrain.storage.cli",  # storage checkpoints | spot-check
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="LLM post-training with RL from verifiable rewards, on Kubernetes or locally.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # component not present in this build
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result = args.func(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
