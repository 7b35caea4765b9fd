"""The objectives, as pure functions over tensors: GRPO-family advantages and the clipped
policy-gradient loss, SFT cross-entropy, DPO, and the completion log-prob forward they share.

Imports only :mod:`posttrain.trainer.data` of the trainer: the engine that runs these objectives
(:mod:`posttrain.trainer.model`) imports them, never the reverse.
"""
