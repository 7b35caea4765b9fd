"""Checkpoints that resume *exactly*: weights, optimizer, RNGs, curriculum, buffered rollouts.

A checkpoint directory is also a plain Hugging Face model directory (``config.json`` +
safetensors + tokenizer at its top level, streamed from the shards tensor by tensor), so
``posttrain eval --model DIR/checkpoints/latest`` and ``posttrain serve`` load it with no
conversion. The training state proper is a ``torch.distributed.checkpoint`` (DCP) directory
``dcp/``: the fp32 master weights and AdamW moments, each rank writing its own shards
(``__<rank>_0.distcp``, rank 0 the ``.metadata``), so saving never gathers the model and a
run resumes on a **different number of ranks** (DCP reshards on load). Each data file has a
block index beside it, so a resuming rank fetches only the slices it reads
(:mod:`posttrain.trainer.checkpointing.shard_reads`). Next to them sit
``rng.pt`` (torch/python RNG states) and ``trainer_state.json`` (step, weight version,
curriculum and audit state, and rollouts that were sampled or requested but not yet
trained on). Every rank uploads its own files; rank 0 commits the directory with the
storage component's manifest-last protocol (:class:`CheckpointManager`), which keeps the
newest ``keep_last`` plus the best by held-out accuracy.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from posttrain.storage.blocks import DEFAULT_BLOCK_BYTES, write_block_index
from posttrain.storage.commit import Manifest
from posttrain.storage.errors import CorruptArtifactError
from posttrain.trainer.checkpointing.shard_reads import (
    DATA_SUFFIX,
    OnDemandReader,
    ShardSource,
    read_on_demand,
)
from posttrain.trainer.data.datasets import Task
from posttrain.trainer.data.rollouts import RolloutBatch, RolloutRequest

if TYPE_CHECKING:
    from posttrain.trainer.model.policy import Policy

log = logging.getLogger(__name__)

# DCP says this on every save and load of a one-process run (the laptop and the dev cluster's
# single trainer pod), where one process is exactly what is meant: not actionable.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"  # checkpoints written before DCP: full optimizer state
RNG_FILE = "rng.pt"
SHARDED_DIR = "dcp"


@dataclass
class TrainerState:
    """Everything besides tensors that a resumed run needs."""

    step: int
    weight_version: int
    curriculum: dict[str, Any]
    audit: dict[str, Any]
    pending_requests: list[dict[str, Any]]
    sampled_batches: list[dict[str, Any]]
    seed: int
    stage: str = ""  # the pipeline stage that wrote it ("" before stages existed: rl)
    stage_state: dict[str, Any] = field(default_factory=dict)  # e.g. DPO reference log-probs
    stages: list[dict[str, Any]] = field(default_factory=list)  # status.stages so far


def request_to_json(request: RolloutRequest) -> dict[str, Any]:
    return {
        "batch_index": request.batch_index,
        "tasks": [t.to_dict() for t in request.tasks],
        "prompt_ids": request.prompt_ids,
        "seed": request.seed,
    }


def request_from_json(data: dict[str, Any]) -> RolloutRequest:
    return RolloutRequest(
        batch_index=int(data["batch_index"]),
        tasks=[Task.from_dict(t) for t in data["tasks"]],
        prompt_ids=[list(ids) for ids in data["prompt_ids"]],
        seed=int(data["seed"]),
    )


def batch_to_json(batch: RolloutBatch) -> dict[str, Any]:
    return {
        "request": request_to_json(batch.request),
        "seconds": batch.seconds,
        "error": batch.error,
        "completions": [
            [
                c.to_json()
                if hasattr(c, "to_json")
                else {  # episodes carry their turns
                    "prompt_index": c.prompt_index,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                    "weight_version": c.weight_version,
                }
                for c in group
            ]
            for group in batch.completions
        ],
    }


def batch_from_json(data: dict[str, Any]) -> RolloutBatch:
    from posttrain.rollout.protocol import Completion

    def completion(c: dict[str, Any]) -> Any:
        if c.get("kind") == "episode":
            from posttrain.envs.training import completion_from_json

            return completion_from_json(c)
        return Completion(**c)

    return RolloutBatch(
        request=request_from_json(data["request"]),
        completions=[[completion(c) for c in group] for group in data["completions"]],
        seconds=float(data["seconds"]),
        error=data.get("error"),
    )


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def save_training_state(policy: Policy, dest: Path) -> None:
    """DCP-save the policy's weights and optimizer state under ``dest`` (collective).

    Each rank writes only the shards it holds; nothing is gathered.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(policy.module, policy.optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(dest),
        no_dist=not _distributed(),
    )


def load_training_state(policy: Policy, source: Path, shards: ShardSource | None = None) -> None:
    """Load weights and optimizer state saved by :func:`save_training_state`, resharded to
    this run's ranks (any world size). With ``shards`` the DCP data files are not local yet:
    only the slices this rank reads are fetched
    (:mod:`posttrain.trainer.checkpointing.shard_reads`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(policy.module, policy.optimizer)
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}  # DCP's STATE_DICT_TYPE
    reader = OnDemandReader(source, shards) if shards is not None else None
    dcp.load(state, checkpoint_id=str(source), storage_reader=reader, no_dist=not _distributed())
    set_state_dict(
        policy.module,
        policy.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def _all_gather(value: Any, world_size: int) -> list[Any]:
    if world_size <= 1:
        return [value]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


class Checkpointer:
    """Writes and restores trainer checkpoints through a storage ``CheckpointManager``."""

    def __init__(
        self,
        store: Any,
        keep_last: int,
        keep_best: bool,
        pinned_steps: frozenset[int] = frozenset(),
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        *,
        run_uid: str | None = None,
        resume_from: str | None = None,
    ) -> None:
        """``store`` is this run's own storage (in a cluster ``<root>/<uid>``; on a laptop the
        ``--out`` directory): its checkpoints are always resumed first. ``resume_from`` (the
        URI spec.resumeFrom resolves to) is read only when there are none; ``run_uid`` is
        recorded in every checkpoint and never resumed from through ``resume_from``."""
        from posttrain.storage.checkpoints import CheckpointManager

        self.store = store
        self.keep_best = keep_best
        self.block_bytes = block_bytes
        self.run_uid = run_uid
        self.resume_from = resume_from
        # (bytes fetched, bytes of sharded state) by the last restore on this rank
        self.last_shard_fetch: tuple[int, int] | None = None
        self.manager = CheckpointManager(
            store, "checkpoints", keep_last=keep_last, pinned=pinned_steps
        )
        self.source: ResumeSource | None = None  # resolved from resume_from by restore()
        self.resumed_from: str | None = None  # URI of the checkpoint restore() loaded

    def save(self, policy: Policy, state: TrainerState, eval_score: float | None = None) -> str:
        """Commit a checkpoint of ``state.step``; returns its URI.

        Collective: every rank calls it. Each rank writes and uploads its own files; rank 0
        adds the HF export, RNG and trainer state and commits (manifest last).
        """
        rank = getattr(policy, "rank", None)
        world, is_main = (rank.world_size, rank.rank == 0) if rank is not None else (1, True)
        with tempfile.TemporaryDirectory(prefix="posttrain-ckpt-") as tmp:
            local = Path(tmp)
            policy.save_weights(local)  # collective gathers; rank 0 writes
            save_training_state(policy, local / SHARDED_DIR)
            for data in sorted((local / SHARDED_DIR).glob(f"*{DATA_SUFFIX}")):
                write_block_index(data, self.block_bytes)  # a resuming rank fetches its slices
            if not is_main:
                part = self.manager.upload_part(state.step, local)
                _all_gather(part, world)
            else:
                torch.save(capture_rng(), local / RNG_FILE)
                (local / STATE_FILE).write_text(json.dumps(state.__dict__))
                others = tuple(f for part in _all_gather((), world)[1:] for f in part)
                self.manager.save(
                    state.step,
                    local,
                    metadata={
                        "weight_version": state.weight_version,
                        "world_size": world,
                        "run_uid": self.run_uid,  # whose checkpoint this is
                        "resumed_from": self.resumed_from,  # what this attempt started from
                    },
                    eval_score=eval_score if self.keep_best else None,
                    extra_files=others,
                )
        uri = self.store.uri(self.manager.step_prefix(state.step))
        if is_main:
            self._link_latest(uri)
        return uri

    def _link_latest(self, uri: str) -> None:
        """On a local store, point ``checkpoints/latest`` at the newest checkpoint directory."""
        if not uri.startswith("file://"):
            return
        target = Path(uri.removeprefix("file://"))
        link = target.parent / "latest"
        tmp_link = target.parent / f".latest.{os.getpid()}"
        if tmp_link.is_symlink() or tmp_link.exists():
            tmp_link.unlink()
        tmp_link.symlink_to(target.name)
        tmp_link.replace(link)  # atomic: a reader sees the old or the new target

    def restore(
        self,
        policy_factory: Callable[[Path], Policy],
        scratch: Path,
        *,
        skip_weights: bool = False,
    ) -> tuple[Policy, TrainerState] | None:
        """Load the newest valid checkpoint: ``(policy, state)``, or None when there is none.

        ``policy_factory(model_dir)`` builds the policy from the checkpoint's HF weights;
        the exact fp32 weights and optimizer moments are then loaded from its DCP shards
        (resharded to this run's ranks; each rank fetches only the slices it reads), and the
        RNG states restored. ``skip_weights``: the factory builds a policy that reads its
        own slices without its HF weights (``Policy(weights_from_checkpoint=True)``), so the
        HF weight files are not downloaded at all. A checkpoint whose shards turn out damaged while they are read
        is refused on every rank alike (DCP gathers each rank's failure) and the previous
        one is loaded instead, as for damage found while downloading.
        """
        dest = scratch / "resume"
        manager, fixed_step = self.manager, None
        own_latest = self.manager.latest_step()
        if own_latest is not None:
            self._check_owner(own_latest)
        elif self.resume_from:
            self.source = find_resume_source(self.resume_from, self.run_uid)
            manager, fixed_step = self.source.manager, self.source.step
        include = lambda path: (  # noqa: E731
            not read_on_demand(path, SHARDED_DIR)
            and not (skip_weights and path.endswith(".safetensors"))
        )
        refused: set[int] = set()
        while True:
            if dest.exists():
                shutil.rmtree(dest)
            if fixed_step is not None:  # asking for step N means step N: no fallback
                found: tuple[int, Manifest] | None = (
                    fixed_step,
                    manager.load(fixed_step, dest, include=include),
                )
            else:
                found = manager.load_latest(dest, include=include, exclude=frozenset(refused))
            for reason in manager.last_refused:
                log.warning("skipped a damaged checkpoint: %s", reason)
            if found is None:
                return None
            step, manifest = found
            policy = policy_factory(dest)
            try:
                self._load_state(manager, policy, dest, step, manifest)
            except (Exception, CheckpointException) as exc:
                damage = _damage(exc)
                if damage is None or fixed_step is not None:
                    raise
                log.error(
                    "refusing checkpoint step %d: %s; falling back to the previous complete one",
                    step,
                    damage,
                )
                refused.add(step)
                continue
            break
        restore_rng(torch.load(dest / RNG_FILE, weights_only=False))
        state = TrainerState(**json.loads((dest / STATE_FILE).read_text()))
        self.resumed_from = manager.store.uri(manager.step_prefix(step))
        log.info(
            "resumed from checkpoint step %d at %s (weight version %d; written by %s rank(s)%s)",
            step,
            self.resumed_from,
            state.weight_version,
            manifest.metadata.get("world_size", 1),
            "" if manager is self.manager else "; spec.resumeFrom: another run's checkpoint",
        )
        return policy, state

    def _check_owner(self, step: int) -> None:
        """Refuse to resume, unasked, a checkpoint another TrainingRun object wrote. The
        operator keys default storage by uid, so this happens only with a spec.checkpoint.
        storageUri that a deleted run of the same name used (checkpoints written before they
        recorded a uid are taken as this run's)."""
        from posttrain.errors import UsageError
        from posttrain.storage.commit import read_manifest

        manifest = read_manifest(self.store, self.manager.step_prefix(step))
        owner = manifest.metadata.get("run_uid") if manifest is not None else None
        if owner and self.run_uid and owner != self.run_uid and not self.resume_from:
            uri = self.store.uri()
            raise UsageError(
                f"spec.checkpoint.storageUri {uri} holds checkpoints of another TrainingRun "
                f"object (uid {owner}; this one is {self.run_uid}): a new run starts fresh. "
                f"Continue that run with spec.resumeFrom: {{checkpoint: {uri}}}, or give "
                "this run a storageUri of its own"
            )

    def load_step(
        self, step: int, dest: Path, include: Callable[[str], bool] | None = None
    ) -> Manifest:
        """One checkpoint by step: this run's own, else (a run that began from
        spec.resumeFrom) the source run's, where its early steps, e.g. a KL anchor, live."""
        from posttrain.storage.errors import ArtifactNotFoundError

        try:
            return self.manager.load(step, dest, include=include)
        except (ArtifactNotFoundError, CorruptArtifactError):
            if self.source is None and self.resume_from:  # restarted after it began from it
                self.source = find_resume_source(self.resume_from, self.run_uid)
            if self.source is None:
                raise
            return self.source.manager.load(step, dest, include=include)

    def _load_state(
        self, manager: Any, policy: Policy, dest: Path, step: int, manifest: Manifest
    ) -> None:
        if (dest / SHARDED_DIR).is_dir():
            shards = ShardSource(
                manager.store, manager.step_prefix(step), manifest, dest, SHARDED_DIR
            )
            load_training_state(policy, dest / SHARDED_DIR, shards)
            self.last_shard_fetch = (shards.fetched_bytes, shards.total_bytes)
        else:  # written before sharded checkpoints: one process, full optimizer state
            policy.optimizer.load_state_dict(torch.load(dest / OPTIMIZER_FILE, weights_only=False))


FRESH_START = "fresh start"
"""status.resumedFrom of a run that started from its base model."""
_STEP_DIR = re.compile(r"step-(\d{8,})")


@dataclass
class ResumeSource:
    """Where spec.resumeFrom points: a checkpoint series, and one step of it or its newest."""

    manager: Any  # CheckpointManager over the source run's storage
    step: int | None = None


def find_resume_source(uri: str, own_uid: str | None) -> ResumeSource:
    """Resolve spec.resumeFrom (a URI, see ``ResumeFrom``) to a checkpoint series.

    ``uri`` is one of: a checkpoint (``.../checkpoints/step-00000012``); a run's storage
    with a ``checkpoints/`` series (its newest checkpoint; a local run's ``--out``); or, for
    ``resumeFrom.run``, the root every object of that name writes below (``<root>/<uid>/``):
    the series whose newest checkpoint was committed last, never this object's own
    (``own_uid``). Raises ``UsageError`` when there is no checkpoint: the spec asked for one.
    """
    from posttrain.errors import UsageError
    from posttrain.storage.checkpoints import CheckpointManager
    from posttrain.storage.commit import read_manifest
    from posttrain.storage.store import open_store

    # A relative path is a local run's --out, relative to where the trainer was started.
    remote_or_absolute = uri.startswith("/") or "://" in uri
    where = uri.rstrip("/") if remote_or_absolute else str(Path(uri).resolve())
    head, _, last = where.rpartition("/")
    match = _STEP_DIR.fullmatch(last)
    if match and head.endswith("/checkpoints"):
        store = open_store(head.removesuffix("/checkpoints"), create_bucket=False)
        return ResumeSource(CheckpointManager(store, "checkpoints"), int(match.group(1)))
    store = open_store(where, create_bucket=False)
    own = CheckpointManager(store, "checkpoints")
    if own.latest_step() is not None:
        return ResumeSource(own)
    newest: tuple[str, str] | None = None  # (commit time, incarnation)
    for key in store.list(""):
        parts = key.split("/")
        if len(parts) != 3 or parts[1:] != ["checkpoints", "latest.json"] or parts[0] == own_uid:
            continue
        manager = CheckpointManager(store, f"{parts[0]}/checkpoints")
        step = manager.latest_step()
        manifest = read_manifest(store, manager.step_prefix(step)) if step is not None else None
        if manifest is not None and (newest is None or manifest.created > newest[0]):
            newest = (manifest.created, parts[0])
    if newest is None:
        raise UsageError(
            f"spec.resumeFrom: no checkpoint under {store.uri()} (neither a checkpoints/ "
            "series nor an earlier run of that name with one); name a run or checkpoint "
            "that exists, or remove resumeFrom to start fresh"
        )
    return ResumeSource(CheckpointManager(store, f"{newest[1]}/checkpoints"))


def _damage(exc: BaseException) -> CorruptArtifactError | None:
    """The storage damage behind a failed load, if that is what failed it (on any rank)."""
    if isinstance(exc, CorruptArtifactError):
        return exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, CorruptArtifactError):
                return inner
    return None


def weights_only(path: str) -> bool:
    """The files of a checkpoint a reader of its HF weights needs (evaluation, a KL
    reference): everything but the training state.

    >>> weights_only("model.safetensors"), weights_only("dcp/__0_0.distcp")
    (True, False)
    """
    return not path.startswith(f"{SHARDED_DIR}/") and path != OPTIMIZER_FILE
