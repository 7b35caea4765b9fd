"""Held-out evaluation (in the loop, ``heldout``) and the evaluator that scores committed
checkpoints off the training path (``checkpoint_eval``)."""
