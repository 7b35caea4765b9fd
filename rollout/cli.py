"""``posttrain serve`` (CPU engine) and ``posttrain rollout vllm-entry|vllm-command``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.api.env import VLLM_PYTHON, WEIGHTS_POLL_SECONDS, WEIGHTS_URI, RolloutPoolEnv
from posttrain.errors import UsageError

if TYPE_CHECKING:
    from posttrain.rollout.limits import RequestLimits
    from posttrain.rollout.vllm import VllmServeSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    pool_env = RolloutPoolEnv.from_env()  # what the operator hands a pool's replicas
    _register_serve(subparsers, pool_env)
    rollout = subparsers.add_parser("rollout", help="rollout replica helpers (vLLM)")
    rollout_sub = rollout.add_subparsers(
        dest="rollout_command", metavar="SUBCOMMAND", required=True
    )
    _register_vllm(rollout_sub, pool_env)
    _register_fetch_model(rollout_sub)


def _register_serve(subparsers: argparse._SubParsersAction, pool_env: RolloutPoolEnv) -> None:
    """``posttrain serve``: the CPU engine (or vLLM) behind the OpenAI contract."""
    serve = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible rollout server on the CPU engine",
        description="Serve a model over the OpenAI completions API (/v1/completions with "
        "token ids and logprobs) with weight hot-swaps, on the CPU engine. In a cluster a "
        "RolloutPool runs vLLM instead; this is the laptop and test path.",
        epilog="example: posttrain serve --model smollm2-135m-instruct --port 8000",
    )
    serve.add_argument(
        "--model", required=True, help="packaged id, local dir, file://, s3:// or hf://ORG/NAME"
    )
    serve.add_argument(
        "--host",
        default="0.0.0.0",
        help="address to listen on (default 0.0.0.0: every interface; "
        "127.0.0.1 keeps it on this machine)",
    )
    serve.add_argument(
        "--port",
        type=int,
        default=8000,
        help="TCP port of the OpenAI API, /health and /metrics (default 8000)",
    )
    serve.add_argument("--served-model-name", default=None, help="name in /v1/models")
    serve.add_argument(
        "--weights-uri",
        default=pool_env.weights_uri,
        help="prefix with published weights (<prefix>/vNNNNNNNN/); the latest loads before "
        f"ready (default ${WEIGHTS_URI}, which the operator sets for a pool)",
    )
    serve.add_argument(
        "--poll-seconds", type=float,
        default=pool_env.weights_poll_seconds or 0.0,
        help=f"poll --weights-uri for new versions (default ${WEIGHTS_POLL_SECONDS})",
    )  # fmt: skip
    serve.add_argument(
        "--engine", choices=("cpu", "vllm"), default="cpu",
        help="cpu: posttrain's transformers engine; vllm: vLLM behind the same front door a "
        "RolloutPool pod runs (its CPU build from `make venv-vllm` on a laptop)",
    )  # fmt: skip
    serve.add_argument(
        "--reward-model", default=None,
        help="also serve this model as a sequence-classification reward model at /v1/rewards "
        "(packaged id, dir, s3:// or hf://; a causal LM gets a new seeded one-logit head)",
    )  # fmt: skip
    serve.add_argument("--max-batch-size", type=int, default=64, help="sequences per batch")
    serve.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    serve.add_argument("--metrics-port", type=int, default=0, help="extra Prometheus port")
    serve.add_argument(
        "--drain-seconds", type=float, default=25.0,
        help="on SIGTERM, let in-flight requests finish for up to this long (default 25, "
        "below a pod's 30 s grace period)",
    )  # fmt: skip
    add_limit_flags(serve)
    serve.set_defaults(func=_serve)


def _register_vllm(rollout_sub: argparse._SubParsersAction, pool_env: RolloutPoolEnv) -> None:
    """``posttrain rollout vllm-entry|vllm-command``: the two share every engine flag, so
    the command a pod runs and the one ``vllm-command`` prints cannot drift apart."""
    for name, handler, text in (
        ("vllm-entry", _vllm_entry, "run vllm serve behind posttrain's weight-sync front door"),
        ("vllm-command", _vllm_command, "print the vllm serve command line for engine args"),
    ):
        parser = rollout_sub.add_parser(name, help=text, description=text)
        parser.add_argument("--model", required=True,
                            help="packaged id, HF-format directory, file://, s3:// or "
                            "hf://ORG/NAME[@REVISION]")  # fmt: skip
        parser.add_argument("--host", default="0.0.0.0", help="public (front door) address")
        parser.add_argument("--port", type=int, default=8000, help="public port")
        parser.add_argument(
            "--internal-port", type=int, default=8001,
            help="vLLM's own port, bound to 127.0.0.1 only (its /collective_rpc stays in the pod); "
            "0 picks a free one",
        )  # fmt: skip
        parser.add_argument("--served-model-name", default=None)
        parser.add_argument(
            "--weights-uri", default=pool_env.weights_uri,
            help="weight registry prefix: its latest committed version loads before ready "
            f"(default ${WEIGHTS_URI})",
        )  # fmt: skip
        parser.add_argument(
            "--poll-seconds", type=float,
            default=pool_env.weights_poll_seconds or 0.0,
            help=f"poll --weights-uri for newer versions (default ${WEIGHTS_POLL_SECONDS})",
        )  # fmt: skip
        parser.add_argument(
            "--engine-args",
            default="{}",
            help='JSON of RolloutPool engineArgs, e.g. {"tensor_parallel_size": 2}',
        )
        parser.add_argument("--start-timeout", type=float, default=1800.0)
        if name == "vllm-entry":
            add_limit_flags(parser)
            parser.add_argument(
                "--transfer-idle-seconds", type=float, default=None, metavar="S",
                help="a direct weight transfer with no step for this long is abandoned (the "
                "trainer died or hung): the replica goes back to the weights it held, or exits "
                "to pull the latest committed version (default 120)",
            )  # fmt: skip
        parser.set_defaults(func=handler)


def _register_fetch_model(rollout_sub: argparse._SubParsersAction) -> None:
    """``posttrain rollout fetch-model``: a pool pod's init step."""
    fetch = rollout_sub.add_parser(
        "fetch-model",
        help="resolve a model reference into a local directory (a pool pod's init step)",
        description="Resolve a packaged id, s3:// checkpoint, pvc:// path, Hugging Face Hub "
        "repository (hf://ORG/NAME[@REVISION], into $HF_HOME) or HF-format directory to a local "
        "directory and point --link at it, so the server starts from local files.",
    )
    fetch.add_argument(
        "--model",
        required=True,
        help="packaged id, HF-format dir, file://, s3://, pvc:// or hf://ORG/NAME[@REVISION]",
    )
    fetch.add_argument("--link", required=True, type=Path, help="symlink to create (replaced)")
    fetch.set_defaults(func=_fetch_model)


LIMIT_FLAGS = ("max_n", "max_tokens_limit", "max_body_mb")


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """What one request may ask of the server (docs/rollout.md, "Limits"); beyond them a
    request gets a 400 (413 for the body) naming the field and the limit."""
    parser.add_argument(
        "--max-n", type=int, default=None, metavar="N",
        help="samples one request may ask for: n x its prompts (default 512, the largest "
        "groupSize a TrainingRun may set)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens-limit", type=int, default=None, metavar="N",
        help="max_tokens one sample may ask for (default: the model's context length)",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-mb", type=float, default=None, metavar="MB",
        help="largest request body in MiB; bigger ones get 413 (default 8)",
    )  # fmt: skip


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """:class:`RequestLimits` from :func:`add_limit_flags`' flags (defaults where unset)."""
    from posttrain.httplimits import HttpLimits
    from posttrain.rollout.limits import RequestLimits

    try:
        http = HttpLimits()
        if args.max_body_mb is not None:
            http = HttpLimits(max_body_bytes=int(args.max_body_mb * (1 << 20)))
        given = {"max_n": args.max_n, "max_tokens": args.max_tokens_limit}
        return RequestLimits(**{k: v for k, v in given.items() if v is not None}, http=http)
    except ValueError as exc:
        raise UsageError(f"invalid request limit: {exc}; every limit must be positive") from exc


def limit_flags_argv(args: argparse.Namespace) -> list[str]:
    """The limit flags given to ``args``, as command-line arguments again.

    >>> limit_flags_argv(argparse.Namespace(max_n=8, max_tokens_limit=None, max_body_mb=None))
    ['--max-n', '8']
    """
    argv: list[str] = []
    for name in LIMIT_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def _serve_vllm(args: argparse.Namespace) -> int:
    """``posttrain serve --engine vllm``: ``vllm-entry`` in the rollout environment.

    Runs in this interpreter when it has vLLM (a rollout image, ``.venv-vllm``), else
    replaces this process with the rollout environment's ``vllm-entry`` (vLLM pins its own
    torch, so it lives in its own venv: ``make venv-vllm``).
    """
    import importlib.util

    from posttrain.models import resolve_model
    from posttrain.rollout.vllm_local import CPU_ENGINE_ARGS, vllm_python

    model_dir = str(resolve_model(args.model))  # fail here, in the caller's words
    argv = ["rollout", "vllm-entry", "--model", model_dir, "--host", args.host,
            "--port", str(args.port), "--internal-port", "0",
            "--served-model-name", args.served_model_name or args.model,
            "--poll-seconds", str(args.poll_seconds),
            "--engine-args", json.dumps(CPU_ENGINE_ARGS)]  # fmt: skip
    if args.weights_uri:
        argv += ["--weights-uri", args.weights_uri]
    argv += limit_flags_argv(args)
    if importlib.util.find_spec("vllm") is not None:
        # In this process, through this module's own parser (the top-level CLI sits above
        # the rollout package: importing it from here would be a cycle).
        parser = argparse.ArgumentParser(prog="posttrain")
        register(parser.add_subparsers(dest="command"))
        entry = parser.parse_args(argv)
        return int(entry.func(entry) or 0)
    python = vllm_python()
    if python is None:
        raise UsageError("--engine vllm needs vLLM: run `make venv-vllm` (or set "
                         f"${VLLM_PYTHON}), or use --engine cpu")  # fmt: skip
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.execv(str(python), [str(python), "-m", "posttrain", *argv])
    return 1  # not reached


def _serve(args: argparse.Namespace) -> int:
    from posttrain.rollout.auth import weights_token
    from posttrain.rollout.server import ModelLoadError, ServerConfig, run
    from posttrain.telemetry import start_metrics_server

    if args.engine == "vllm":
        if args.reward_model:
            raise UsageError("--reward-model is served by the cpu engine only (--engine cpu)")
        return _serve_vllm(args)

    if args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    limits = request_limits(args)
    start_metrics_server(args.metrics_port)
    try:
        run(
            ServerConfig(
                model=args.model,
                served_model_name=args.served_model_name,
                weights_uri=args.weights_uri,
                poll_seconds=args.poll_seconds,
                max_batch_size=args.max_batch_size,
                weights_token=weights_token(),
                num_threads=args.threads,
                reward_model=args.reward_model,
                limits=limits,
                drain_seconds=args.drain_seconds,
            ),
            host=args.host,
            port=args.port,
        )
    except ModelLoadError as exc:
        print(f"posttrain serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _spec(args: argparse.Namespace, model: str) -> VllmServeSpec:
    from posttrain.rollout.vllm import VllmServeSpec

    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--engine-args is not valid JSON ({exc}): {args.engine_args!r}") from exc
    if not isinstance(engine_args, dict):
        raise UsageError(f"--engine-args must be a JSON object, got {args.engine_args!r}")
    internal_port = args.internal_port
    if internal_port == 0:  # any free port: replicas sharing a host network do not collide
        from posttrain.processes import free_port

        internal_port = free_port()
    try:
        return VllmServeSpec.from_engine_args(
            model,
            engine_args,
            port=internal_port,
            host="127.0.0.1",
            served_model_name=args.served_model_name,
        )
    except TypeError as exc:
        raise UsageError(f"--engine-args has an unsupported key: {exc}") from exc


def _fetch_model(args: argparse.Namespace) -> int:
    """Resolve ``--model`` (downloading an s3:// checkpoint into ``$POSTTRAIN_CACHE``, an
    hf:// repository into the Hugging Face cache under ``$HF_HOME``) and
    atomically point ``--link`` at it. Failure exits 1 with one line naming the reference,
    which Kubernetes keeps as the init container's termination message."""
    from posttrain.models import resolve_model

    try:
        resolved = resolve_model(args.model)
    except Exception as exc:
        print(f"cannot fetch model {args.model}: {exc}", file=sys.stderr)
        return 1
    args.link.parent.mkdir(parents=True, exist_ok=True)
    staging = args.link.with_name(f".{args.link.name}.new")
    staging.unlink(missing_ok=True)
    staging.symlink_to(resolved, target_is_directory=True)
    staging.replace(args.link)
    print(f"model {args.model} -> {resolved} (linked at {args.link})")
    return 0


def _vllm_command(args: argparse.Namespace) -> int:
    from posttrain.rollout.vllm import build_vllm_command

    print(shlex.join(build_vllm_command(_spec(args, args.model))))
    return 0


def _vllm_entry(args: argparse.Namespace) -> int:
    from posttrain.models import resolve_model
    from posttrain.rollout.vllm import run_vllm_entry, vllm_available

    limits = request_limits(args)
    ok, why = vllm_available()
    if not ok:
        raise UsageError(f"cannot run vLLM here: {why}; use `posttrain serve` on CPU instead")
    model_dir = resolve_model(args.model)
    spec = _spec(args, str(model_dir))
    if spec.served_model_name is None:
        spec.served_model_name = args.model
    return run_vllm_entry(
        spec,
        public_port=args.port,
        public_host=args.host,
        weights_uri=args.weights_uri,
        start_timeout_s=args.start_timeout,
        poll_seconds=args.poll_seconds,
        limits=limits,
        transfer_idle_s=args.transfer_idle_seconds,
    )
