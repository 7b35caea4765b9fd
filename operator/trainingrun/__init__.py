"""TrainingRun: a gang of trainer pods (or one RayCluster per gang) and its long-lived children.

=====================  ===================================================================
module                 role
=====================  ===================================================================
:mod:`.plan`           pure decision: observed pods/RayCluster/Workload -> ``RunPlan``
:mod:`.builders`       trainer pod, gang, ConfigMap, RBAC, head Service, children
:mod:`.names`          the run's child names, run.yaml path, storage URIs
:mod:`.raycluster`     the RayCluster a gang runs as on KubeRay
:mod:`.sandbox_runner` the per-run sandbox runner (Deployment, Service, NetworkPolicy)
:mod:`.evaluator`      the evaluator Job (``evaluation.inline: false``)
:mod:`.kueue`          the Kueue Workload: build and read
:mod:`.admission`      executes the Kueue part of a plan
:mod:`.kuberay`        KubeRay discovery (its RayCluster informers follow it)
:mod:`.finalizer`      the storage finalizer (``deleteOnRunDeletion``)
:mod:`.reconciler`     reads the cache, asks the plan, applies it
=====================  ===================================================================
"""
