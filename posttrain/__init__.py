"""posttrain: Kubernetes-native LLM post-training with RL from verifiable rewards.

Components live in top-level folders and import as ``posttrain.<component>``
(``posttrain/<component>`` are symlinks): api, operator, trainer, rollout,
sandboxes, storage, envs. ``posttrain`` itself holds the CLI, the dev control plane
and telemetry, which every component may use.
"""

__version__ = "0.1.0"
