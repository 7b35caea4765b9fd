"""This process's place in a multi-rank job, and the two collectives the loop needs from it.

Below both the launcher (:mod:`posttrain.trainer.run.distributed`, which starts ranks and calls
the loop) and the loop (:mod:`posttrain.trainer.run.loop`, which every rank runs), so neither
imports the other's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this node (they share its memory)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        """Wait until every rank gets here (no-op in a single process).

        The loop calls this after rank 0 published a step's weights, so that no rank
        samples its next batch before the rollout pool serves those weights.
        """
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (collective with several ranks):
        decisions that start collectives, such as checkpointing, must be the same everywhere.
        """
        if self.world_size <= 1:
            return flag
        import torch
        import torch.distributed as dist

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        value = torch.tensor([int(flag)], device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
