"""The RL trainer, in packages by role, lowest first (docs/trainer.md, "Layout"):

``data`` -> ``rewards`` -> ``algorithms`` -> ``model`` -> ``checkpointing`` -> ``evaluation``
-> ``observe`` -> ``run``. A package imports only those before it (tests/test_layers.py).
"""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.trainer (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.trainer":
    raise ImportError(
        f"import posttrain.trainer, not {__name__}: the top-level folders are posttrain's components"
    )
