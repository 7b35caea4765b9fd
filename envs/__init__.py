"""Environments for agentic RL: multi-turn episodes judged by task completion.

What other components may import: :mod:`.base` (the ``Environment`` interface and its
records), :mod:`.episode` (the multi-turn driver through a rollout server),
:mod:`.terminal` and :mod:`.function_calling` (the environments), :mod:`.bfcl` and
:mod:`.humaneval` (tasks from the real benchmarks shipped on PyPI).
"""
