"""Running a run: the loop over its stages (SFT -> DPO -> RL) and the RL step's batch, Ctrl-C
handling, rollout endpoints and the local rollout server, the multi-rank launcher, and the
``posttrain run``/``eval``/``eval-checkpoints`` entry points. The top layer: it assembles the
other packages and none of them imports it."""
