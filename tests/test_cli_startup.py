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


def test_help_imports_no_component() -> None:
    """The costly imports (pydantic models, kubernetes, minio, OpenTelemetry SDK, torch)
    stay out of ``posttrain --help``: counted by module name, not by timing, so the check
    holds on a loaded machine."""
    code = (
        "import sys, contextlib, io\n"
        "from posttrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('pydantic', 'kubernetes', 'minio', 'opentelemetry', 'torch', 'rich', "
        "'posttrain.api', 'posttrain.ctl', 'posttrain.trainer')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or "
        "m.startswith(heavy)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


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
