"""One reconciler per kind, over one shared :class:`~.state.OperatorState` (caches + client).

======================  ==========================================
kind                    reconciler
======================  ==========================================
TrainingRun             :mod:`.trainingrun` (+ :mod:`.kuberay`)
RolloutPool             :mod:`.rolloutpool`
SandboxTask             :mod:`.sandboxtask` (+ :mod:`.sandbox_artifacts`)
SandboxWarmPool         :mod:`.warmpool` (+ claims for SandboxTasks)
======================  ==========================================

Each reconciler reads the cache, asks a pure plan in ``reconcile.py`` (or ``warmpool.py``)
what to do, builds the manifests with ``builders.py`` and applies them through the state's
client. ``controllers.py`` wires them together and routes watch events to them. (Nothing is
imported here, so any module can import ``.state`` without loading the reconcilers.)
"""
