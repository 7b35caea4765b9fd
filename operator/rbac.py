"""RBAC as data: the one source of truth for what the operator and the trainer may do.

The Helm chart renders its ClusterRole from ``posttrain operator rbac`` and the builders use
TRAINER_RULES for each run's Role, so permissions are never written twice. No wildcard verbs
or resources: every entry says which resource and why.
"""

from __future__ import annotations

from typing import Any

import yaml

from posttrain.api import GROUP

Rule = dict[str, Any]

READ = ["get", "list", "watch"]

OPERATOR_RULES: list[Rule] = [
    # Our resources: watch all three; patch TrainingRun metadata (the storage finalizer,
    # the gang incarnation); delete finished SandboxTasks after their TTL.
    {"apiGroups": [GROUP], "resources": ["trainingruns"], "verbs": [*READ, "patch"]},
    {"apiGroups": [GROUP], "resources": ["rolloutpools"], "verbs": READ},
    # create: only so it may grant task-mode trainers that right (an RBAC escalation check).
    {"apiGroups": [GROUP], "resources": ["sandboxtasks"], "verbs": [*READ, "create", "delete"]},
    {"apiGroups": [GROUP], "resources": ["sandboxwarmpools"], "verbs": READ},
    # Status is ours to write (phase, conditions, results), through merge patches.
    {
        "apiGroups": [GROUP],
        "resources": [
            "trainingruns/status",
            "rolloutpools/status",
            "sandboxtasks/status",
            "sandboxwarmpools/status",
        ],
        "verbs": ["get", "patch"],
    },
    # spec.autoscaling: the operator sets a pool's replicas through its scale subresource,
    # the same door kubectl scale and an HPA use (never a patch of the whole spec).
    {"apiGroups": [GROUP], "resources": ["rolloutpools/scale"], "verbs": ["get", "patch"]},
    # ownerReferences with blockOwnerDeletion=true require update on the owner's finalizers.
    {
        "apiGroups": [GROUP],
        "resources": [
            "trainingruns/finalizers",
            "rolloutpools/finalizers",
            "sandboxtasks/finalizers",
            "sandboxwarmpools/finalizers",
        ],
        "verbs": ["update"],
    },
    # Trainer gangs and sandboxes are pods the operator creates, watches and deletes; patch
    # is the SandboxWarmPool claim (labels, owner, claim annotation, activeDeadlineSeconds).
    {"apiGroups": [""], "resources": ["pods"], "verbs": [*READ, "create", "patch", "delete"]},
    # Run config, head Service and pool Service, trainer ServiceAccount.
    {
        "apiGroups": [""],
        "resources": ["configmaps", "services", "serviceaccounts"],
        "verbs": ["get", "create", "patch", "delete"],
    },
    # Each RolloutPool's weight token (rollout/auth.py) and each run's and pool's scoped
    # storage keys (storage/iam.py): created once, never read back (no get, list or watch:
    # the operator reads no Secret through the API).
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    # Rollout replicas.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": [*READ, "create", "patch", "delete"],
    },
    # The evaluator of a run with evaluation.inline: false (deleted when the run fails).
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "create", "delete"]},
    # Multi-node runs as KubeRay RayClusters (only used when that CRD is installed; whether it
    # is, is asked through API discovery, which needs no rule).
    {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": [*READ, "create", "delete"]},
    # Admission through Kueue (runs labelled kueue.x-k8s.io/queue-name, when Kueue is
    # installed): one Workload per run; patch sets spec.active on suspend/resume, and the
    # status patch marks it Finished when the run ends so Kueue releases the quota.
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": [*READ, "create", "patch"],
    },
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["workloads/status"], "verbs": ["patch"]},
    # The node labels of the ResourceFlavors a Workload was admitted to go on its pods.
    {"apiGroups": ["kueue.x-k8s.io"], "resources": ["resourceflavors"], "verbs": ["get"]},
    # Each run's narrow trainer Role + RoleBinding (the operator holds TRAINER_RULES itself,
    # so creating them is not an escalation).
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "create", "patch"],
    },
    # The per-namespace default-deny policy for sandboxes; each RolloutPool's ingress policy.
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "create", "patch"],
    },
    # Kubernetes Events on every transition (events.py posts core/v1 events).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
    {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
    # No namespaces or CRD watch: the operator watches explicit namespaces (or is cluster-wide)
    # and nothing scans CRDs (API discovery of KubeRay's and Kueue's needs no RBAC). Leader election is not here: its
    # Lease lives in the operator's own namespace (LEADER_ELECTION_RULES).
]

# Leader election between replicas (leader.py), granted by a Role in the operator's own
# namespace only, where its Lease lives: read it, create it the first time, update it to
# acquire, renew and release (every write a PUT guarded by resourceVersion; no watch).
LEADER_ELECTION_RULES: list[Rule] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    },
]

# Resources the trainer only creates: a create cannot be narrowed by resourceNames (the
# object has no name yet), so builders leave these rules unnamed.
CREATE_ONLY_RESOURCES = ("events",)

TRAINER_RULES: list[Rule] = [
    # The trainer reports step/reward/checkpoint by patching its own run's status; builders
    # add resourceNames: [<run>] so a trainer can touch only its run.
    {"apiGroups": [GROUP], "resources": ["trainingruns/status"], "verbs": ["get", "patch"]},
    # Reading the run itself (spec) is useful for a trainer that re-reads suspend/maxSteps.
    {"apiGroups": [GROUP], "resources": ["trainingruns"], "verbs": ["get"]},
    # Stage started/finished Events on its run (only the trainer sees stage boundaries).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]


def _role(kind: str, name: str, rules: list[Rule]) -> dict[str, Any]:
    """A ClusterRole or Role manifest labelled as the operator's."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "posttrain-operator"}},
        "rules": rules,
    }


def cluster_role(name: str = "posttrain-operator") -> dict[str, Any]:
    """The operator's ClusterRole manifest."""
    return _role("ClusterRole", name, OPERATOR_RULES)


def rbac_yaml(name: str = "posttrain-operator") -> str:
    """``OPERATOR_RULES``, ``TRAINER_RULES`` and ``LEADER_ELECTION_RULES`` as a
    multi-document YAML.

    The first document is the operator ClusterRole; the second a ClusterRole template with
    the trainer's rules (the operator itself creates per-run Roles from the same rules); the
    third the Role to bind in the operator's own namespace for leader election.
    """
    return yaml.safe_dump_all(
        [
            cluster_role(name),
            _role("ClusterRole", f"{name}-trainer-template", TRAINER_RULES),
            _role("Role", f"{name}-leader-election", LEADER_ELECTION_RULES),
        ],
        sort_keys=False,
    )
