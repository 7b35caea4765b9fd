"""Rewards: verifiers run where ``spec.sandbox`` says, model-based scorers (judge, reward model),
and the score of each sampled answer (verifier score plus the overlong penalty).

Imports only :mod:`posttrain.trainer.data` of the trainer.
"""
