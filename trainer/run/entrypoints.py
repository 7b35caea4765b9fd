"""``posttrain run`` (train from a TrainingRun manifest) and ``posttrain eval`` (score a model).

torch and transformers are imported inside the handlers: ``posttrain --help`` and the
operator image must not pay for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import UsageError
from posttrain.trainer.run.endpoints import rollout_endpoints
from posttrain.trainer.run.interrupt import GracefulStop

if TYPE_CHECKING:
    from posttrain.api.env import TrainerEnv

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    run = subparsers.add_parser(
        "run",
        help="run RL post-training from a TrainingRun manifest",
        description="Train with RL from verifiable rewards. With --local a CPU rollout server "
        "is started as a child process; otherwise the manifest's rollout endpoints are used. "
        "A run resumes from the newest checkpoint under --out (or checkpoint.storageUri); "
        "with none there, from spec.resumeFrom if set, else it starts fresh.",
    )
    run.add_argument("manifest", type=Path, help="TrainingRun YAML, e.g. examples/local-demo.yaml")
    run.add_argument("--local", action="store_true", help="start a local CPU rollout server")
    run.add_argument("--out", type=Path, default=Path("runs/local"), help="output directory")
    run.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="override algorithm.maxSteps (the length of an rl stage without one)",
    )
    run.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus on this port")
    run.set_defaults(func=run_command)

    ev = subparsers.add_parser(
        "eval",
        help="score a model or checkpoint on a JSONL task file",
        description='Tasks: one JSON object per line, {"domain": "arithmetic", "prompt": ..., '
        '"answer": ...} or {"domain": "code", "prompt": ..., "tests": "assert ..."}; optional '
        '"verifier" (default: arithmetic->numeric, code->unit_tests).',
    )
    ev.add_argument(
        "--model", required=True, help="packaged id, checkpoint dir, s3:// or hf://ORG/NAME URI"
    )
    ev.add_argument("--tasks", required=True, type=Path, help="JSONL task file")
    ev.add_argument("--out", type=Path, default=None, help="write results JSON here")
    ev.add_argument(
        "--server", default=None, help="use this running rollout server URL instead of starting one"
    )
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.set_defaults(func=eval_command)

    ck = subparsers.add_parser(
        "eval-checkpoints",
        help="score a run's committed checkpoints, off the training path",
        description="Held-out (and regression) evaluation of the base model and of every "
        "checkpoint the run commits, on this process's own CPU rollout server, while the "
        "trainer keeps training (set spec.evaluation.inline: false so it does not evaluate "
        "too). Results go to --out/eval/ and to the run's storage under reports/eval/.",
    )
    ck.add_argument("manifest", type=Path, help="the run's TrainingRun YAML")
    ck.add_argument(
        "--storage",
        default=None,
        help="the run's storage URI (default: spec.checkpoint.storageUri)",
    )
    ck.add_argument("--out", type=Path, default=Path("runs/eval"), help="output directory")
    ck.add_argument(
        "--watch",
        action="store_true",
        help="keep polling until the final checkpoint (maxSteps) is scored",
    )
    ck.add_argument("--poll-seconds", type=float, default=30.0)
    ck.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus on this port")
    ck.set_defaults(func=eval_checkpoints_command)


def run_command(args: argparse.Namespace) -> int:
    from posttrain.api import TrainingRun, load_manifest
    from posttrain.api.env import NODES, RAY_ADDRESS, ROLLOUT_ENDPOINTS, TrainerEnv
    from posttrain.telemetry import start_metrics_server
    from posttrain.trainer.run.distributed import wanted_nodes

    # SIGTERM (kubectl delete, Ctrl-C in a wrapper) must unwind the `with` blocks so the
    # child rollout server is stopped and never outlives us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    run = load_manifest(args.manifest, TrainingRun)
    spec = run.spec
    contract = TrainerEnv.from_env()  # what the operator handed this pod, parsed once
    from posttrain.trainer.data.rundata import check_dataset_sources

    # Before --out is created or a rollout server starts (seconds): a typo'd dataset path
    # fails at once and leaves nothing behind.
    check_dataset_sources(spec)
    if args.max_steps is not None:
        if args.max_steps < 1:
            raise UsageError(f"--max-steps must be >= 1, got {args.max_steps}")
        spec.algorithm.max_steps = args.max_steps
    if args.local and (wanted_nodes(run, contract) > 1 or contract.ray_address):
        raise UsageError(
            f"--local starts one CPU rollout server for a single-node run, but this run wants "
            f"{wanted_nodes(run, contract)} nodes (spec.resources.nodes / ${NODES} / "
            f"${RAY_ADDRESS} set); drop --local and set ${ROLLOUT_ENDPOINTS}, or use nodes: 1"
        )
    start_metrics_server(args.metrics_port)
    from posttrain.models import resolve_model
    from posttrain.trainer.run.server_process import LocalRolloutServer

    resolve_model(spec.model)  # fail fast on a bad model reference, before any server starts
    args.out.mkdir(parents=True, exist_ok=True)
    stop = GracefulStop().install()
    try:
        if args.local:
            with LocalRolloutServer(spec.model, args.out / "rollout-server.log") as server:
                result = _train(run, args.out, contract, [server.url], stop, wait_for_servers=False)
        else:
            result = _train(run, args.out, contract, None, stop, wait_for_servers=True)
    except KeyboardInterrupt:  # the second Ctrl-C: stopped mid-step
        _report_interrupt(spec, args.out, _step_reached(args.out))
        return 130
    _print_summary(result)
    if result.interrupted:
        _report_interrupt(spec, args.out, result.steps_done)
        return 130
    return 0


def _train(
    run: Any,
    out: Path,
    contract: TrainerEnv,
    endpoints: list[str] | None,
    stop: Any,
    *,
    wait_for_servers: bool,
) -> Any:
    """Train in this process, or as several ranks (:mod:`posttrain.trainer.run.distributed`)."""
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.observe.status import status_reporter
    from posttrain.trainer.run.distributed import launch_if_distributed
    from posttrain.trainer.run.loop import train

    spec = run.spec
    discovery = None
    if endpoints is None:
        from posttrain.rollout.discovery import PoolDiscovery

        discovery = PoolDiscovery.for_trainer(contract) if not spec.rollout.endpoints else None
        if discovery is not None:
            # Each replica of the pool, not its Service: publishes must reach all of them.
            from posttrain.trainer.observe.status import rollout_health_reporter

            endpoints = discovery.wait_ready(
                spec.rollout.timeout_seconds, report=rollout_health_reporter(contract)
            )
        else:
            endpoints = rollout_endpoints(spec, contract)
    log.info("sampling from rollout endpoint(s) %s", ", ".join(endpoints))
    max_in_flight = max(spec.rollout.max_in_flight, spec.algorithm.prompts_per_step)
    client = RolloutClient(
        endpoints,
        timeout_s=spec.rollout.timeout_seconds,
        max_in_flight=max_in_flight,
        discover=discovery.ready_endpoints if discovery else None,
    )
    following = None
    if discovery is not None:
        from posttrain.rollout.discovery import follow_pool

        following = follow_pool(client, discovery.ready_endpoints)
    try:
        if wait_for_servers:
            _require_healthy(client, endpoints, spec.rollout.timeout_seconds)
        # Several ranks get the endpoints as resolved now (they do not follow the pool).
        distributed = launch_if_distributed(run, out, contract, endpoints)
        if distributed is not None:  # rank 0's result of a multi-rank run
            return distributed
        reporter = status_reporter(out, contract)
        return train(spec, out, client, reporter=reporter, stop=stop.requested, contract=contract)
    finally:
        if following is not None:
            following.set()
        client.close()


def _step_reached(out_dir: Path) -> int:
    """The last step the run recorded in status.json (0 when it recorded none)."""
    try:
        return int(json.loads((out_dir / "status.json").read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def _report_interrupt(spec: Any, out_dir: Path, step: int) -> None:
    """Name the last checkpoint and the command that resumes from it; mark status.json."""
    from posttrain.trainer.run.interrupt import (
        interrupted_message,
        last_checkpoint,
        mark_status_interrupted,
    )

    message = interrupted_message(
        step, last_checkpoint(spec, out_dir), spec.checkpoint.every_steps, sys.argv
    )
    mark_status_interrupted(out_dir, message.splitlines()[0])
    print(message, file=sys.stderr)


def _require_healthy(client: Any, endpoints: list[str], timeout_s: float) -> None:
    """Wait for every rollout endpoint to answer /health, then fail with a clear error.

    In a cluster the pool and the run are often applied together and the pool needs minutes
    to load its model, so a trainer pod waits (logging) rather than failing at once.
    """
    deadline = time.monotonic() + timeout_s
    next_log = 0.0
    while True:
        down = [url for url, ok in client.health().items() if not ok]
        if not down:
            return
        if time.monotonic() >= deadline:
            waited = f" after {timeout_s:.0f} s" if timeout_s > 0 else ""
            raise UsageError(
                f"rollout server(s) unreachable{waited}: {', '.join(down)}; "
                "start one with `posttrain serve --model MODEL --port PORT`, check the "
                "RolloutPool's pods, or fix the URL"
            )
        if time.monotonic() >= next_log:
            log.info("waiting for rollout server(s) %s (up to %.0f s)", ", ".join(down), timeout_s)
            next_log = time.monotonic() + 15
        time.sleep(1.0)


def _print_summary(result: Any) -> None:
    base, final = result.base_eval, result.final_eval
    print(
        f"\nrun finished: {result.steps_done} steps in {result.wall_seconds:.0f}s; "
        f"outputs in {result.out_dir}"
    )
    if base is not None and final is not None:
        print("held-out accuracy (base -> trained):")
        for domain in final.accuracy:
            before = base.accuracy.get(domain, float("nan"))
            print(
                f"  {domain:<12} {before:6.1%} -> {final.accuracy[domain]:6.1%}  "
                f"({final.counts[domain]} items)"
            )
        print(f"  {'all':<12} {base.overall:6.1%} -> {final.overall:6.1%}")
    if result.last_checkpoint:
        print(f"latest checkpoint: {result.last_checkpoint}")


def eval_command(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    logging.getLogger("httpx").setLevel(logging.WARNING)

    from posttrain.models import resolve_model
    from posttrain.rollout.client import RolloutClient
    from posttrain.trainer.data.datasets import DEFAULT_VERIFIER_BY_DOMAIN, load_jsonl_tasks
    from posttrain.trainer.evaluation.heldout import evaluate_tasks
    from posttrain.trainer.model.policy import chat_prompt_ids
    from posttrain.trainer.run.server_process import LocalRolloutServer

    tasks = load_jsonl_tasks(args.tasks)
    for task in tasks:
        if task.verifier is None and task.domain not in DEFAULT_VERIFIER_BY_DOMAIN:
            raise UsageError(
                f'{args.tasks}: unknown domain {task.domain!r} with no "verifier" key; use '
                f'{" or ".join(DEFAULT_VERIFIER_BY_DOMAIN)} or add e.g. "verifier": "exact"'
            )
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def encode(prompt: str) -> list[int]:
        return chat_prompt_ids(tokenizer, prompt)

    def score(client: Any) -> Any:
        return evaluate_tasks(
            client,
            encode,
            tasks,
            {},
            step=0,
            split="eval",
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
        )

    if args.server:
        client = RolloutClient([args.server], timeout_s=600, max_in_flight=8)
        _require_healthy(client, [args.server], timeout_s=0)  # a named server: no waiting
        result = score(client)
    else:
        log_dir = args.out.parent if args.out else Path(tempfile.gettempdir())
        log_path = log_dir / "eval-rollout-server.log"
        with LocalRolloutServer(str(model_dir), log_path) as server:
            client = RolloutClient([server.url], timeout_s=600, max_in_flight=8)
            result = score(client)
    client.close()
    for domain, accuracy in result.accuracy.items():
        print(f"{domain:<12} {accuracy:6.1%}  ({result.counts[domain]} items)")
    print(f"{'all':<12} {result.overall:6.1%}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"model": args.model, "tasks": str(args.tasks), **result.to_json()}
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def eval_checkpoints_command(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from posttrain.api import TrainingRun, load_manifest
    from posttrain.models import resolve_model
    from posttrain.rollout.client import RolloutClient
    from posttrain.storage.store import open_store
    from posttrain.telemetry import start_metrics_server
    from posttrain.trainer.data.rundata import build_run_data
    from posttrain.trainer.evaluation.checkpoint_eval import CheckpointEvaluator
    from posttrain.trainer.model.policy import chat_prompt_ids
    from posttrain.trainer.run.server_process import LocalRolloutServer

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = load_manifest(args.manifest, TrainingRun).spec
    storage = args.storage or spec.checkpoint.storage_uri
    if not storage:
        raise UsageError(
            f"{args.manifest}: no spec.checkpoint.storageUri; pass --storage with the run's "
            "storage (s3://BUCKET/PREFIX, or the --out directory of a local run)"
        )
    start_metrics_server(args.metrics_port)
    store = open_store(storage)
    data = build_run_data(spec)
    model_dir = resolve_model(spec.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    with LocalRolloutServer(str(model_dir), args.out / "eval-rollout-server.log") as server:
        client = RolloutClient(
            [server.url], timeout_s=spec.rollout.timeout_seconds, max_in_flight=8
        )
        try:
            evaluator = CheckpointEvaluator(
                spec, store, data, client, lambda p: chat_prompt_ids(tokenizer, p), args.out
            )
            scored = evaluator.run(watch=args.watch, poll_seconds=args.poll_seconds)
        finally:
            client.close()
    print(
        f"scored step(s) {scored or 'none (all done already)'}; results in "
        f"{args.out / 'eval'} and {store.uri('reports/eval')}"
    )
    return 0
