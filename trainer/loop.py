"""The RL loop: sample -> score -> advantages -> clipped policy step -> publish weights.

Read this file top to bottom to know what a step does; every stage lives in its own
module. The rollout server is only ever reached over HTTP through ``client`` (a
:class:`posttrain.rollout.client.RolloutClient`), so the same loop drives a local CPU
server or a pool of vLLM servers in a cluster.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.trainer.audit import Auditor, trajectory_record
from posttrain.trainer.batch import prepare_batch, score_batch
from posttrain.trainer.checkpoint import (
    Checkpointer,
    TrainerState,
    batch_from_json,
    batch_to_json,
    request_from_json,
    request_to_json,
)
from posttrain.trainer.distributed import DistContext
from posttrain.trainer.evaluate import EvalResult, evaluate_tasks, save_eval
from posttrain.trainer.policy import Policy
from posttrain.trainer.progress import ProgressReporter, StepMetrics
from posttrain.trainer.report import plot_run, write_report
from posttrain.trainer.rewards import VerifyFn
from posttrain.trainer.rollouts import RolloutProducer, RolloutRequest, is_too_stale
from posttrain.trainer.rundata import build_run_data, loss_config
from posttrain.trainer.status import LocalStatusReporter, RunStatus, StatusReporter

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    out_dir: Path
    steps_done: int
    base_eval: EvalResult | None
    final_eval: EvalResult | None
    last_checkpoint: str | None
    wall_seconds: float


def train(
    spec: Any,  # posttrain.api.TrainingRunSpec
    out_dir: Path,
    client: Any,  # posttrain.rollout.client.RolloutClient
    *,
    reporter: StatusReporter | None = None,
    stop_after_step: int | None = None,  # simulate an interruption (tests)
    verify: VerifyFn | None = None,
    dist: DistContext | None = None,  # multi-node: this rank (see distributed.py)
) -> RunResult:
    from posttrain.models import resolve_model
    from posttrain.rollout.protocol import SamplingParams
    from posttrain.storage.checkpoints import WeightRegistry
    from posttrain.storage.store import open_store
    from posttrain.storage.trajectories import TrajectoryWriter

    started = time.monotonic()
    algo, evaluation = spec.algorithm, spec.evaluation
    out_dir.mkdir(parents=True, exist_ok=True)
    reporter = reporter or LocalStatusReporter(out_dir)
    dist = dist or DistContext()
    data = build_run_data(spec, seed_offset=dist.rank)  # each rank its own prompt stream
    prompts_per_rank = max(1, algo.prompts_per_step // dist.world_size)
    store = open_store(spec.checkpoint.storage_uri or str(out_dir.resolve()))
    checkpointer = Checkpointer(store, spec.checkpoint.keep_last, spec.checkpoint.keep_best)
    weights = WeightRegistry(store, "weights", keep_last=2)
    base_dir = resolve_model(spec.model)
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-train-"))
    # Every scored sample goes to durable storage for later analysis and audits.
    trajectories = TrajectoryWriter(store, "trajectories", out_dir / "spool",
                                    writer_id=f"rank{dist.rank}")

    def make_policy(model_dir: Path) -> Policy:
        return Policy(model_dir, learning_rate=algo.learning_rate, weight_decay=algo.weight_decay,
                      reference_dir=base_dir if algo.kl_coef > 0 else None, seed=algo.seed)

    auditor = Auditor(out_dir, spec.audit.spot_check_samples if spec.audit.enabled else 0,
                      algo.seed)
    resumed = checkpointer.restore(make_policy, scratch)
    if resumed is None:  # fresh run: the server already serves the base model as version 0
        policy, step, version, pending, sampled = make_policy(base_dir), 0, 0, [], []
    else:
        policy, state = resumed
        step, version = state.step, state.weight_version
        data.curriculum.load_state_dict(state.curriculum)
        auditor.load_state_dict(state.audit)
        pending = [request_from_json(r) for r in state.pending_requests]
        sampled = [batch_from_json(b) for b in state.sampled_batches]
        if dist.is_main:  # the server restarted with the base model: give it our weights
            _publish(policy, weights, store.uri("weights"), version, client, scratch)
    config = loss_config(algo)
    sampling = SamplingParams(n=algo.group_size, max_tokens=algo.max_new_tokens,
                              temperature=algo.temperature, top_p=algo.top_p)
    producer = RolloutProducer(client, sampling, algo.max_policy_lag, steps_done=step)
    for batch in sampled:
        producer.preload(batch)
    for request in pending:
        producer.submit(request)
    submitted = max([step, *[r.batch_index for r in pending], *[b.request.batch_index
                                                                 for b in sampled]])

    def run_eval(at_step: int) -> EvalResult:
        result = evaluate_tasks(client, policy.encode_prompt, data.heldout, data.verifiers,
                                step=at_step, split="heldout", max_new_tokens=algo.max_new_tokens,
                                temperature=evaluation.temperature,
                                max_concurrency=spec.sandbox.max_concurrency, verify=verify)
        save_eval(result, out_dir)
        if data.regression:
            save_eval(evaluate_tasks(client, policy.encode_prompt, data.regression,
                                     data.verifiers, step=at_step, split="regression",
                                     max_new_tokens=algo.max_new_tokens, verify=verify,
                                     temperature=evaluation.temperature), out_dir)
        return result

    status = RunStatus(phase="Running", step=step, max_steps=algo.max_steps,
                       weight_version=version)
    base_eval = run_eval(0) if step == 0 and dist.is_main else None
    final_eval, last_checkpoint = base_eval, None
    with ProgressReporter(out_dir, algo.max_steps, start_step=step) as progress:
        while step < algo.max_steps and (stop_after_step is None or step < stop_after_step):
            step += 1
            with progress.step_span(step) as span:
                step_started = time.monotonic()
                # 1. choose prompts for every batch allowed to be in flight (curriculum)
                while submitted < min(step + algo.max_policy_lag, algo.max_steps):
                    submitted += 1
                    tasks = data.curriculum.next_prompts(prompts_per_rank)
                    producer.submit(RolloutRequest(submitted, tasks,
                                                   [policy.encode_prompt(t.prompt) for t in tasks],
                                                   seed=algo.seed * 1_000_003 + submitted))
                # 2. take this step's batch (sampled in the background)
                batch = producer.take(step, timeout=spec.rollout.timeout_seconds * 4)
                if batch.error:
                    raise RuntimeError(f"rollout for step {step} failed: {batch.error}")
                staleness = version - batch.weight_version  # versions behind, before this step
                stale = is_too_stale(batch, version, algo.max_policy_lag)
                # 3. rewards: verifiers + overlong penalty
                scored = score_batch(batch, data.verifiers, algo,
                                     max_concurrency=spec.sandbox.max_concurrency, verify=verify)
                # 4. group advantages + dynamic sampling + loss coefficients
                prepared = prepare_batch(batch, scored, algorithm=algo.name,
                                         dynamic_sampling=algo.dynamic_sampling,
                                         domain_weights=data.domain_weights,
                                         loss_config=config, step=step)
                for task, pass_rate in zip(batch.request.tasks, prepared.group_pass_rates,
                                           strict=True):
                    data.curriculum.observe(task, pass_rate, step)
                auditor.observe_batch(step, prepared.trajectories)
                for trajectory in prepared.trajectories:
                    trajectories.append(trajectory_record(trajectory))
                # 5. the policy-gradient step (skipped for stale batches / non-finite loss)
                rollout_seconds, train_started = batch.seconds, time.monotonic()
                samples = [] if stale else prepared.samples
                stats = policy.train_step(samples, config, micro_batch_size=algo.micro_batch_size,
                                          grad_clip=algo.grad_clip, temperature=algo.temperature,
                                          world_size=dist.world_size)
                if stale:
                    stats.skip_reason = f"stale batch (v{batch.weight_version} < v{version})"
                # 6. publish the new weights so the server samples from them
                if stats.applied:
                    version += 1
                if stats.applied and dist.is_main:
                    _publish(policy, weights, store.uri("weights"), version, client, scratch)
                producer.step_finished(step)
                metrics = StepMetrics(
                    step=step, reward_mean=prepared.reward_mean,
                    domain_rewards=prepared.domain_rewards,
                    domain_pass_rates=prepared.domain_pass_rates, loss=stats.loss,
                    grad_norm=stats.grad_norm, kl=stats.kl, clip_fraction=stats.clip_fraction,
                    ratio_mean=stats.ratio_mean, response_length=prepared.response_length,
                    kept_groups=prepared.kept_groups, total_groups=len(batch.completions),
                    weight_version=version, staleness=staleness,
                    applied=stats.applied, skip_reason=stats.skip_reason,
                    rollout_seconds=rollout_seconds,
                    train_seconds=time.monotonic() - train_started,
                    step_seconds=time.monotonic() - step_started,
                    strata={d: data.curriculum.current_stratum(d) for d in data.curriculum.pools})
                progress.record(metrics, span)
            # 7. evaluate and checkpoint at their intervals
            last = step == algo.max_steps
            if dist.is_main and (step % evaluation.every_steps == 0 or last):
                final_eval = run_eval(step)
                auditor.observe_eval(step, prepared.domain_rewards, final_eval.accuracy)
                status.eval_accuracy = final_eval.accuracy
            if dist.is_main and (step % spec.checkpoint.every_steps == 0 or last
                                 or step == stop_after_step):
                waiting, done = producer.buffered()
                state = TrainerState(step, version, data.curriculum.state_dict(),
                                     auditor.state_dict(), [request_to_json(r) for r in waiting],
                                     [batch_to_json(b) for b in done], algo.seed)
                score = final_eval.overall if final_eval and final_eval.step == step else None
                # Trajectories up to this step become durable before the checkpoint that covers
                # them: a resumed run re-samples only what no checkpoint covers (none lost).
                trajectories.flush()
                last_checkpoint = checkpointer.save(policy, state, eval_score=score)
                status.last_checkpoint = last_checkpoint
            status.step, status.weight_version = step, version
            status.reward_mean, status.domain_rewards = metrics.reward_mean, metrics.domain_rewards
            reporter.report(status)
    producer.close()
    trajectories.close()
    shutil.rmtree(scratch, ignore_errors=True)
    auditor.write_spot_checks()
    plot_run(out_dir)
    finished = step >= algo.max_steps
    status.phase = "Succeeded" if finished else "Running"
    reporter.report(status)
    wall = time.monotonic() - started
    write_report(out_dir, "posttrain run report", {"steps": step, "wall time": f"{wall:.0f}s",
                                                   "model": spec.model, "algorithm": algo.name})
    return RunResult(out_dir, step, base_eval, final_eval, last_checkpoint, wall)


def _publish(
    policy: Policy, weights: Any, uri: str, version: int, client: Any, scratch: Path
) -> None:
    """Save weights, publish them as ``version`` and make the rollout server load them."""
    local = scratch / f"publish-v{version}"
    policy.save_weights(local)
    weights.publish(version, local)
    client.load_weights(uri, version)
    for path in local.iterdir():
        path.unlink()
    local.rmdir()
