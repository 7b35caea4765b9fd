"""Sandboxed code execution: the bubblewrap executor, runner server and verifiers."""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.sandboxes (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.sandboxes":
    raise ImportError(
        f"import posttrain.sandboxes, not {__name__}: the top-level folders are posttrain's components"
    )
