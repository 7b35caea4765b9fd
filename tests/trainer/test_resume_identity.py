"""A run's checkpoints belong to the object that wrote them: a new object starts fresh unless
spec.resumeFrom names a run or checkpoint, a restart of the same object resumes its own, and
the trainer always knows which checkpoint it began from (issue #35, item 3)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from posttrain.errors import UsageError
from posttrain.storage.checkpoints import CheckpointManager
from posttrain.storage.store import LocalStore
from posttrain.trainer.checkpointing.checkpoint import (
    Checkpointer,
    TrainerState,
    find_resume_source,
)
from posttrain.trainer.model.policy import Policy

LR = 1e-3


def _commit(store: LocalStore, prefix: str, step: int, tmp: Path) -> None:
    """A committed checkpoint directory (manifest last), as the trainer leaves one."""
    local = tmp / f"{prefix.replace('/', '_')}-{step}"
    local.mkdir(parents=True)
    (local / "trainer_state.json").write_text(json.dumps({"step": step}))
    CheckpointManager(store, prefix).save(step, local, metadata={})


def test_resume_source_forms_and_the_newest_earlier_object(tmp_path: Path) -> None:
    root = tmp_path / "runs/ns/dev-run"  # every object named dev-run writes below <uid>/
    store = LocalStore(root)
    _commit(store, "uid-old/checkpoints", 3, tmp_path)
    time.sleep(1.1)  # commit times (whole seconds) order the incarnations
    _commit(store, "uid-new/checkpoints", 1, tmp_path)

    # resumeFrom.run: the series committed last, whatever its step number ...
    newest = find_resume_source(str(root), own_uid="uid-self")
    assert newest.step is None and newest.manager.store.uri() == f"file://{root}"
    assert newest.manager.step_prefix(1) == "uid-new/checkpoints/step-00000001"
    # ... never the object's own (a run re-created as itself takes the one before it)
    older = find_resume_source(str(root), own_uid="uid-new")
    assert older.manager.latest_step() == 3
    assert older.manager.step_prefix(3) == "uid-old/checkpoints/step-00000003"

    # A run's storage: its own series. One checkpoint: exactly that step.
    whole = find_resume_source(str(root / "uid-old"), own_uid=None)
    assert whole.step is None and whole.manager.latest_step() == 3
    assert whole.manager.step_prefix(3) == "checkpoints/step-00000003"
    one = find_resume_source(f"file://{root}/uid-old/checkpoints/step-00000003", own_uid=None)
    assert one.step == 3 and one.manager.latest_step() == 3

    # Asked for, but nothing there: the spec is wrong, and the error says what to do.
    with pytest.raises(UsageError, match=r"no checkpoint under .*remove resumeFrom"):
        find_resume_source(str(tmp_path / "runs/ns/never"), own_uid=None)
    with pytest.raises(UsageError, match="no checkpoint"):  # only its own: not a source
        _commit(LocalStore(tmp_path / "solo"), "uid-solo/checkpoints", 1, tmp_path)
        find_resume_source(str(tmp_path / "solo"), own_uid="uid-solo")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from posttrain.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=1)


def _checkpointer(root: Path, uid: str, resume_from: str | None = None) -> Checkpointer:
    return Checkpointer(
        LocalStore(root / uid), keep_last=2, keep_best=False, run_uid=uid, resume_from=resume_from
    )


def test_new_object_fresh_unless_asked_same_object_resumes_its_own(
    tiny_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "runs/ns/dev-run"
    scratch = tmp_path / "scratch"

    def restore(ckpt: Checkpointer) -> tuple[Policy, TrainerState] | None:
        return ckpt.restore(lambda d: Policy(d, learning_rate=LR), scratch)

    first = _checkpointer(root, "uid-1")
    policy = Policy(tiny_model, learning_rate=LR)
    with torch.no_grad():
        next(policy.module.parameters()).add_(0.25)  # weights the base model does not have
    first.save(policy, TrainerState(3, 3, {}, {}, [], [], 0))
    manifest = json.loads((root / "uid-1/checkpoints/step-00000003/manifest.json").read_text())
    assert manifest["metadata"]["run_uid"] == "uid-1"

    # Deleted and applied again: a new uid, no resumeFrom -> the base model.
    again = _checkpointer(root, "uid-2")
    assert restore(again) is None and again.resumed_from is None

    # ... with resumeFrom.run (the operator hands the trainer the name's root).
    forked = _checkpointer(root, "uid-3", resume_from=str(root))
    back = restore(forked)
    assert back is not None and back[1].step == 3
    assert forked.resumed_from == f"file://{root}/uid-1/checkpoints/step-00000003"
    torch.testing.assert_close(next(back[0].module.parameters()), next(policy.module.parameters()))
    forked.save(back[0], TrainerState(4, 4, {}, {}, [], [], 0))
    recorded = json.loads((root / "uid-3/checkpoints/step-00000004/manifest.json").read_text())
    assert recorded["metadata"]["resumed_from"] == forked.resumed_from

    # The same object killed and restarted: its own newest checkpoint, not the source's.
    restarted = _checkpointer(root, "uid-3", resume_from=str(root))
    back = restore(restarted)
    assert back is not None and back[1].step == 4
    assert restarted.resumed_from == f"file://{root}/uid-3/checkpoints/step-00000004"


def test_a_storage_uri_of_ones_own_refuses_another_objects_checkpoints_unasked(
    tiny_model: Path, tmp_path: Path
) -> None:
    """spec.checkpoint.storageUri is used as given, so a re-created run meets the deleted
    one's checkpoints there: it stops with what to do instead of silently continuing them."""
    shared = tmp_path / "team/exp1"
    scratch = tmp_path / "scratch"
    Checkpointer(LocalStore(shared), keep_last=2, keep_best=False, run_uid="uid-a").save(
        Policy(tiny_model, learning_rate=LR), TrainerState(2, 2, {}, {}, [], [], 0)
    )
    new = Checkpointer(LocalStore(shared), keep_last=2, keep_best=False, run_uid="uid-b")
    with pytest.raises(UsageError, match=r"another TrainingRun object \(uid uid-a.*resumeFrom"):
        new.restore(lambda d: Policy(d, learning_rate=LR), scratch)
    asked = Checkpointer(
        LocalStore(shared), keep_last=2, keep_best=False, run_uid="uid-b", resume_from=str(shared)
    )
    back = asked.restore(lambda d: Policy(d, learning_rate=LR), scratch)
    assert back is not None and back[1].step == 2
    # A laptop run (no uid) is its --out directory: it resumes what is there, as before.
    local = Checkpointer(LocalStore(shared), keep_last=2, keep_best=False)
    assert local.restore(lambda d: Policy(d, learning_rate=LR), scratch) is not None
