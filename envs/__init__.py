"""Environments for agentic RL: multi-turn episodes judged by task completion.

What other components may import: :mod:`.base` (the ``Environment`` interface and its
records), :mod:`.episode` (the multi-turn driver through a rollout server),
:mod:`.terminal` and :mod:`.function_calling` (the environments), :mod:`.bfcl` and
:mod:`.humaneval` (tasks from the real benchmarks shipped on PyPI).
"""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.envs (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.envs":
    raise ImportError(
        f"import posttrain.envs, not {__name__}: the top-level folders are posttrain's components"
    )
