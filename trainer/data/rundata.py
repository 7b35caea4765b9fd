"""Turning a TrainingRun spec into the objects the loop uses (data, verifiers, sampling).

Kept out of :mod:`posttrain.trainer.run.loop` so the loop reads as the algorithm only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posttrain.errors import UsageError
from posttrain.trainer.data.curriculum import Curriculum, DomainPool
from posttrain.trainer.data.datasets import (
    BENCHMARK_NAMES,
    BUILTIN_GENERATORS,
    Task,
    group_by_stratum,
    load_jsonl_tasks,
    load_tasks,
    split_tasks,
)

if TYPE_CHECKING:
    from posttrain.api import TrainingRunSpec

VerifierSpecs = dict[str, tuple[str | None, dict[str, Any]]]


@dataclass
class RunData:
    """Training pools, held-out and regression items, and each domain's verifier."""

    curriculum: Curriculum
    heldout: list[Task]
    regression: list[Task]
    verifiers: VerifierSpecs

    def executes_code(self) -> bool:
        """Whether a domain's verifier runs completions in the sandbox (unit_tests, shell)."""
        return any(kind in ("unit_tests", "shell") for kind, _ in self.verifiers.values())


def balanced_subset(tasks: list[Task], limit: int) -> list[Task]:
    """Up to ``limit`` tasks taken round-robin across strata (so eval covers every level).

    >>> ts = [Task("d", f"p{i}", "1", difficulty=s) for i, s in enumerate("aabbb")]
    >>> [t.prompt for t in balanced_subset(ts, 3)]
    ['p0', 'p2', 'p1']
    """
    strata = list(group_by_stratum(tasks).values())
    out: list[Task] = []
    depth = 0
    while len(out) < limit and any(depth < len(s) for s in strata):
        out += [s[depth] for s in strata if depth < len(s)][: limit - len(out)]
        depth += 1
    return out


def domain_tasks(
    name: str, dataset: str, eval_dataset: str | None
) -> tuple[list[Task], list[Task]]:
    """(train, held-out) tasks of one domain; never overlapping.

    Built-ins split by content hash; a JSONL file without an eval file is split the same
    way; with an eval file, any training item that also appears there is removed.
    """
    if dataset.startswith("builtin:"):
        train = load_tasks(dataset, name, "train")
        held = (
            load_tasks(eval_dataset, name, "eval")
            if eval_dataset
            else load_tasks(dataset, name, "eval")
        )
    elif eval_dataset:
        held = load_tasks(eval_dataset, name, "eval")
        held_ids = {t.task_id for t in held}
        train = [t for t in load_tasks(dataset, name, "train") if t.task_id not in held_ids]
    else:
        everything = load_tasks(dataset, name, "train")
        train, held = split_tasks(everything, "train"), split_tasks(everything, "eval")
    if not train:
        raise UsageError(f"domain {name!r}: dataset {dataset!r} yields no training items")
    return train, held


def check_dataset_sources(spec: TrainingRunSpec) -> None:
    """Fail with a UsageError naming the field when a dataset cannot be found.

    Only names and paths are checked (nothing is loaded), so ``posttrain run`` can do it
    before it creates ``--out`` or starts a rollout server that takes seconds to load.
    """
    sources = []
    for index, domain in enumerate(spec.domains):
        sources.append((f"spec.domains[{index}].dataset", domain.dataset))
        if domain.eval_dataset:
            sources.append((f"spec.domains[{index}].evalDataset", domain.eval_dataset))
    if spec.evaluation.regression_dataset:
        sources.append(("spec.evaluation.regressionDataset", spec.evaluation.regression_dataset))
    for field_path, source in sources:
        if source.startswith("builtin:"):
            name = source.removeprefix("builtin:")
            if name not in BUILTIN_GENERATORS and name not in BENCHMARK_NAMES:
                known = ", ".join(f"builtin:{n}" for n in (*BUILTIN_GENERATORS, *BENCHMARK_NAMES))
                raise UsageError(f"{field_path}: unknown built-in dataset {source!r}; use {known}")
        elif "://" in source and not source.startswith("file://"):
            continue  # remote (s3://): checked where it is read, with the store's own errors
        elif not Path(source.removeprefix("file://")).is_file():
            raise UsageError(
                f"{field_path}: dataset file {source!r} does not exist (relative paths are "
                f"resolved from {Path.cwd()}); give a JSONL file or builtin:NAME"
            )


def build_run_data(spec: TrainingRunSpec, seed_offset: int = 0) -> RunData:
    """Load every domain of ``spec`` (a TrainingRunSpec) and build the curriculum."""
    pools, heldout = [], []
    verifiers: VerifierSpecs = {}
    limit = spec.evaluation.max_items_per_domain
    for domain in spec.domains:
        train, held = domain_tasks(domain.name, domain.dataset, domain.eval_dataset)
        try:
            pools.append(DomainPool.from_tasks(domain.name, train, domain.weight, domain.strata))
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        heldout += balanced_subset(held, limit)
        if domain.verifier is not None:  # an environment domain is judged by its environment
            verifiers[domain.name] = (domain.verifier.kind, domain.verifier.scorer_config())
    regression: list[Task] = []
    if spec.evaluation.regression_dataset:
        regression = load_jsonl_tasks(spec.evaluation.regression_dataset)
    curriculum_spec = spec.curriculum
    curriculum = Curriculum(
        [p for p in pools if p.weight > 0],
        enabled=curriculum_spec.enabled,
        promote_at=curriculum_spec.promote_at,
        window=curriculum_spec.window,
        replay_fraction=curriculum_spec.replay_fraction,
        min_domain_fraction=curriculum_spec.min_domain_fraction,
        seed=spec.algorithm.seed + seed_offset,
    )
    return RunData(curriculum, heldout, regression, verifiers)
