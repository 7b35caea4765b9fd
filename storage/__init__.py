"""Durable run artifacts in MinIO/S3 or a local directory.

* :mod:`.store` - the ArtifactStore interface, S3Store, LocalStore, open_store(uri)
* :mod:`.commit` - directories committed by a manifest written last, verified on download
* :mod:`.checkpoints` - CheckpointManager (resume, retention) and WeightRegistry
* :mod:`.trajectories` - spool-backed TrajectoryWriter, readers and spot-check export
* :mod:`.reports` - eval reports and plots beside the run

Torch-free on purpose: the trainer serialises tensors to files, this package moves files.
"""

# One name per module: imported by its folder name (a checkout's root on sys.path) this package
# would load a second copy of every module beside posttrain.storage (two Prometheus registrations,
# two sets of model classes).
if __name__ != "posttrain.storage":
    raise ImportError(
        f"import posttrain.storage, not {__name__}: the top-level folders are posttrain's components"
    )
