"""``posttrain --help`` lists every command without importing any component, and the
one-line help it shows is the one each component registers."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from posttrain import cli


def registered_helps() -> dict[str, str]:
    """Every command and its help as the components register them (all modules imported)."""
    parser = cli.build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {choice.dest: str(choice.help) for choice in actions[0]._choices_actions}


def test_the_help_table_matches_what_the_components_register() -> None:
    listed = {cmd: text for cmds in cli.COMMANDS.values() for cmd, text in cmds.items()}
    assert listed == registered_helps()


# What a start-up that only prints help has no use for: the pydantic models, the Kubernetes
# and MinIO clients, the OpenTelemetry SDK, torch and transformers, rich, and the components.
HEAVY = (
    "pydantic",
    "kubernetes",
    "minio",
    "opentelemetry",
    "torch",
    "transformers",
    "rich",
    "yaml",
    "posttrain.api",
    "posttrain.ctl.commands",
    "posttrain.ctl.follow",
    "posttrain.ctl.report",
    "posttrain.trainer",
)
CLUSTER_COMMANDS = ("apply", "get", "describe", "watch", "logs", "report")


def modules_loaded_by(argv: list[str]) -> list[str]:
    """The modules imported once ``posttrain ARGV`` returns, in a fresh interpreter. Counted
    by name, not timed, so the checks hold on a loaded machine."""
    code = (
        "import sys, contextlib, io\n"
        "from posttrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        f"        main({argv!r})\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.split()


# The api package itself imports its models on first use, and its environment names are plain
# strings: a command line may load both for its --help (never pydantic or the models).
LIGHT = ("posttrain.api", "posttrain.api.envnames")


def among(modules: list[str], names: tuple[str, ...]) -> list[str]:
    """The ``modules`` that are one of ``names`` or inside one of them (``LIGHT`` aside).

    >>> among(["rich", "richer", "torch.nn", "json", "posttrain.api"], ("rich", "torch", "posttrain.api"))
    ['rich', 'torch.nn']
    """
    return [
        m for m in modules if m not in LIGHT and any(m == n or m.startswith(f"{n}.") for n in names)
    ]


def test_help_imports_no_component() -> None:
    assert among(modules_loaded_by(["--help"]), (*HEAVY, "posttrain.ctl")) == []


@pytest.mark.parametrize("command", CLUSTER_COMMANDS)
def test_cluster_command_help_imports_only_its_parser(command: str) -> None:
    """``posttrain get --help`` builds the argparse parsers and imports no command module:
    the handlers are imported when the command runs (posttrain.ctl.parsers.runs)."""
    loaded = modules_loaded_by([command, "--help"])
    assert "posttrain.ctl.parsers" in loaded
    assert among(loaded, HEAVY) == []


@pytest.mark.parametrize("command", sorted({c for cmds in cli.COMMANDS.values() for c in cmds}))
def test_no_command_help_loads_kubernetes_torch_or_transformers(command: str) -> None:
    assert (
        among(modules_loaded_by([command, "--help"]), ("kubernetes", "torch", "transformers")) == []
    )


def test_a_cluster_command_imports_its_handler_when_it_runs() -> None:
    """The lazy handler reaches the real one: a bad ``-f`` path is its usage error (exit 2)."""
    assert cli.main(["apply", "-f", "/nonexistent/run.yaml"]) == 2


def test_sandbox_exec_loads_no_tracing_sdk() -> None:
    """``sandbox exec`` (one process per verified sample) does not load the OpenTelemetry
    SDK (and psutil with it) for spans nobody could read."""
    code = (
        "import sys, contextlib, io\n"
        "from posttrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['sandbox', 'exec', '--', 'true'])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'psutil', "
        "'pydantic', 'kubernetes', 'torch'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_a_command_missing_from_the_table_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command a module registers but COMMANDS does not list (added in parallel) is found
    by importing every module, so it is never unreachable."""
    table = {m: dict(c) for m, c in cli.COMMANDS.items()}
    table["posttrain.api.cli"].pop("crds")
    monkeypatch.setattr(cli, "COMMANDS", table)
    args = cli.build_parser(["crds", "--check"]).parse_args(["crds", "--check"])
    assert args.command == "crds" and callable(args.func)
