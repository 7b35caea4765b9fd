"""The components one training run is assembled from, built in one short place.

torchtitan's layout: each component owns its state (the data and its curriculum, the
checkpointer, the weight publisher, the trajectory store, the auditor, the rollout feed, the
verification backend) and :func:`assemble` wires them together from the spec, once, before
the first step. :class:`posttrain.trainer.run.loop.Run` then holds only what changes as the
run trains (policy, step, weight version, stage) and calls into these parts.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.api.env import TrainerEnv
from posttrain.storage.reports import ReportSync
from posttrain.trainer.algorithms.loss import LossConfig, loss_config
from posttrain.trainer.checkpointing.checkpoint import Checkpointer
from posttrain.trainer.data.rollout_feed import RolloutFeed
from posttrain.trainer.data.rundata import RunData, build_run_data
from posttrain.trainer.data.stage_data import StageData
from posttrain.trainer.model.dist_context import DistContext
from posttrain.trainer.model.weight_sync import WeightPublisher, all_on_this_host, serving_dtype
from posttrain.trainer.observe.audit import Auditor
from posttrain.trainer.rewards.scoring import VerifyFn
from posttrain.trainer.run.pipeline import StagePlan, load_pipeline_data, plan_stages

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec
    from posttrain.rollout.client import RolloutClient
    from posttrain.storage.trajectories import TrajectoryWriter


@dataclass
class RunParts:
    """What a run is made of; none of it changes identity while the run trains."""

    plans: list[StagePlan]  # the stages, in order (RL alone by default)
    data: RunData  # RL prompts, verifiers, curriculum, held-out and regression sets
    stage_data: dict[str, StageData]  # each SFT/DPO stage's data, read up front
    base_dir: Path  # the base model's HF directory
    checkpointer: Checkpointer
    publisher: WeightPublisher  # weight versions for the rollout servers
    trajectories: TrajectoryWriter  # every scored sample, for analysis and audits
    auditor: Auditor
    rollouts: RolloutFeed
    outputs: ReportSync | None  # the run's reports uploaded as written (cluster runs)
    scratch: Path  # this process's temporary directory, removed by close()
    loss_config: LossConfig
    verify: VerifyFn
    verification: Any  # trainer.rewards.verification.Verification; None: the caller's verify

    def close(self) -> None:
        """Stop the rollout producer and the publisher, flush trajectories, free scratch."""
        self.rollouts.close()
        self.publisher.close()
        self.trajectories.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def assemble(
    spec: TrainingRunSpec,
    out_dir: Path,
    client: RolloutClient,
    dist: DistContext,
    contract: TrainerEnv,
    verify: VerifyFn | None,
    on_sandbox_health: Callable[[Any], None],
) -> RunParts:
    """Build every part of a run from its spec. SFT/DPO data is read here, so a missing
    file fails the run before any training."""
    from transformers import AutoTokenizer

    from posttrain.models import resolve_model
    from posttrain.storage.store import open_store
    from posttrain.storage.trajectories import TrajectoryWriter

    verification: Any = None
    if verify is None:  # spec.sandbox decides where code runs (trainer/rewards/verification.py)
        from posttrain.trainer.rewards.verification import build_verification

        verification = build_verification(
            spec.sandbox, on_health=on_sandbox_health, contract=contract
        )
        verify = verification.verify
    out_dir.mkdir(parents=True, exist_ok=True)
    plans = plan_stages(spec)
    base_dir = resolve_model(spec.model)
    store = open_store(spec.checkpoint.storage_uri or str(out_dir.resolve()))
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-train-"))
    algo = spec.algorithm
    data = build_run_data(spec, seed_offset=dist.rank)  # each rank its own prompts
    return RunParts(
        plans=plans,
        data=data,
        stage_data=load_pipeline_data(plans, AutoTokenizer.from_pretrained(base_dir)),
        base_dir=base_dir,
        checkpointer=_checkpointer(spec, plans, store, contract),
        publisher=_publisher(store, client, scratch, contract),
        trajectories=TrajectoryWriter(
            store, "trajectories", out_dir / "spool", writer_id=f"rank{dist.rank}"
        ),
        auditor=Auditor(
            out_dir, spec.audit.spot_check_samples if spec.audit.enabled else 0, algo.seed
        ),
        rollouts=_rollout_feed(spec, client, data, dist),
        # With storage of its own (always in a cluster), the run's outputs go there as they
        # are written: a pod's emptyDir dies with the pod and with every gang restart.
        outputs=ReportSync(store) if spec.checkpoint.storage_uri and dist.is_main else None,
        scratch=scratch,
        loss_config=loss_config(algo),
        verify=verify,
        verification=verification,
    )


def kl_anchor_steps(spec: TrainingRunSpec, plans: list[StagePlan]) -> frozenset[int]:
    """Checkpoints that hold an RL stage's KL anchor (the step before it starts), kept
    through retention so a resume inside that stage reloads the same anchor."""
    if spec.algorithm.kl_coef <= 0:
        return frozenset()
    return frozenset(p.first_step - 1 for p in plans if p.type == "rl" and p.index > 0)


def _checkpointer(
    spec: TrainingRunSpec, plans: list[StagePlan], store: Any, contract: TrainerEnv
) -> Checkpointer:
    """The run's checkpoints in ``store``, under its identity: its TrainingRun's uid in a
    cluster; on a laptop none, and the --out directory (its own storage) is what it
    resumes from."""
    return Checkpointer(
        store,
        spec.checkpoint.keep_last,
        spec.checkpoint.keep_best,
        pinned_steps=kl_anchor_steps(spec, plans),
        run_uid=contract.run_uid,
        resume_from=resume_source(spec),
    )


def _publisher(store: Any, client: Any, scratch: Path, contract: TrainerEnv) -> WeightPublisher:
    """Weight versions for the rollout servers, in the pool's serving dtype (None: ours)."""
    from posttrain.storage.checkpoints import WeightRegistry

    return WeightPublisher(
        WeightRegistry(store, "weights", keep_last=2),
        store.uri("weights"),
        client,
        scratch,
        shared=all_on_this_host(getattr(client, "urls", [])),
        dtype=serving_dtype(contract.rollout_dtype),
    )


def _rollout_feed(
    spec: TrainingRunSpec, client: RolloutClient, data: RunData, dist: DistContext
) -> RolloutFeed:
    """Sampling in the background, up to ``maxPolicyLag`` versions ahead of training."""
    from posttrain.rollout.protocol import SamplingParams

    algo = spec.algorithm
    return RolloutFeed(
        client,
        SamplingParams(
            n=algo.group_size,
            max_tokens=algo.max_new_tokens,
            temperature=algo.temperature,
            top_p=algo.top_p,
        ),
        data.curriculum,
        prompts_per_rank=max(1, algo.prompts_per_step // dist.world_size),
        max_policy_lag=algo.max_policy_lag,
        seed=algo.seed,
    )


def resume_source(spec: TrainingRunSpec) -> str | None:
    """spec.resumeFrom as the URI :class:`Checkpointer` reads. The operator resolves
    ``run: NAME`` to that name's storage root; a local run has no run names to resolve."""
    source = spec.resume_from
    if source is None:
        return None
    if source.run is not None:
        from posttrain.errors import UsageError

        raise UsageError(
            f"spec.resumeFrom.run {source.run!r} names a TrainingRun in a cluster; a local run "
            "resumes from a directory: resumeFrom: {checkpoint: RUNS/OTHER} (its --out)"
        )
    return source.checkpoint
