"""Checkpoints that resume exactly (weights, optimizer, RNGs, curriculum, buffered rollouts) and
the per-rank reads of their sharded data files."""
