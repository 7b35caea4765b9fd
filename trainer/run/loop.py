"""The training loop: the run's stages in order (SFT -> DPO -> RL; by default RL alone).

An RL step: sample -> score -> advantages -> clipped policy step -> publish weights. Read
:func:`train` and :func:`rl_stage` top to bottom to know what a step does; every part lives
in its own module (SFT/DPO steps in :mod:`posttrain.trainer.run.pipeline`), and set-up / resume /
stage boundaries / teardown live in :class:`Run` below them. The rollout server is
only ever reached over HTTP through ``client`` (a
:class:`posttrain.rollout.client.RolloutClient`), so the same loop drives a local CPU
server or a pool of vLLM servers in a cluster.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.api.env import TrainerEnv
from posttrain.trainer.checkpointing.checkpoint import (
    FRESH_START,
    STATE_FILE,
    TrainerState,
    batch_from_json,
    batch_to_json,
    request_from_json,
    request_to_json,
    weights_only,
)
from posttrain.trainer.data.rollouts import (
    RolloutBatch,
    RolloutProducer,
    is_too_stale,
)
from posttrain.trainer.evaluation.heldout import EvalResult, evaluate_tasks, save_eval
from posttrain.trainer.model.dist_context import DistContext
from posttrain.trainer.model.policy import EngineOptions, Policy, RankInfo, StepStats
from posttrain.trainer.observe.audit import trajectory_record
from posttrain.trainer.observe.live_status import LiveStatus
from posttrain.trainer.observe.run_report import plot_run, write_report
from posttrain.trainer.observe.status import (
    STAGE_STARTED,
    STAGE_SUCCEEDED,
    LocalStatusReporter,
    RunStatus,
    StatusReporter,
)
from posttrain.trainer.observe.step_metrics import (
    ProgressReporter,
    StepMetrics,
    discard_records_after,
    sampled_entropy,
)
from posttrain.trainer.rewards.scoring import VerifyFn
from posttrain.trainer.run.batch import PreparedBatch, prepare_batch, score_batch
from posttrain.trainer.run.interrupt import INTERRUPTED
from posttrain.trainer.run.parts import assemble
from posttrain.trainer.run.pipeline import (
    StageBook,
    StagePlan,
    offline_step,
    reference_logps,
    resolved,
    stage_batch,
    stage_schedule,
)

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec
    from posttrain.envs.training import EpisodeSampler
    from posttrain.rollout.client import RolloutClient

log = logging.getLogger(__name__)


OUTPUTS = ("metrics.jsonl", "status.json", "eval", "audit", "plots", "report.md")
"""What a run writes under its out dir for people to read (``posttrain report`` renders it)."""


def output_files(out_dir: Path) -> list[tuple[str, Path]]:
    """The (relative path, path) of every output file written so far."""
    from posttrain.storage.commit import local_files

    found: list[tuple[str, Path]] = []
    for name in OUTPUTS:
        path = out_dir / name
        if path.is_file():
            found.append((name, path))
        elif path.is_dir():
            found += [(f"{name}/{rel}", p) for rel, p in local_files(path)]
    return found


@dataclass
class RunResult:
    out_dir: Path
    steps_done: int
    base_eval: EvalResult | None
    final_eval: EvalResult | None
    last_checkpoint: str | None
    wall_seconds: float
    interrupted: bool = False  # stopped by Ctrl-C (after checkpointing its last step)


def train(
    spec: TrainingRunSpec,
    out_dir: Path,
    client: RolloutClient,
    *,
    reporter: StatusReporter | None = None,
    stop_after_step: int | None = None,  # simulate an interruption (tests)
    verify: VerifyFn | None = None,
    dist: DistContext | None = None,  # multi-node: this rank (see distributed.py)
    wall_budget_s: float | None = None,  # stop after the step that exhausts it (benchmarks)
    stop: threading.Event | None = None,  # set by Ctrl-C: checkpoint this step, then stop
    contract: TrainerEnv | None = None,  # what the operator handed this pod (default: parsed)
) -> RunResult:
    contract = TrainerEnv.from_env() if contract is None else contract
    reporter = reporter or LocalStatusReporter(out_dir)
    run = Run(spec, out_dir, client, reporter, dist or DistContext(), verify, contract)
    plans = run.parts.plans
    total = plans[-1].last_step
    stop_at = total if stop_after_step is None else min(total, stop_after_step)
    base_eval = run.evaluate(0) if run.step == 0 and run.inline_eval else None
    run.final_eval = base_eval
    with ProgressReporter(out_dir, total, start_step=run.step) as progress:
        for plan in plans:
            if run.step >= plan.last_step:
                continue  # finished before a resume
            if run.step >= stop_at or (stop is not None and stop.is_set()):
                break
            run.enter_stage(plan)
            if plan.type == "rl":
                ended = rl_stage(run, plan, progress, stop_at, stop_after_step, wall_budget_s, stop)
            else:
                ended = offline_stage(run, plan, progress, stop_at, stop)
            if ended:
                break
    interrupted = stop is not None and stop.is_set()
    if interrupted:
        log.info("stopped by Ctrl-C after step %d (checkpointed)", run.step)
    wall = run.finish(interrupted)
    return RunResult(
        out_dir, run.step, base_eval, run.final_eval, run.last_checkpoint, wall, interrupted
    )


def offline_stage(
    run: Run,
    plan: StagePlan,
    progress: ProgressReporter,
    stop_at: int,
    stop: threading.Event | None,
) -> bool:
    """An SFT or DPO stage: fixed batches of the stage's data, no rollouts. True when
    stopped by Ctrl-C (after checkpointing the step)."""
    spec = run.spec
    data = run.parts.stage_data[plan.name]
    while run.step < min(plan.last_step, stop_at):
        if stop is not None and stop.is_set():  # Ctrl-C before this stage's first step
            return True
        run.step += 1
        step = run.step
        with progress.step_span(step) as span:
            indices = stage_batch(
                plan, data, step, run.algo.seed, run.dist.rank, run.dist.world_size
            )
            metrics = offline_step(
                run.policy,
                plan,
                data,
                indices,
                run.stages.state,
                grad_clip=run.algo.grad_clip,
                step=step,
            )
            progress.record_stage_step(metrics, span)
        interrupted = stop is not None and stop.is_set()
        saved = (
            step == plan.last_step
            or step % spec.checkpoint.every_steps == 0
            or (step == stop_at)
            or interrupted
        )
        if step == plan.last_step:
            run.end_stage(plan)  # publish, evaluate, checkpoint: the next stage's start
        elif saved:  # every rank writes its shards; rank 0 commits
            run.save_checkpoint(None)
        run.report_progress()
        run.sync_outputs()
        if stop is not None and stop.is_set():  # Ctrl-C: this step is checkpointed
            if not saved:
                run.save_checkpoint(None)  # pressed during reporting
            return True
    return False


def rl_stage(
    run: Run,
    plan: StagePlan,
    progress: ProgressReporter,
    stop_at: int,
    stop_after_step: int | None,
    wall_budget_s: float | None,
    stop: threading.Event | None = None,
) -> bool:
    """The RL stage's steps; True when ``wall_budget_s`` ran out or Ctrl-C stopped it (after
    checkpointing the step)."""
    producer = run.parts.rollouts.producer
    assert producer is not None, "rl_stage before the rollouts started"
    steps_started = time.monotonic()

    def budget_spent() -> bool:
        return wall_budget_s is not None and time.monotonic() - steps_started >= wall_budget_s

    # The first step this process runs had nothing sampled ahead of it, so with rollouts
    # sampled ahead (maxPolicyLag >= 1) its wait is a cold start's, not the pool's steady
    # shortfall: it stays out of the autoscaling signal (metrics.jsonl still has it).
    cold_start = run.algo.max_policy_lag >= 1
    while run.step < stop_at:
        if stop is not None and stop.is_set():  # Ctrl-C before the first step (base eval)
            return True
        run.step += 1
        with progress.step_span(run.step) as span:
            done = rl_step(run, plan, producer, run.step, stop_after_step, budget_spent)
            progress.record(done.metrics, span)
            if not cold_start:
                run.live.waits.record(done.metrics.rollout_wait_seconds, done.metrics.step_seconds)
            cold_start = False
        if after_rl_step(run, plan, done, stop):
            if done.budget_spent:
                log.info("wall-clock budget of %.0fs spent after step %d", wall_budget_s, run.step)
            return True
    return False


@dataclass
class RlStep:
    """What one RL step did, for what follows it (evaluation, checkpoint, status)."""

    prepared: PreparedBatch
    metrics: StepMetrics
    last: bool  # the stage's last step
    checkpoint_due: bool
    budget_spent: bool  # the wall-clock budget ran out during this step


def rl_step(
    run: Run,
    plan: StagePlan,
    producer: RolloutProducer,
    step: int,
    stop_after_step: int | None,
    budget_spent: Callable[[], bool],
) -> RlStep:
    """Steps 1-6 of one RL step: prompts, rollouts, rewards, advantages, the policy-gradient
    step, and publishing the new weights."""
    spec, algo = run.spec, run.algo
    step_started = time.monotonic()
    # 1. choose prompts for every batch allowed to be in flight (curriculum)
    parts = run.parts
    parts.rollouts.submit_ahead(step, run.policy.encode_prompt)
    # 2. take this step's batch (sampled in the background)
    batch, rollout_wait_s = run.live.waits.take(producer, step, spec.rollout.timeout_seconds * 4)
    if batch.error:
        raise RuntimeError(f"rollout for step {step} failed: {batch.error}")
    staleness = run.version - batch.weight_version  # versions behind, before step
    stale = is_too_stale(batch, run.version, algo.max_policy_lag)
    # 3. rewards: verifiers + overlong penalty
    scored = score_batch(
        batch,
        parts.data.verifiers,
        algo,
        verify=parts.verify,
        max_concurrency=spec.sandbox.max_concurrency,
    )
    # 4. group advantages + dynamic sampling + loss coefficients
    prepared = prepare_batch(
        batch,
        scored,
        algorithm=algo.name,
        dynamic_sampling=algo.dynamic_sampling,
        loss_config=parts.loss_config,
        step=step,
    )
    run.observe(batch, prepared)
    # 5. the policy-gradient step (skipped for stale batches / non-finite loss)
    train_started = time.monotonic()
    stats = run.policy.train_step(
        [] if stale else prepared.samples,
        parts.loss_config,
        micro_batch_size=algo.micro_batch_size,
        grad_clip=algo.grad_clip,
        temperature=algo.temperature,
        step=step,
    )
    if stale:
        stats.skip_reason = f"stale batch (v{batch.weight_version} < v{run.version})"
    # 6. publish the new weights so the server samples from them; this also
    #    releases the producer to sample the batch k+1 steps ahead
    last = step == plan.last_step
    spent = budget_spent()
    checkpoint_due = (
        step % spec.checkpoint.every_steps == 0 or last or step == stop_after_step or spent
    )
    if stats.applied:
        run.version += 1
        # every rank: the weights are gathered from the shards as they stream out
        parts.publisher.publish(run.policy, run.version, durable=checkpoint_due)
    run.dist.barrier()  # multi-node: no rank samples before rank 0 published
    producer.step_finished(step)
    metrics = rl_step_metrics(
        run, plan, batch, prepared, stats, staleness, train_started, step_started
    )
    # With rollouts sampled ahead, a pool that cannot keep up makes the publish wait for the
    # replicas to finish the next batch's completions before they take the weights: that
    # wait is rollout wait too (it is where a short pool shows at maxPolicyLag >= 1).
    drained = parts.publisher.last_replica_drain_seconds if stats.applied else 0.0
    metrics.rollout_wait_seconds = rollout_wait_s + drained
    return RlStep(prepared, metrics, last, checkpoint_due, spent)


def rl_step_metrics(
    run: Run,
    plan: StagePlan,
    batch: RolloutBatch,
    prepared: PreparedBatch,
    stats: StepStats,
    staleness: int,
    train_started: float,
    step_started: float,
) -> StepMetrics:
    """The step's line of ``metrics.jsonl`` (``*_started``: ``time.monotonic()`` when the
    policy-gradient step and the whole step began)."""
    curriculum = run.parts.data.curriculum
    return StepMetrics(
        step=run.step,
        reward_mean=prepared.reward_mean,
        domain_rewards=prepared.domain_rewards,
        domain_pass_rates=prepared.domain_pass_rates,
        loss=stats.loss,
        grad_norm=stats.grad_norm,
        kl=stats.kl,
        clip_fraction=stats.clip_fraction,
        ratio_mean=stats.ratio_mean,
        response_length=prepared.response_length,
        kept_groups=prepared.kept_groups,
        total_groups=len(batch.completions),
        weight_version=run.version,
        staleness=staleness,
        applied=stats.applied,
        skip_reason=stats.skip_reason,
        rollout_seconds=batch.seconds,
        train_seconds=time.monotonic() - train_started,
        step_seconds=time.monotonic() - step_started,
        strata={d: curriculum.current_stratum(d) for d in curriculum.pools},
        stage=plan.name,
        learning_rate=float(run.policy.optimizer.param_groups[0]["lr"]),
        masked_samples=prepared.masked_samples,
        entropy=sampled_entropy(batch.completions),
    )


def after_rl_step(run: Run, plan: StagePlan, done: RlStep, stop: threading.Event | None) -> bool:
    """Step 7: evaluate and checkpoint at their intervals (the stage's end is both), then
    report; True when the stage stops here (budget spent or Ctrl-C, the step checkpointed)."""
    spec, step = run.spec, done.metrics.step
    if run.inline_eval and (step % spec.evaluation.every_steps == 0 or done.last):
        run.final_eval = run.evaluate(step)
        run.parts.auditor.observe_eval(step, done.prepared.domain_rewards, run.final_eval.accuracy)
        run.parts.auditor.write_spot_checks()  # the export is refreshed at each eval
        with run.live.editing() as status:
            status.eval_accuracy = run.final_eval.accuracy
    if done.last:
        run.close_stage_record(plan)
    interrupted = run.dist.any_rank(stop is not None and stop.is_set())
    if done.checkpoint_due or interrupted:  # every rank writes its shards; rank 0 commits
        latest = run.final_eval
        evaluated = latest is not None and latest.step == step
        run.save_checkpoint(latest.overall if latest is not None and evaluated else None)
    if done.last:
        run.announce_stage_end(plan)
    with run.live.editing() as status:
        status.reward_mean = done.metrics.reward_mean
        status.domain_rewards = done.metrics.domain_rewards
    run.report_progress()
    run.sync_outputs()
    if done.budget_spent:
        return True
    if stop is not None and stop.is_set():  # Ctrl-C: this step is checkpointed
        if not (interrupted or done.checkpoint_due):  # (stop is only set in one process)
            run.save_checkpoint(None)  # pressed during reporting
        return True
    return False


class Run:
    """What changes as one run trains (policy, step, weight version, stage, evaluations),
    over the parts it was assembled from (:mod:`posttrain.trainer.run.parts`), plus the
    set-up / resume / stage boundaries / teardown that :func:`train` calls around each step.

    Everything is set in the constructor, which resumes from the newest checkpoint if any.
    """

    def __init__(
        self,
        spec: TrainingRunSpec,
        out_dir: Path,
        client: RolloutClient,
        reporter: StatusReporter,
        dist: DistContext,
        verify: VerifyFn | None,
        contract: TrainerEnv,
    ) -> None:
        self.started = time.monotonic()
        self.spec, self.algo, self.out_dir, self.client = spec, spec.algorithm, out_dir, client
        self.dist, self.contract = dist, contract
        self.live = LiveStatus(reporter)  # verifier threads report sandbox health into it
        self.parts = assemble(spec, out_dir, client, dist, contract, verify, self.report_sandbox)
        self.stages = StageBook(self.parts.plans[0])
        self.final_eval: EvalResult | None = None
        self.last_checkpoint: str | None = None
        # rank 0 evaluates in the loop unless a separate evaluator does
        # (trainer/evaluation/checkpoint_eval.py)
        self.inline_eval = dist.is_main and spec.evaluation.inline
        resumed = self.resume()
        self.policy: Policy
        self.step: int  # optimizer steps taken (or skipped) so far, over all stages
        self.version: int  # weight version the servers serve: one per publish
        if resumed is None:  # fresh run: the server already serves the base model as v0
            self.policy, self.step, self.version = self.make_policy(self.parts.base_dir), 0, 0
        else:
            self.policy, state = resumed
            self.step, self.version = state.step, state.weight_version
            self._restore(state)
        if dist.is_main:
            self.announce_start(resumed is not None)
        # Multi-node: no rank samples before rank 0 republished the resumed weights. Every
        # rank waits here, fresh or resumed, so the collectives always pair up.
        dist.barrier()
        self.episodes = self.make_episode_sampler()  # None: no environment domain
        self.live.begin(self._first_status())

    def _restore(self, state: TrainerState) -> None:
        """Continue from a checkpoint's state: curriculum, audit, the rollouts not yet
        trained on, the stages; then give the restarted servers our weights (every rank
        takes part in gathering them; rank 0 sends them)."""
        parts = self.parts
        parts.data.curriculum.load_state_dict(state.curriculum)
        parts.auditor.load_state_dict(state.audit)
        parts.rollouts.restore(
            [request_from_json(r) for r in state.pending_requests],
            [batch_from_json(b) for b in state.sampled_batches],
        )
        self.stages.state, self.stages.records = state.stage_state, state.stages
        parts.publisher.publish(self.policy, self.version)

    def _first_status(self) -> RunStatus:
        parts = self.parts
        return RunStatus(
            phase="Running",
            step=self.step,
            max_steps=parts.plans[-1].last_step,
            weight_version=self.version,
            stage=self.stages.current_name(),
            stages=list(self.stages.records),
            reports_uri=parts.outputs.uri() if parts.outputs else None,
            resumed_from=parts.checkpointer.resumed_from or FRESH_START,
            sandbox=parts.verification.health.to_wire()
            if parts.verification and parts.data.executes_code()
            else None,
        )

    def announce_start(self, resumed: bool) -> None:
        """Say, always, which checkpoint this run resumes from or that it starts fresh, and
        drop records past that step."""
        # A fresh start evaluates the base model again, so even step 0's records go.
        dropped = discard_records_after(self.out_dir, self.step if resumed else -1)
        checkpointer = self.parts.checkpointer
        if resumed:
            log.info(
                "resuming from checkpoint %s (step %d)%s",
                checkpointer.resumed_from,
                self.step,
                f"; dropped {dropped} later step(s) an earlier attempt recorded" if dropped else "",
            )
        else:
            log.info(
                "fresh start from %s: no checkpoint of this run under %s%s%s",
                self.spec.model,
                checkpointer.store.uri("checkpoints"),
                "" if checkpointer.run_uid is None else f" (uid {checkpointer.run_uid})",
                f"; dropped the {dropped} step(s) an earlier attempt recorded" if dropped else "",
            )

    def kl_reference_dir(self, model_dir: Path) -> Path | None:
        """Where the KL reference of a policy built from ``model_dir`` comes from: the model
        the RL stage started from. For the first stage that is the base model; for a later
        one its start checkpoint (pinned, see :func:`parts.kl_anchor_steps`) when resuming
        inside it, else the base model until :meth:`enter_stage` anchors the reference."""
        if self.algo.kl_coef <= 0:
            return None
        parts = self.parts
        state_file = model_dir / STATE_FILE
        if not state_file.is_file():  # the base model: a fresh run
            return parts.base_dir
        step = int(json.loads(state_file.read_text())["step"])
        plan = next((p for p in parts.plans if p.first_step <= step + 1 <= p.last_step), None)
        if plan is None or plan.type != "rl" or plan.index == 0 or step < plan.first_step:
            return parts.base_dir  # not inside a later RL stage (yet)
        dest = parts.scratch / "kl-reference"
        try:
            parts.checkpointer.load_step(plan.first_step - 1, dest, include=weights_only)
        except Exception as exc:
            raise RuntimeError(
                f"resuming inside stage {plan.name!r} needs its KL anchor, the checkpoint of "
                f"step {plan.first_step - 1} under {parts.checkpointer.store.uri('checkpoints')}"
                f", and it cannot be read: {exc}"
            ) from exc
        log.info("KL reference: the start of stage %s (step %d)", plan.name, plan.first_step - 1)
        return dest

    def make_policy(self, model_dir: Path, weights_from_checkpoint: bool = False) -> Policy:
        first = self.parts.plans[0].spec
        return Policy(
            model_dir,
            learning_rate=resolved(first.learning_rate, "learningRate"),
            weight_decay=resolved(first.weight_decay, "weightDecay"),
            seed=self.algo.seed,
            reference_dir=self.kl_reference_dir(model_dir),
            engine=self.engine_options(),
            rank=self.rank_info(),
            weights_from_checkpoint=weights_from_checkpoint,
        )

    def engine_options(self) -> EngineOptions:
        return EngineOptions.from_spec(self.spec, self.dist.local_world_size)

    def rank_info(self) -> RankInfo:
        return RankInfo(self.dist.rank, self.dist.world_size, self.dist.local_rank)

    def resume(self) -> tuple[Policy, TrainerState] | None:
        """The newest checkpoint's policy and state, if any. Ranks that read their own
        slices build the policy without HF weights (DCP fills every one), so they download
        neither the HF weights nor other ranks' shards."""
        own_slices = Policy.reads_own_slices(self.engine_options(), self.rank_info())
        return self.parts.checkpointer.restore(
            lambda model_dir: self.make_policy(model_dir, weights_from_checkpoint=own_slices),
            self.parts.scratch,
            skip_weights=own_slices,
        )

    def enter_stage(self, plan: StagePlan) -> None:
        """Start ``plan`` (fresh optimizer, DPO reference) or continue it after a resume."""
        self.stages.plan = plan
        stage = plan.spec
        if self.step == plan.first_step - 1:  # fresh
            self.policy.optimization.reset(
                resolved(stage.learning_rate, "learningRate"),
                resolved(stage.weight_decay, "weightDecay"),
                stage_schedule(plan),
            )
            if plan.type == "rl" and plan.index > 0:
                # KL to the model this stage starts from, not to the original base model
                self.policy.anchor_reference()
            self.stages.state = {}
            if plan.type == "dpo":
                self.stages.state = reference_logps(
                    self.policy, plan, self.parts.stage_data[plan.name], self.algo.seed
                )
            self.stages.started(plan, self.stage_skips(plan))
            self.live.reporter.event(
                "Normal",
                STAGE_STARTED,
                f"stage {plan.name} ({plan.type}) started: steps "
                f"{plan.first_step}-{plan.last_step}, {_stage_summary(plan)}",
            )
        else:  # the optimizer's moments came from the checkpoint; the curve is the stage's
            self.policy.optimization.set_schedule(
                resolved(stage.learning_rate, "learningRate"), stage_schedule(plan)
            )
            log.info(
                "resuming stage %s (%s) after step %d of %d-%d",
                plan.name,
                plan.type,
                self.step,
                plan.first_step,
                plan.last_step,
            )
        if plan.type == "rl":
            self.parts.rollouts.start(plan.last_step, self.step, self.episodes)
        with self.live.editing() as status:
            status.stage = plan.name
        self.report_progress()

    def end_stage(self, plan: StagePlan) -> None:
        """After an SFT/DPO stage's last step: publish, evaluate, checkpoint (the next stage
        starts from exactly these weights), then announce."""
        self.version += 1
        self.parts.publisher.publish(self.policy, self.version, durable=True)  # every rank
        self.dist.barrier()
        score = None
        if self.inline_eval:
            self.final_eval = self.evaluate(self.step)
            with self.live.editing() as status:
                status.eval_accuracy = self.final_eval.accuracy
            score = self.final_eval.overall
        self.close_stage_record(plan)
        self.save_checkpoint(score)  # collective: every rank writes its shards
        self.announce_stage_end(plan)

    def close_stage_record(self, plan: StagePlan) -> None:
        """Mark ``plan`` Succeeded in status.stages, with the held-out accuracy after it."""
        latest = self.final_eval
        accuracy = latest.accuracy if latest is not None and latest.step == plan.last_step else {}
        self.stages.succeeded(plan, accuracy, self.stage_skips(plan))

    def announce_stage_end(self, plan: StagePlan) -> None:
        accuracy = ", ".join(f"{d}={a:.1%}" for d, a in self.live.status.eval_accuracy.items())
        self.live.reporter.event(
            "Normal",
            STAGE_SUCCEEDED,
            f"stage {plan.name} ({plan.type}) finished at step {plan.last_step}"
            + (f"; held-out accuracy {accuracy}" if accuracy else ""),
        )

    def stage_skips(self, plan: StagePlan) -> dict[str, int]:
        data = self.parts.stage_data.get(plan.name)
        return dict(data.skipped) if data is not None else {}

    def make_episode_sampler(self) -> EpisodeSampler | None:
        """Domains with an ``environment`` are sampled as multi-turn episodes (None: none)."""
        environments = {
            d.name: d.environment
            for d in self.spec.domains
            if getattr(d, "environment", None) is not None
        }
        if not environments:
            return None
        from posttrain.envs.training import EpisodeSampler

        return EpisodeSampler(
            self.client,
            self.policy.tokenizer,
            environments,
            max_concurrency=self.spec.rollout.max_in_flight,
            sandbox=self.spec.sandbox,
            contract=self.contract,
        )

    def observe(self, batch: Any, prepared: Any) -> None:
        """Feed the curriculum, the audit and the trajectory store with a scored batch."""
        parts = self.parts
        for task, pass_rate in zip(batch.request.tasks, prepared.group_pass_rates, strict=True):
            if pass_rate is not None:  # None: every episode errored, nothing was learnt
                parts.data.curriculum.observe(task, pass_rate, self.step)
        if prepared.masked_samples:
            log.warning(
                "step %d: %d sample(s) masked out of the loss: their judge or reward model "
                "could not score them (posttrain_scorer_masked_samples_total)",
                self.step,
                prepared.masked_samples,
            )
        parts.auditor.observe_batch(self.step, prepared.trajectories)
        for trajectory in prepared.trajectories:
            parts.trajectories.append(trajectory_record(trajectory))

    def evaluate(self, at_step: int) -> EvalResult:
        """Greedy held-out accuracy (and the regression set) from the rollout server."""
        data = self.parts.data
        concurrency = self.spec.sandbox.max_concurrency
        result = self._evaluate_split("heldout", data.heldout, at_step, concurrency)
        save_eval(result, self.out_dir)
        if data.regression:  # (evaluate_tasks' own default concurrency, as it always had)
            save_eval(self._evaluate_split("regression", data.regression, at_step), self.out_dir)
        return result

    def _evaluate_split(
        self, split: str, tasks: Any, at_step: int, max_concurrency: int = 2
    ) -> EvalResult:
        return evaluate_tasks(
            self.client,
            self.policy.encode_prompt,
            tasks,
            self.parts.data.verifiers,
            step=at_step,
            split=split,
            max_new_tokens=self.algo.max_new_tokens,
            temperature=self.spec.evaluation.temperature,
            max_concurrency=max_concurrency,
            verify=self.parts.verify,
            episodes=self.episodes,
        )

    def save_checkpoint(self, eval_score: float | None) -> str:
        """Checkpoint weights, optimizer, curriculum, the not-yet-trained rollouts and the
        current stage's state."""
        parts = self.parts
        waiting, done = parts.rollouts.buffered()
        state = TrainerState(
            self.step,
            self.version,
            parts.data.curriculum.state_dict(),
            parts.auditor.state_dict(),
            [request_to_json(r) for r in waiting],
            [batch_to_json(b) for b in done],
            self.algo.seed,
            stage=self.stages.plan.name,
            stage_state=self.stages.state,
            stages=self.stages.records,
        )
        # Trajectories up to this step become durable before the checkpoint that covers
        # them: a resumed run re-samples only what no checkpoint covers (none lost).
        parts.trajectories.flush()
        path = parts.checkpointer.save(self.policy, state, eval_score=eval_score)
        self.last_checkpoint = path
        with self.live.editing() as status:
            status.last_checkpoint = path
        return path

    def sync_outputs(self) -> None:
        """Upload new or changed output files (never fails the run: the next sync retries)."""
        outputs = self.parts.outputs
        if outputs is None:
            return
        try:
            outputs.sync(output_files(self.out_dir))
        except Exception as exc:
            log.warning(
                "could not upload outputs to %s (retried at the next step): %s", outputs.uri(), exc
            )

    def report_progress(self) -> None:
        verification = self.parts.verification
        self.live.report(
            self.step,
            self.version,
            self.stages.records,
            verification.health if verification is not None else None,
        )

    def report_sandbox(self, health: Any) -> None:  # verification.SandboxHealth
        """Verifier threads' health reports (the operator's SandboxAvailable condition)."""
        self.live.report_sandbox(health)

    def finish(self, interrupted: bool = False) -> float:
        """Stop the producer, flush outputs, write plots and the report; wall seconds."""
        self.parts.close()
        self.parts.auditor.write_spot_checks()
        plot_run(self.out_dir, kl_coef=self.algo.kl_coef)
        plans = self.parts.plans
        total = plans[-1].last_step
        with self.live.editing() as status:  # phase, message: status.json only (operator's)
            status.phase = "Succeeded" if self.step >= total else "Running"
            if interrupted and self.step < total:
                status.phase = INTERRUPTED
                status.message = f"stopped by Ctrl-C after step {self.step}"
        self.report_progress()
        wall = time.monotonic() - self.started
        facts = {
            "steps": self.step,
            "wall time": f"{wall:.0f}s",
            "model": self.spec.model,
            "algorithm": self.algo.name,
            "stages": " -> ".join(
                f"{p.name} ({p.type}, steps {p.first_step}-{p.last_step})" for p in plans
            ),
        }
        write_report(self.out_dir, "posttrain run report", facts, stages=self.stages.records)
        self.sync_outputs()
        return wall


def _stage_summary(plan: StagePlan) -> str:
    """The hyper-parameters an event about ``plan`` names.

    >>> from posttrain.api import StageSpec
    >>> _stage_summary(StagePlan(0, StageSpec(name="d", type="dpo", learning_rate=1e-6,
    ...                                       batch_size=8, beta=0.1), 1, 2))
    'lr 1e-06, batch 8, beta 0.1'
    """
    stage = plan.spec
    parts = [f"lr {stage.learning_rate:g}"]
    if plan.type != "rl":
        parts.append(f"batch {stage.batch_size}")
    if plan.type == "dpo":
        parts.append(f"beta {stage.beta:g}")
    return ", ".join(parts)
