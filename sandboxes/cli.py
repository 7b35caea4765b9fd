"""``posttrain sandbox exec|serve``: one sandboxed execution as JSON, or the runner server.

Heavy imports (prometheus, OpenTelemetry, uvicorn) stay inside the handlers so the
``posttrain`` CLI starts fast for every other command.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from posttrain.errors import UsageError

if TYPE_CHECKING:
    from .protocol import ExecLimits


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    sandbox = subparsers.add_parser(
        "sandbox", help="run untrusted code in a bubblewrap sandbox, or serve a runner"
    )
    commands = sandbox.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND", required=True)

    run = commands.add_parser(
        "exec",
        help="run CMD in a fresh sandbox (stdin passed through); prints one JSON result",
        description="Run CMD ARGS... in a fresh sandbox and print one JSON object: status "
        "(ok|error|timeout|killed|oom), exit_code, stdout, stderr, duration_ms, reason. "
        "Exits 0 whenever the sandbox worked, whatever the program did.",
    )
    run.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="wall-clock limit in seconds (default 10)",
    )
    run.add_argument(
        "--memory-mb",
        type=int,
        default=512,
        metavar="M",
        help="address-space limit in MiB (default 512)",
    )
    run.add_argument(
        "--network",
        choices=("none", "host"),
        default="none",
        help="none: no network namespace access (default); host: share the host's",
    )
    run.add_argument(
        "--max-output-bytes",
        type=int,
        default=1 << 20,
        metavar="N",
        help="bytes of stdout and of stderr kept before truncation (default 1 MiB)",
    )
    run.add_argument(
        "--workdir-mb",
        type=int,
        default=64,
        metavar="M",
        help="size cap of the /workspace and /tmp tmpfs (default 64)",
    )
    run.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS",
        help="the program and its arguments, after --",
    )
    run.set_defaults(func=run_exec)

    serve = commands.add_parser("serve", help="serve POST /v1/exec, /health and /metrics")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8090)
    serve.add_argument(
        "--concurrency", type=int, default=None, help="executions at once (default: CPU count + 1)"
    )
    serve.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests allowed to wait before 429 (default 8 per slot)",
    )
    add_exec_limit_flags(serve)
    serve.set_defaults(func=run_serve)


def add_exec_limit_flags(serve: argparse.ArgumentParser) -> None:
    """The runner's policy: a request may ask for less, and gets a 400 naming the field and
    the limit when it asks for more (docs/sandboxes.md, "Limits")."""
    from .protocol import ExecLimits

    default = ExecLimits()
    serve.add_argument(
        "--allow-host-network",
        action="store_true",
        help='allow requests with network "host" (default: refused; sandboxes get no network)',
    )
    for flag, kind, unit in (
        ("--max-timeout-s", float, "wall-clock seconds (timeout_s; also bounds cpu_time_s)"),
        ("--max-memory-mb", int, "address space in MiB (memory_mb)"),
        ("--max-processes", int, "processes per sandbox (max_processes)"),
        ("--max-file-mb", int, "largest written file in MiB (max_file_mb)"),
        ("--max-workdir-mb", int, "size of each /workspace and /tmp tmpfs in MiB (workdir_mb)"),
        ("--max-output-bytes", int, "bytes of stdout and of stderr kept (max_output_bytes)"),
    ):
        value = getattr(default, flag[2:].replace("-", "_"))
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        serve.add_argument(
            flag,
            type=kind,
            default=value,
            metavar="N",
            help=f"the most a request may ask for: {unit} (default {shown})",
        )


def exec_limits_from(args: argparse.Namespace) -> ExecLimits:
    """:class:`~.protocol.ExecLimits` from :func:`add_exec_limit_flags`' flags."""
    from .protocol import ExecLimits

    try:
        return ExecLimits(
            allow_host_network=args.allow_host_network,
            max_timeout_s=args.max_timeout_s,
            max_memory_mb=args.max_memory_mb,
            max_processes=args.max_processes,
            max_file_mb=args.max_file_mb,
            max_workdir_mb=args.max_workdir_mb,
            max_output_bytes=args.max_output_bytes,
        )
    except ValueError as exc:
        raise UsageError(f"invalid runner limit: {exc}; every --max-* flag must be > 0") from exc


def run_exec(args: argparse.Namespace) -> int:
    from posttrain.telemetry import short_lived_process

    short_lived_process()  # one execution per process: no in-memory spans to keep
    from .executor import default_executor
    from .protocol import ExecRequest, SandboxError

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given; use `posttrain sandbox exec [options] -- CMD ARGS`")
    stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
    try:
        request = ExecRequest(
            command=command,
            stdin=stdin,
            timeout_s=args.timeout,
            memory_mb=args.memory_mb,
            network=args.network,
            max_output_bytes=args.max_output_bytes,
            workdir_mb=args.workdir_mb,
        )
    except ValueError as exc:
        raise UsageError(f"invalid sandbox options: {exc}") from exc
    try:
        result = default_executor().run(request)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps(result.to_dict()) + "\n")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .protocol import SandboxError
    from .runner import serve

    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    limits = exec_limits_from(args)
    try:
        serve(args.host, args.port, args.concurrency, args.max_queue, limits)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
