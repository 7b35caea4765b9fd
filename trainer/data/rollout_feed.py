"""The RL stage's batches: prompts chosen up to ``maxPolicyLag`` steps ahead, sampled in the
background, and what a checkpoint keeps of them.

:class:`RolloutFeed` owns the rollout producer and its bookkeeping (the highest batch index
whose prompts were chosen, the stage's last step, the requests and batches a checkpoint
restored), so the run holds one component instead of five attributes set at different times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from posttrain.trainer.data.rollouts import RolloutBatch, RolloutProducer, RolloutRequest

if TYPE_CHECKING:
    from posttrain.rollout.client import RolloutClient
    from posttrain.rollout.protocol import SamplingParams
    from posttrain.trainer.data.curriculum import Curriculum


class RolloutFeed:
    """Batches for the RL steps, each from the curriculum's next prompts."""

    def __init__(
        self,
        client: RolloutClient,
        sampling: SamplingParams,
        curriculum: Curriculum,
        *,
        prompts_per_rank: int,
        max_policy_lag: int,
        seed: int,
    ) -> None:
        self.client, self.sampling, self.curriculum = client, sampling, curriculum
        self.prompts_per_rank, self.max_policy_lag, self.seed = (
            prompts_per_rank,
            max_policy_lag,
            seed,
        )
        self.producer: RolloutProducer | None = None  # started when the RL stage starts
        self.submitted = 0  # highest batch index whose prompts were chosen
        self.last_step = 0  # the RL stage's last step: no prompts are chosen past it
        self.pending: list[RolloutRequest] = []  # restored RL work, handed to the producer
        self.sampled: list[RolloutBatch] = []

    def restore(self, pending: Sequence[RolloutRequest], sampled: Sequence[RolloutBatch]) -> None:
        """The requests and batches a checkpoint held: sampled again, or trained on as they are."""
        self.pending, self.sampled = list(pending), list(sampled)

    def start(self, last_step: int, steps_done: int, episodes: Any = None) -> RolloutProducer:
        """Start the rollout producer, with the requests and batches a checkpoint held.

        ``episodes``: the run's ``posttrain.envs.training.EpisodeSampler`` for environment
        domains (None: none).
        """
        self.last_step = last_step
        self.producer = RolloutProducer(
            self.client,
            self.sampling,
            self.max_policy_lag,
            steps_done=steps_done,
            sample=episodes,
        )
        for batch in self.sampled:
            self.producer.preload(batch)
        for request in self.pending:
            self.producer.submit(request)
        self.submitted = max(
            [
                steps_done,
                *[r.batch_index for r in self.pending],
                *[b.request.batch_index for b in self.sampled],
            ]
        )
        self.pending, self.sampled = [], []
        return self.producer

    def submit_ahead(self, step: int, encode_prompt: Callable[[str], list[int]]) -> None:
        """Choose prompts for every batch up to ``max_policy_lag`` steps after ``step``."""
        assert self.producer is not None, "submit_ahead outside the RL stage"
        while self.submitted < min(step + self.max_policy_lag, self.last_step):
            self.submitted += 1
            tasks = self.curriculum.next_prompts(self.prompts_per_rank)
            self.producer.submit(
                RolloutRequest(
                    self.submitted,
                    tasks,
                    [encode_prompt(t.prompt) for t in tasks],
                    seed=self.seed * 1_000_003 + self.submitted,
                )
            )

    def buffered(self) -> tuple[list[RolloutRequest], list[RolloutBatch]]:
        """What a checkpoint keeps: requests not yet taken, batches not yet trained on."""
        return self.producer.buffered() if self.producer is not None else ([], [])

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
