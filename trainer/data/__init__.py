"""What the trainer trains and evaluates on: task records and where they come from, the SFT/DPO
stages' data, the curriculum that picks each batch, and the rollout producer that samples it.

The lowest layer of the trainer: it imports no other trainer package (tests/test_layers.py).
"""
