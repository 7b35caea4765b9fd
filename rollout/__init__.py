"""Rollout: the HTTP contract, the CPU engine/server, the client and the vLLM front door."""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.rollout (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.rollout":
    raise ImportError(
        f"import posttrain.rollout, not {__name__}: the top-level folders are posttrain's components"
    )
