"""The ``posttrain`` command line.

Each component contributes its subcommands through a ``register(subparsers)``
function in its own ``cli`` module, so this file only wires them together and
owns the exit-code convention: 0 success, 1 the work failed, 2 bad input.

Start-up is lazy: ``posttrain --help`` lists the commands from :data:`COMMANDS`
without importing any component, and ``posttrain sandbox exec ...`` imports only
the module that registers ``sandbox``. Importing every component (pydantic models,
the Kubernetes client, MinIO, OpenTelemetry) costs about a second, which a person
typing ``--help`` or a verifier spawning ``sandbox exec`` per sample should not pay.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from posttrain.api.envnames import OPERATOR_KUBECONFIG
from posttrain.errors import UsageError

# Each module exposes ``register(subparsers)`` and imports only light dependencies at
# module level (torch, kubernetes, pydantic are imported inside the commands). The
# one-line help of every command it registers is repeated here so that ``--help`` needs
# no import; tests/test_cli_startup.py fails when the two drift apart.
COMMANDS: dict[str, dict[str, str]] = {
    "posttrain.trainer.run.entrypoints": {
        "run": "run RL post-training from a TrainingRun manifest",
        "eval": "score a model or checkpoint on a JSONL task file",
        "eval-checkpoints": "score a run's committed checkpoints, off the training path",
    },
    "posttrain.rollout.cli": {
        "serve": "OpenAI-compatible rollout server on the CPU engine",
        "rollout": "rollout replica helpers (vLLM)",
    },
    "posttrain.sandboxes.cli": {
        "sandbox": "run untrusted code in a bubblewrap sandbox, or serve a runner",
    },
    "posttrain.operator.cli": {
        "operator": "run the Kubernetes operator (TrainingRun, RolloutPool, SandboxTask)",
    },
    "posttrain.ctl": {
        "apply": "validate manifests locally, then server-side apply them",
        "get": "list runs, pools and tasks with their progress",
        "describe": "explain one object: spec, status, conditions, events, children",
        "watch": "follow a run live until it Succeeds (exit 0) or Fails (exit 1)",
        "logs": "print (or follow, -f) the trainer pod's logs",
        "report": "build an HTML or Markdown report with plots from a local run directory",
    },
    "posttrain.devenv.cli": {
        "dev": "start/stop a local Kubernetes (a real single-node cluster) and MinIO",
    },
    "posttrain.api.cli": {
        "crds": "write crds/ and the chart's CRDs from the API models",
    },
    "posttrain.storage.cli": {
        "storage": "inspect a run's checkpoints and trajectories",
    },
}


def _new_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:  # type: ignore[type-arg]
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="LLM post-training with RL from verifiable rewards, on Kubernetes or locally.",
        epilog="`posttrain COMMAND --help` describes one command. Start here: "
        "`posttrain run examples/local-demo.yaml --local` (a local RL run on CPU) or "
        "`posttrain dev up` (a local single-node Kubernetes cluster).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    return parser, sub


def _register(sub: argparse._SubParsersAction, name: str) -> bool:  # type: ignore[type-arg]
    """Import one command module and let it add its subcommands; False when not installed."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            return False  # component not present in this build
        raise
    module.register(sub)
    return True


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv``: only the chosen command's module is imported.

    Without a known command (``--help``, a typo), every command is listed from
    :data:`COMMANDS` as a stub whose own parser is never used; with ``argv=None`` (tests,
    documentation) every module is imported and registered for real.
    """
    parser, sub = _new_parser()
    if argv is None:
        for name in COMMANDS:
            _register(sub, name)
        return parser
    chosen = _command_word(argv)
    module = next((m for m, cmds in COMMANDS.items() if chosen in cmds), None)
    if module is not None and _register(sub, module):
        return parser
    if chosen is not None and module is None:
        # A command registered by a module but missing from COMMANDS must still work.
        for name in COMMANDS:
            _register(sub, name)
        return parser
    for commands in COMMANDS.values():
        for command, text in commands.items():
            sub.add_parser(command, help=text, add_help=False)
    return parser


def _command_word(argv: Sequence[str]) -> str | None:
    """The first word that is not a top-level option: the command the user chose.

    >>> _command_word(["-v", "get", "tr"]), _command_word(["--help"]), _command_word([])
    ('get', None, None)
    """
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def _register_with_dev_environment(args: argparse.Namespace) -> None:
    """An operator run against the ``posttrain dev up`` cluster records its pid, so that
    ``posttrain dev down`` stops it with the rest (the operator itself knows nothing of the
    dev environment: it runs the same in a cluster)."""
    if args.command != "operator" or getattr(args, "operator_command", None):
        return
    from posttrain.devenv.registry import register_this_process

    register_this_process("operator", args.kubeconfig or os.environ.get(OPERATOR_KUBECONFIG))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):  # a stub from the --help listing: no module registered it
        parser.error(f"{args.command}: this command's component is not installed")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _register_with_dev_environment(args)
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
