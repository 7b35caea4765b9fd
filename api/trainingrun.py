"""TrainingRun: one RL post-training job (spec = the trainer's whole config).

The trainer reads exactly this model, so a manifest that the apiserver accepts
is a config the trainer can run, and a local YAML fails with the same messages.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from .base import (
    CONDITIONS_FIELD,
    DNS_LABEL,
    QUANTITY,
    ApiModel,
    Condition,
    ObjectMeta,
)
from .modelref import HfTokenSecret, check_hf_token_secret, check_model_ref
from .verifier import ModelEndpoint, VerifierSpec

RunPhase = Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"]
MANAGED_BY_POSTTRAIN = "posttrain.io/trainingrun-controller"
"""spec.managedBy of runs the posttrain operator reconciles (also what unset means)."""
NCCL_ENV_NAME = re.compile(r"NCCL_[A-Z0-9_]+")
"""What resources.nccl (and the operator's trainer_nccl) may set."""
COLOCATED_NODES_MESSAGE = (
    "rollout.colocated runs the replicas inside the one trainer pod, so it needs "
    "resources.nodes: 1; a multi-node trainer (a gang or a KubeRay RayCluster) samples from "
    "the pool's own replicas: drop rollout.colocated"
)
"""Why a multi-node run cannot have colocated replicas (the CEL rule and _check share it)."""


class AlgorithmSpec(ApiModel):
    """GRPO-family objective and its hyper-parameters."""

    name: Literal["grpo", "dapo", "dr_grpo", "gspo", "rloo", "reinforce_pp"] = "grpo"
    """grpo: group-relative advantages with std normalisation (arXiv:2402.03300); dapo:
    asymmetric clip, dynamic sampling, token-level loss (arXiv:2503.14476); dr_grpo: no std
    normalisation, constant loss normaliser (arXiv:2503.20783); gspo: GRPO's advantages with
    one importance ratio per completion, exp(mean token log-ratio), clipped per sequence
    (arXiv:2507.18071; use clipLow/clipHigh near 3e-4/4e-4 and lossAggregation
    sequence_mean, as the paper); rloo: leave-one-out baseline r_i - mean of the other
    completions of the group (arXiv:2402.14740); reinforce_pp: REINFORCE++ with a group-mean
    baseline, advantages normalised over the whole batch (arXiv:2501.03262). Which one when:
    docs/trainer.md, "Which algorithm when"."""
    group_size: int = Field(default=8, ge=2, le=512)
    """Completions sampled per prompt; advantages are relative within a group, so >= 2."""
    prompts_per_step: int = Field(default=8, ge=1, le=65536)
    """Prompts per optimizer step (batch = prompts_per_step x group_size completions)."""
    max_steps: int = Field(default=20, ge=1)
    """Optimizer steps before the run succeeds."""
    learning_rate: float = Field(default=1e-6, gt=0, le=1.0)
    """AdamW learning rate. 1e-6 is the usual full-parameter RL rate for 1B+ models; tiny models
    tolerate 1e-5..5e-5."""
    clip_low: float = Field(default=0.2, ge=0, le=1.0)
    """Lower PPO clip: ratio >= 1 - clip_low."""
    clip_high: float = Field(default=0.28, ge=0, le=10.0)
    """Upper PPO clip: ratio <= 1 + clip_high. DAPO's clip-higher (0.28) keeps exploration alive."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the frozen reference model (0 disables it and saves memory)."""
    loss_aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"
    """token_mean: every token weighs the same (DAPO); sequence_mean: every completion does."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal: they carry zero advantage, so no gradient."""
    max_new_tokens: int = Field(default=128, ge=1, le=131072)
    """Generation budget per completion, in tokens."""
    temperature: float = Field(default=1.0, gt=0, le=10.0)
    """Sampling temperature for rollouts; 1.0 keeps behaviour logprobs faithful."""
    top_p: float = Field(default=1.0, gt=0, le=1.0)
    """Nucleus sampling for rollouts."""
    overlong_buffer_tokens: int = Field(default=0, ge=0)
    """Soft overlong penalty (DAPO): within this many tokens of max_new_tokens the reward is
    reduced linearly, down to -overlong_penalty at the limit. 0 disables it."""
    overlong_penalty: float = Field(default=1.0, ge=0)
    """Maximum reward reduction for an overlong completion."""
    max_policy_lag: int = Field(default=0, ge=0, le=64)
    """Bounded staleness k: rollouts may come from weights up to k versions old (k=0 is
    on-policy); older batches are dropped, newer ones importance-corrected."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    micro_batch_size: int = Field(default=8, ge=1)
    """Completions per forward/backward pass (gradient accumulation fills the step)."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    seed: int = Field(default=0, ge=0)
    """Seeds data order, sampling and initialisation, so a run is reproducible."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or cosine decay from learningRate to
    learningRate x minLrRatio at maxSteps (with stages: at each stage's last step, the
    default of every stage's own lrSchedule)."""
    lr_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps over which the learning rate rises linearly from learningRate /
    lrWarmupSteps to learningRate (0: no warm-up)."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of learningRate."""


StageType = Literal["sft", "dpo", "rl"]

# Defaults of the stage hyper-parameters left unset, per stage type. SFT and DPO take TRL's
# defaults (SFTConfig / DPOConfig), so a pipeline ported from TRL behaves as there.
STAGE_DEFAULTS: dict[str, dict[str, float | int]] = {
    "sft": {"learning_rate": 2e-5, "batch_size": 8, "micro_batch_size": 4, "max_length": 1024},
    "dpo": {
        "learning_rate": 1e-6,
        "batch_size": 8,
        "micro_batch_size": 4,
        "max_length": 1024,
        "beta": 0.1,
    },
}


class StageSpec(ApiModel):
    """One stage of a post-training pipeline; it starts from the previous stage's weights."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.type == 'rl' || (has(self.datasets) && size(self.datasets) > 0)",
                    "message": "datasets is required for sft and dpo stages",
                    "fieldPath": ".datasets",
                },
                {
                    "rule": "self.type != 'rl' || !has(self.datasets)",
                    "message": "datasets must be empty for an rl stage: it trains on spec.domains",
                    "fieldPath": ".datasets",
                },
                {
                    "rule": "self.type != 'rl' || (!has(self.batchSize) && "
                    "!has(self.microBatchSize) && !has(self.maxLength))",
                    "message": "batchSize, microBatchSize and maxLength are for sft and dpo "
                    "stages; an rl stage takes them from spec.algorithm",
                    "fieldPath": ".type",
                },
                {
                    "rule": "self.type == 'dpo' || !has(self.beta)",
                    "message": "beta applies to dpo stages only",
                    "fieldPath": ".beta",
                },
                {
                    "rule": "self.type == 'sft' || !has(self.packing)",
                    "message": "packing applies to sft stages only",
                    "fieldPath": ".packing",
                },
                {
                    "rule": "self.type == 'rl' || has(self.maxSteps)",
                    "message": "maxSteps is required for sft and dpo stages",
                    "fieldPath": ".maxSteps",
                },
            ]
        }
    )

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    """Unique within the run; shown in status.stage, metrics and events."""
    type: StageType
    """sft: next-token loss on completions; dpo: direct preference optimisation (sigmoid loss)
    against the stage-start model; rl: the GRPO-family loop on spec.domains."""
    datasets: list[str] | None = Field(default=None, max_length=64)
    """sft and dpo only: JSONL files (sft lines {"prompt", "completion"}, dpo lines
    {"prompt", "chosen", "rejected"}; "messages", a chat, may replace "prompt") or
    builtin:arithmetic / builtin:code (worked answers to the built-in training items; dpo pairs
    a correct with a wrong answer) or, sft only, builtin:bfcl_<category> (BFCL training items
    answered with a call BFCL accepts, from possible_answer). Concatenated."""
    max_steps: int | None = Field(default=None, ge=1)
    """Optimizer steps of this stage (required for sft and dpo; rl: algorithm.maxSteps)."""
    learning_rate: float | None = Field(default=None, gt=0, le=1.0)
    """AdamW learning rate of this stage (a fresh optimizer per stage). Default: sft 2e-5,
    dpo 1e-6 (TRL's defaults), rl algorithm.learningRate."""
    batch_size: int | None = Field(default=None, ge=1, le=65536)
    """sft: examples per optimizer step, dpo: pairs per step (default 8). Data is reshuffled
    every pass."""
    micro_batch_size: int | None = Field(default=None, ge=1, le=65536)
    """Examples (sft) or pairs (dpo) per forward/backward; memory only, never changes the
    update (default 4)."""
    max_length: int | None = Field(default=None, ge=8, le=1048576)
    """Context length in tokens (prompt + completion; default 1024). A prompt that leaves no
    room for a completion token is skipped and counted; longer completions are truncated."""
    beta: float | None = Field(default=None, gt=0, le=100)
    """dpo only: the DPO temperature (default 0.1); larger keeps the policy closer to the
    stage-start reference."""
    packing: bool | None = None
    """sft only: pack several examples into one row of up to maxLength tokens (default true).
    Packed examples never attend to each other (block-diagonal attention, positions restart
    per example), so the loss equals the unpacked one; only padding work is saved."""
    weight_decay: float | None = Field(default=None, ge=0)
    """AdamW weight decay of this stage (default algorithm.weightDecay)."""
    lr_schedule: Literal["constant", "cosine"] | None = None
    """This stage's learning rate after warm-up: constant, or cosine decay to learningRate x
    minLrRatio at the stage's last step (default algorithm.lrSchedule). Every stage runs
    its own curve over its own steps."""
    lr_warmup_steps: int | None = Field(default=None, ge=0)
    """Steps at the start of this stage over which its learning rate rises linearly
    (default algorithm.lrWarmupSteps)."""
    min_lr_ratio: float | None = Field(default=None, ge=0, le=1)
    """Final cosine learning rate of this stage, as a fraction of its learningRate (default
    algorithm.minLrRatio)."""

    def resolved(self, algorithm: AlgorithmSpec) -> StageSpec:
        """This stage with every unset hyper-parameter filled in from its type's defaults.

        >>> StageSpec(name="s", type="sft", datasets=["x"], max_steps=3).resolved(
        ...     AlgorithmSpec()).learning_rate
        2e-05
        >>> StageSpec(name="r", type="rl").resolved(AlgorithmSpec(max_steps=7)).max_steps
        7
        """
        values = self.model_dump()
        if self.type == "rl":
            values["max_steps"] = self.max_steps or algorithm.max_steps
            values["learning_rate"] = self.learning_rate or algorithm.learning_rate
        else:
            for key, default in STAGE_DEFAULTS[self.type].items():
                if values.get(key) is None:
                    values[key] = default
            if self.type == "sft" and self.packing is None:
                values["packing"] = True
        for key in ("weight_decay", "lr_schedule", "lr_warmup_steps", "min_lr_ratio"):
            if values.get(key) is None:
                values[key] = getattr(algorithm, key)
        return StageSpec.model_validate(values)


class EnvironmentSpec(ApiModel):
    """Play the domain's tasks as multi-turn episodes in an environment instead of scoring one
    completion: the episode's task-completion reward replaces the verifier's."""

    kind: Literal["function_calling", "terminal", "bfcl_multi_turn"]
    """function_calling: BFCL tasks, calls judged by BFCL's AST checker (a reply that does not
    parse gets the parse error back while turns remain); terminal: shell commands in a
    sandboxed workspace, judged by the task's "verify" checks at the end; bfcl_multi_turn:
    BFCL multi-turn items (builtin:bfcl_multi_turn_base) played against BFCL's executable
    API backends, each user turn judged by BFCL's state and response checks. The domain's
    verifier is not run for an environment domain: the environment's verdict is the reward."""
    max_turns: int = Field(default=1, ge=1, le=64)
    """Model turns per episode; reaching it ends the episode as truncated (the final state is
    still judged). 1 makes function_calling exactly BFCL's single-turn evaluation."""
    command_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    """terminal: wall clock of one command; a command that hangs is killed and the episode
    goes on with the timeout as the observation."""
    max_context_tokens: int = Field(default=4096, ge=64)
    """Prompt plus all turns; an episode that fills it is truncated."""
    format_reward: float = Field(default=0.0, ge=0.0, lt=1.0)
    """function_calling: training reward for a reply whose calls decode and name offered
    functions but that BFCL rejects (scaled by the fraction of such calls), so a policy that
    never yet writes an accepted call still learns the call format. Accuracy (pass/fail) is
    always BFCL's verdict. 0 = reward is BFCL's verdict alone."""


class DomainSpec(ApiModel):
    """One task family with its own data, verifier and weight."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.verifier) || has(self.environment)",
                    "message": "verifier is required unless environment is set (an "
                    "environment domain is judged by its environment)",
                    "fieldPath": ".verifier",
                },
            ]
        }
    )

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    """Unique within the run; used in metrics, status and storage paths."""
    dataset: str = Field(min_length=1)
    """Training tasks: builtin:<name>, or a JSONL, Parquet (.parquet) or Arrow (.arrow,
    .feather) task file as a path or s3://bucket/key (MinIO: the trainer's S3 settings)."""
    eval_dataset: str | None = None
    """Held-out tasks (never trained on). Builtin datasets have their own held-out split."""
    verifier: VerifierSpec | None = None
    """How completions in this domain are scored. Required unless ``environment`` is set: an
    environment domain's reward is its environment's verdict, and a verifier given beside it
    is not run."""
    weight: float = Field(default=1.0, ge=0)
    """Relative share of each batch's prompts (applied once, at sampling; the loss weighs every
    sequence the same); 0 keeps the domain for eval only."""
    strata: list[str] = Field(default_factory=list, max_length=16)
    """Difficulty strata, easy to hard, matching the tasks' "difficulty" field; empty = one."""
    environment: EnvironmentSpec | None = None
    """Multi-turn episodes in an environment (agentic RL); unset = one completion per sample."""

    @model_validator(mode="after")
    def _check_scoring(self) -> DomainSpec:
        if self.verifier is None and self.environment is None:
            raise ValueError(
                f"domain {self.name!r}: verifier is required unless environment is set "
                "(an environment domain is judged by its environment)"
            )
        return self


class CurriculumSpec(ApiModel):
    """What to practise next."""

    enabled: bool = True
    """Off: sample domains by weight and strata uniformly."""
    promote_at: float = Field(default=0.7, gt=0, le=1)
    """Rolling pass rate at which a domain moves to its next harder stratum."""
    window: int = Field(default=32, ge=1)
    """Completions in the rolling pass-rate window."""
    replay_fraction: float = Field(default=0.1, ge=0, lt=1)
    """Share of each batch replayed from earlier solved tasks, against forgetting."""
    min_domain_fraction: float = Field(default=0.0, ge=0, le=1)
    """Quota: every domain with weight > 0 gets at least this share of each batch."""


class ColocatedRollout(ApiModel):
    """Rollout replicas inside the trainer pod: the pool's server as native sidecar
    containers (Kubernetes >= 1.29) that share the trainer's memory-backed ``/dev/shm``, so
    each weight version reaches them as one file in shared memory instead of through the
    weight registry (docs/rollout.md, "Colocated replicas")."""

    replicas: int = Field(default=1, ge=1, le=8)
    """Servers beside the trainer; replica i listens on ``port + i`` of the RolloutPool named
    in ``rollout.pool`` (its template). The pod requests the trainer's resources plus this
    many times the pool's per-replica ones, all on one node."""
    shm_size_limit: str | None = Field(default=None, pattern=QUANTITY)
    """sizeLimit of the pod's ``/dev/shm`` (a Memory emptyDir, counted against the memory
    limit of the container that writes it: the trainer for the published weights). It holds
    one published version while the replicas load it (the model in the pool's serving
    dtype, e.g. 0.27 GB for SmolLM2-135M in bf16), vLLM's ring buffers (about 160 MiB per
    vLLM replica) and what Gloo/NCCL keep there. Unset: the operator's ``shm_size`` (8Gi)."""


class RolloutSource(ApiModel):
    """Where the trainer samples completions from (OpenAI-compatible servers)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.colocated) || has(self.pool)",
                    "message": "rollout.colocated takes its replicas' template from a "
                    "RolloutPool: set rollout.pool (a pool with replicas: 0 is only a template)",
                    "fieldPath": ".colocated",
                },
                {
                    "rule": "!has(self.colocated) || !has(self.endpoints) || "
                    "size(self.endpoints) == 0",
                    "message": "rollout.colocated and rollout.endpoints exclude each other: "
                    "the colocated replicas are the endpoints; drop one of them",
                    "fieldPath": ".endpoints",
                },
            ]
        }
    )

    pool: str | None = Field(default=None, pattern=DNS_LABEL)
    """A RolloutPool in the same namespace; its Service is used (with ``colocated``: the
    template of the replicas in the trainer pod)."""
    endpoints: list[str] = Field(default_factory=list)
    """Explicit base URLs (http://host:port). Local runs start their own CPU server if empty."""
    timeout_seconds: float = Field(default=120, gt=0)
    """Per-request timeout."""
    max_in_flight: int = Field(default=4, ge=1)
    """Concurrent requests per endpoint (back-pressure)."""
    colocated: ColocatedRollout | None = None
    """Run ``replicas`` servers of ``pool``'s template inside the trainer pod (one node, a
    shared ``/dev/shm``) instead of sampling from the pool's own replicas: weight versions
    then go through shared memory, not object storage. Single-node trainers only
    (``resources.nodes: 1``). The pool's Deployment keeps its own ``spec.replicas``; set it
    to 0 to use the pool only as this template. ``posttrain run --local`` ignores it (a
    local run always starts its own server on the same host)."""

    @model_validator(mode="after")
    def _check(self) -> RolloutSource:
        if self.colocated is not None and not self.pool:
            raise ValueError(
                "rollout.colocated takes its replicas' template from a RolloutPool: set "
                "rollout.pool (a pool with replicas: 0 is only a template)"
            )
        if self.colocated is not None and self.endpoints:
            raise ValueError(
                "rollout.colocated and rollout.endpoints exclude each other: the colocated "
                "replicas are the endpoints; drop one of them"
            )
        return self


class SandboxPolicy(ApiModel):
    """How untrusted completions (code, shell) are executed for verification.

    An execution the sandbox could not perform (runner unreachable or saturated, SandboxTask
    pod not scheduled, bubblewrap refused) is never scored: it is retried, counted in
    ``posttrain_verifier_infra_failures_total`` and in ``status.sandbox``, and shown as the
    run's ``SandboxAvailable`` condition; after ``unavailableTimeoutSeconds`` the run fails.
    """

    mode: Literal["local", "runner", "task"] = "local"
    """local: the bubblewrap executor inside the trainer process (laptops; in a cluster the
    operator gives the trainer pod what bubblewrap needs); runner: a sandbox runner server
    (``runnerUrl``, or one the operator runs for this run); task: one SandboxTask object per
    execution, created and awaited by the trainer (slow, fully isolated pods)."""
    runner_url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$")
    """Base URL of a sandbox runner (``posttrain sandbox serve``) when mode=runner. Unset: the
    operator runs one for this run (Deployment and Service ``<run>-sandbox-runner``, restricted
    pods, ``maxConcurrency`` slots) and hands its URL to the trainer."""
    timeout_seconds: float = Field(default=60, gt=0, le=3600)
    """The most wall-clock time one execution may take, in every mode (a verifier's own
    smaller ``timeout_s`` applies first; 60 leaves the built-in verifiers' defaults, at most
    60 s, as they are). In task mode the SandboxTask pod gets the execution's time; starting
    the pod does not count."""
    memory_mb: int = Field(default=512, ge=16)
    """The most memory one execution may use (a verifier's own smaller ``memory_mb`` applies
    first): RLIMIT_AS in local and runner mode, the SandboxTask pod's memory limit in task
    mode."""
    max_concurrency: int = Field(default=2, ge=1)
    """Executions the trainer has in flight at once (and the slots of the operator's runner)."""
    task_cpu: str = Field(default="1", pattern=QUANTITY)
    """CPU of each SandboxTask pod in task mode (request = limit, Guaranteed QoS); unused in
    the other modes. ``maxConcurrency`` pods run at once, so ``maxConcurrency x taskCpu``
    must fit beside the trainer: on a 2-CPU node with a 1-CPU trainer and a CPU pool, one
    core per execution never schedules."""
    runtime_class_name: str | None = None
    """RuntimeClass (gvisor, kata) of the SandboxTask pods (task) and of the operator's runner
    pods (runner without runnerUrl); unset: the operator's default for sandbox pods."""
    unavailable_timeout_seconds: int = Field(default=600, ge=1, le=86400)
    """How long a step waits, retrying, for a sandbox that keeps failing before the trainer
    fails the run (loudly, naming the sandbox); a wrong answer is never assumed instead."""


class TrainerResources(ApiModel):
    """The trainer workload's shape."""

    nodes: int = Field(default=1, ge=1, le=1024)
    """Trainer nodes (pods, restarted together as a gang). > 1: every pod runs torchrun's agent
    for its ranks (a RayCluster instead when KubeRay is installed)."""
    gpus_per_node: int = Field(default=0, ge=0, le=16)
    """nvidia.com/gpu per trainer pod; the trainer runs one rank per GPU on it (CUDA, NCCL,
    FSDP2) and fails at start when it sees no GPU. 0: CPU ranks (engine.cpuRanks)."""
    cpu: str = Field(default="2", pattern=QUANTITY)
    """CPU request per trainer pod."""
    memory: str = Field(default="8Gi", pattern=QUANTITY)
    """Memory request and limit per trainer pod."""
    image: str | None = None
    """Trainer image; defaults to the operator's configured image."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Extra node selector for trainer pods (e.g. a GPU node pool)."""
    nccl: dict[str, str] = Field(default_factory=dict)
    """NCCL environment of every gang pod, e.g. {"NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}; set over the operator's (the chart's
    trainer.nccl). Only NCCL_* names: anything else is not NCCL's to configure."""

    @field_validator("nccl")
    @classmethod
    def _nccl_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = sorted(k for k in value if not NCCL_ENV_NAME.fullmatch(k))
        if bad:
            raise ValueError(
                f"resources.nccl accepts only NCCL_* variable names (NCCL_ and upper-case "
                f"letters, digits, _), got {bad}"
            )
        return value


# Llama-style attention and MLP projections: what LoRA adapts unless the spec names others.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(ApiModel):
    """Low-rank adapters (PEFT LoRA): only the adapters train; servers get merged weights."""

    rank: int = Field(default=16, ge=1, le=1024)
    """Adapter rank r. Trainable parameters per adapted projection: r x (in + out)."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the update is (alpha / rank) x B A."""
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        max_length=64,
    )
    """Names of the Linear layers that get adapters (Llama/Qwen/Mistral naming by default:
    every attention and MLP projection)."""


class EngineSpec(ApiModel):
    """How the trainer computes: precision, sharding, memory savers, local ranks."""

    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 compute with fp32 master weights and fp32 gradient reduction on GPUs, fp32 on
    the CPU (bf16 matmuls are slow on most CPUs). bf16 / fp32 force one."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward: activation memory of about one
    block instead of all, for ~30% more compute. Disables the shared-prompt KV-cache forward
    (each sample then runs prompt + completion)."""
    logprob_chunk_tokens: int = Field(default=1024, ge=1)
    """Completion tokens whose logits (tokens x vocabulary, fp32) exist at once in the loss;
    bounds that memory independently of the batch."""
    cpu_ranks: int = Field(default=1, ge=1, le=64)
    """Trainer processes per node when gpusPerNode is 0 (FSDP2 over Gloo); with GPUs there is
    one process per GPU. World size = nodes x (gpusPerNode or cpuRanks)."""
    lora: LoraSpec | None = None
    """Train low-rank adapters instead of all weights (null: full-parameter training)."""


class ResumeFrom(ApiModel):
    """The checkpoint a *new* TrainingRun starts from (set exactly one field).

    A run's checkpoints belong to the object that wrote them (its metadata.uid): a run
    deleted and created again under the same name starts from the base model unless this
    says otherwise. A restart of the same object (a killed pod, a gang restart, resuming a
    suspended run) always continues from its own newest checkpoint first; this field is read
    only when the object has none yet. Resuming continues that run as it was (its step,
    optimizer state, curriculum), so raise ``maxSteps`` to train further.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.run) != has(self.checkpoint)",
                    "message": "resumeFrom: set exactly one of run or checkpoint",
                }
            ]
        }
    )

    run: str | None = Field(
        default=None, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=63
    )
    """A TrainingRun of this namespace, by name: the newest checkpoint any earlier object of
    that name wrote under the operator's default storage (``s3://<bucket>/runs/<ns>/<run>/``);
    a run with its own ``checkpoint.storageUri`` is named by ``checkpoint`` instead. In a
    cluster only (``posttrain run --local`` has no run names: use ``checkpoint``)."""
    checkpoint: str | None = Field(default=None, min_length=1)
    """A run's storage (``s3://.../runs/<ns>/<name>/<uid>``, or a local run's ``--out``
    directory: its newest checkpoint) or one checkpoint (``.../checkpoints/step-00000012``)."""

    @model_validator(mode="after")
    def _check(self) -> ResumeFrom:
        if (self.run is None) == (self.checkpoint is None):
            raise ValueError("resumeFrom: set exactly one of run or checkpoint")
        if self.checkpoint is not None and "://" in self.checkpoint:
            scheme = self.checkpoint.split("://", 1)[0]
            if scheme not in ("s3", "file"):
                raise ValueError(
                    f"resumeFrom.checkpoint: {self.checkpoint!r} is not s3://BUCKET/PATH, "
                    "file://PATH or a local path"
                )
        return self


class CheckpointPolicy(ApiModel):
    """When checkpoints are written and how many are kept."""

    every_steps: int = Field(default=5, ge=1)
    """Save after every N optimizer steps (and always at the end)."""
    keep_last: int = Field(default=3, ge=1)
    """Most recent checkpoints kept; older ones are deleted."""
    keep_best: bool = True
    """Also keep the checkpoint with the best held-out score."""
    storage_uri: str | None = None
    """s3://bucket/prefix for this run's artifacts; default s3://<operator
    bucket>/runs/<ns>/<name>/<uid>: each TrainingRun object (metadata.uid) its own, so a run
    created again under the same name starts fresh (see ``resumeFrom``). A prefix given here
    is used as is; a new object that finds another object's checkpoints in it fails with a
    message, unless ``resumeFrom`` asks to continue them."""
    delete_on_run_deletion: bool = False
    """Delete checkpoints and trajectories when the TrainingRun is deleted (off: never lost)."""


class EvaluatorResources(ApiModel):
    """CPU and memory of the separate evaluator (``inline: false``); unset = the trainer's."""

    cpu: str | None = Field(default=None, pattern=QUANTITY)
    """CPU request and limit of the evaluator pod."""
    memory: str | None = Field(default=None, pattern=QUANTITY)
    """Memory request and limit (it holds the model for its own CPU rollout server and one
    checkpoint at a time)."""


class EvaluationSpec(ApiModel):
    """The evaluation matrix: per-domain held-out sets plus a base-model regression set."""

    every_steps: int = Field(default=5, ge=1)
    """Evaluate every N steps (and at step 0 and the end) when inline; the separate evaluator
    scores every committed checkpoint instead."""
    max_items_per_domain: int = Field(default=64, ge=1)
    """Held-out items scored per domain and interval."""
    regression_dataset: str | None = None
    """General tasks scored from step 0 on, so capability drift outside the domains shows."""
    temperature: float = Field(default=0.0, ge=0)
    """0 = greedy decoding for evaluation."""
    inline: bool = True
    """true: rank 0 evaluates between steps (every rank waits for it). false: the trainer
    never evaluates; a separate evaluator (`posttrain eval-checkpoints --watch`, which the
    operator runs as the Job `<run>-evaluator`) scores each committed checkpoint while training
    goes on, and keepBest has no scores to keep by."""
    resources: EvaluatorResources = Field(default_factory=EvaluatorResources)
    """The evaluator's CPU and memory (``inline: false``). It runs until the final checkpoint
    is scored, so on a full cluster its requests can hold the room a restarted trainer gang
    needs: size it below the trainer's where capacity is tight."""


class AuditSpec(ApiModel):
    """Reward-hacking audits."""

    enabled: bool = True
    """Run the per-domain monitors (reward up while held-out flat, verifier-gaming signals)."""
    spot_check_samples: int = Field(default=20, ge=0)
    """Trajectories sampled into the human spot-check export at each eval."""


class TrainingRunSpec(ApiModel):
    """Desired state of a TrainingRun."""

    # The apiserver enforces the same cross-field checks as _check below (CEL), so kubectl
    # apply and a local run reject a bad spec with the same meaning.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.domains.exists(d, d.weight > 0)",
                    "message": "domains: at least one domain needs weight > 0",
                    "fieldPath": ".domains",
                },
                {
                    "rule": "!has(self.stages) || self.stages.filter(s, s.type == 'rl').size() <= 1",
                    "message": "stages: at most one rl stage",
                    "fieldPath": ".stages",
                },
                {
                    "rule": "!has(self.stages) || self.stages.size() == 0 || "
                    "!self.stages.exists(s, s.type == 'rl') || "
                    "self.stages[self.stages.size() - 1].type == 'rl'",
                    "message": "stages: the rl stage must be the last one",
                    "fieldPath": ".stages",
                },
                {
                    "rule": "!has(self.rollout) || !has(self.rollout.colocated) || "
                    "!has(self.resources) || !has(self.resources.nodes) || "
                    "self.resources.nodes == 1",
                    "message": COLOCATED_NODES_MESSAGE,
                    "fieldPath": ".rollout.colocated",
                },
                {
                    "rule": "has(self.managedBy) == has(oldSelf.managedBy) && "
                    "(!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
                    "message": "managedBy is immutable",
                    "fieldPath": ".managedBy",
                },
            ]
        }
    )

    model: str = Field(
        min_length=1,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self == oldSelf",
                    "message": "model is immutable; create a new TrainingRun to train another model",
                }
            ]
        },
    )
    """Base model: a packaged id (smollm2-135m-instruct), s3://bucket/path, pvc://claim/path (the
    operator mounts the claim read-only in the run's pods), hf://ORG/NAME[@REVISION] (a Hugging
    Face Hub repository, downloaded by the run's pods) or a local path. Immutable."""
    hf_token_secret: HfTokenSecret | None = None
    """The Secret holding a Hugging Face token, for a private or gated hf:// model: its pods get
    it as HF_TOKEN. Only with an hf:// model."""
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    """Objective and hyper-parameters."""
    domains: list[DomainSpec] = Field(
        min_length=1,
        max_length=1000,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Task domains (hundreds allowed); names are unique."""
    stages: list[StageSpec] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [
                {
                    "rule": "self == oldSelf",
                    "message": "stages is immutable; a resumed run must find the stages "
                    "its checkpoints were written for",
                }
            ],
        },
    )
    """The pipeline, in order: e.g. sft, then dpo, then rl. Each stage starts from the previous
    stage's final weights (checkpointed at every stage end). Empty: one rl stage, exactly the
    algorithm section (what a run without stages always was). domains are still required:
    they are the held-out evaluation run at step 0 and at the end of every stage."""
    curriculum: CurriculumSpec = Field(default_factory=CurriculumSpec)
    """What to practise next."""
    rollout: RolloutSource = Field(default_factory=RolloutSource)
    """Where completions are sampled."""
    sandbox: SandboxPolicy = Field(default_factory=SandboxPolicy)
    """How untrusted output is executed."""
    resources: TrainerResources = Field(default_factory=TrainerResources)
    """Trainer pods."""
    engine: EngineSpec = Field(default_factory=EngineSpec)
    """Precision, sharding, activation checkpointing, LoRA."""
    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    """Checkpoint cadence and retention."""
    resume_from: ResumeFrom | None = None
    """Start from another run's checkpoint instead of the base model (null: a new object
    starts fresh; its own restarts always resume from its own checkpoints)."""
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    """Evaluation matrix."""
    audit: AuditSpec = Field(default_factory=AuditSpec)
    """Reward-hacking audits."""
    suspend: bool = False
    """True deletes the trainer pods but keeps the run; false resumes from the last checkpoint."""
    managed_by: str | None = Field(
        default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-A-Za-z0-9_.]+$"
    )
    """The controller that reconciles this run, as a domain-prefixed path (Kubeflow Trainer's
    and JobSet's managedBy). Unset or posttrain.io/trainingrun-controller: the posttrain
    operator. Any other value (e.g. kueue.x-k8s.io/multikueue): the posttrain operator creates
    nothing and writes no status for the run, only an Event saying why. Immutable."""
    active_deadline_seconds: int | None = Field(default=None, ge=1)
    """Fail the run after this long since it started."""
    backoff_limit: int = Field(default=3, ge=0, le=100)
    """Trainer restarts (from the last checkpoint) before the run fails."""

    @field_validator("model")
    @classmethod
    def _check_model(cls, model: str) -> str:
        return check_model_ref(model)  # a malformed pvc:// or hf:// reference is a spec error

    @model_validator(mode="after")
    def _check(self) -> TrainingRunSpec:
        check_hf_token_secret(self.model, self.hf_token_secret)
        names = [d.name for d in self.domains]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"domains: names must be unique, repeated: {dupes}")
        if not any(d.weight > 0 for d in self.domains):
            raise ValueError("domains: at least one domain needs weight > 0")
        _check_stages(self.stages)
        if self.rollout.colocated is not None and self.resources.nodes != 1:
            raise ValueError(COLOCATED_NODES_MESSAGE)
        secrets: dict[str, tuple[str, str]] = {}
        for endpoint in self.model_scorers():
            ref = endpoint.api_key_secret
            if ref is None or endpoint.api_key_env is None:
                continue
            seen = secrets.setdefault(endpoint.api_key_env, (ref.name, ref.key))
            if seen != (ref.name, ref.key):
                raise ValueError(
                    f"domains: apiKeyEnv {endpoint.api_key_env!r} is filled from two Secrets "
                    f"({seen[0]}/{seen[1]} and {ref.name}/{ref.key}); give each its own apiKeyEnv"
                )
        return self

    def model_scorers(self) -> list[ModelEndpoint]:
        """The judges and reward models of the domains' verifiers (pools the trainer reads,
        Secrets the operator passes to it)."""
        verifiers = [d.verifier for d in self.domains if d.verifier is not None]
        return [e for v in verifiers if (e := v.endpoint()) is not None]

    def pipeline(self) -> list[StageSpec]:
        """The stages to run, resolved (defaults filled in); one rl stage when none are listed.

        >>> spec = TrainingRunSpec(model="m", domains=[DomainSpec(
        ...     name="a", dataset="builtin:arithmetic", verifier=VerifierSpec(kind="numeric"))])
        >>> [(s.name, s.type, s.max_steps) for s in spec.pipeline()]
        [('rl', 'rl', 20)]
        """
        stages = self.stages or [StageSpec(name="rl", type="rl")]
        return [stage.resolved(self.algorithm) for stage in stages]

    def total_steps(self) -> int:
        """Optimizer steps over every stage (status.maxSteps): steps are numbered globally."""
        return sum(int(stage.max_steps or 0) for stage in self.pipeline())


def _check_stages(stages: list[StageSpec]) -> None:
    """The stage-list rules the apiserver checks with CEL, with the same messages."""
    names = [s.name for s in stages]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"stages: names must be unique, repeated: {dupes}")
    for i, stage in enumerate(stages):
        where = f"stages[{i}]"
        if stage.type != "rl" and not stage.datasets:
            raise ValueError(f"{where}.datasets: datasets is required for sft and dpo stages")
        if stage.type == "rl" and stage.datasets is not None:
            raise ValueError(
                f"{where}.datasets: datasets must be empty for an rl stage: it "
                "trains on spec.domains"
            )
        if stage.type == "rl" and any(
            v is not None for v in (stage.batch_size, stage.micro_batch_size, stage.max_length)
        ):
            raise ValueError(
                f"{where}: batchSize, microBatchSize and maxLength are for sft and "
                "dpo stages; an rl stage takes them from spec.algorithm"
            )
        if stage.type != "dpo" and stage.beta is not None:
            raise ValueError(f"{where}.beta: beta applies to dpo stages only")
        if stage.type != "sft" and stage.packing is not None:
            raise ValueError(f"{where}.packing: packing applies to sft stages only")
        if stage.type != "rl" and stage.max_steps is None:
            raise ValueError(f"{where}.maxSteps: maxSteps is required for sft and dpo stages")
    rl = [i for i, s in enumerate(stages) if s.type == "rl"]
    if len(rl) > 1:
        raise ValueError("stages: at most one rl stage")
    if rl and rl[0] != len(stages) - 1:
        raise ValueError("stages: the rl stage must be the last one")


StagePhase = Literal["Running", "Succeeded"]


class StageStatus(ApiModel):
    """What one stage did, written by the trainer when the stage starts and ends."""

    name: str
    """spec.stages[].name (rl for a run without stages)."""
    type: StageType
    phase: StagePhase
    """Running or Succeeded."""
    first_step: int
    """Global step of the stage's first optimizer step."""
    last_step: int
    """Global step of the stage's last optimizer step (its final checkpoint)."""
    start_time: datetime | None = None
    completion_time: datetime | None = None
    eval_accuracy: dict[str, float] = Field(default_factory=dict)
    """Held-out accuracy per domain after the stage (the report compares consecutive stages)."""
    skipped_examples: dict[str, int] = Field(default_factory=dict)
    """sft/dpo examples skipped as unusable, by reason (identicalPair, emptyCompletion,
    promptTooLong)."""


class SandboxHealth(ApiModel):
    """What the trainer saw of its sandbox: the operator turns it into the SandboxAvailable
    condition (the trainer reports facts, the operator owns conditions)."""

    mode: Literal["local", "runner", "task"]
    """spec.sandbox.mode the trainer uses."""
    endpoint: str | None = None
    """The runner URL (runner mode) or namespace (task mode) executions go to."""
    available: bool = True
    """False while executions keep failing for reasons that are not the program's."""
    infra_failures: int = 0
    """Executions the sandbox failed so far, each retried and never scored."""
    last_error: str | None = None
    """The latest such failure, in words."""
    last_failure_time: datetime | None = None


class RolloutHealth(ApiModel):
    """What the trainer saw of its RolloutPool: the operator turns it into the
    RolloutAvailable condition (the trainer reports facts, the operator owns conditions)."""

    pool: str
    """spec.rollout.pool."""
    available: bool = True
    """False while the pool has no ready replica for the trainer to sample from."""
    ready_replicas: int = 0
    """Replicas the trainer found ready (status.replicaEndpoints of the pool)."""
    message: str | None = None
    """Why not, in words (the pool's Ready condition), and how long the trainer still waits."""


class RolloutWait(ApiModel):
    """How long the trainer waited for rollouts, over its last few RL steps: the demand
    signal a RolloutPool's ``spec.autoscaling`` acts on (written by the trainer)."""

    fraction: float = Field(ge=0, le=1)
    """Seconds blocked waiting for the next batch of rollouts / seconds of those steps."""
    wait_seconds: float = Field(ge=0)
    """Seconds waited over the averaged steps."""
    step_seconds: float = Field(ge=0)
    """Seconds those steps took (sampling wait, scoring, the optimizer step, publishing)."""
    steps: int = Field(ge=1)
    """How many steps are averaged (the most recent ones)."""
    window_start: datetime
    """When the first averaged step started: an autoscaler ignores a signal measured partly
    before its last scale."""


class TrainingRunStatus(ApiModel):
    """Observed state, written by the operator (phase, conditions) and the trainer (progress)."""

    phase: RunPhase | None = None
    """Pending, Running, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = CONDITIONS_FIELD
    """Ready, Suspended, Succeeded, Failed, with fixed reasons."""
    observed_generation: int | None = None
    """The spec generation the operator last acted on."""
    step: int | None = None
    """Last completed optimizer step."""
    max_steps: int | None = None
    """Optimizer steps over all stages (spec.algorithm.maxSteps without stages), copied for
    the printer column."""
    stage: str | None = None
    """Name of the stage being trained (the last one once the run succeeded)."""
    stages: list[StageStatus] = Field(default_factory=list)
    """Every stage started so far, in order."""
    reward_mean: float | None = None
    """Mean reward of the last step's rollouts."""
    domain_rewards: dict[str, float] = Field(default_factory=dict)
    """Mean reward per domain at the last step."""
    eval_accuracy: dict[str, float] = Field(default_factory=dict)
    """Held-out accuracy per domain at the last evaluation."""
    last_checkpoint: str | None = None
    """URI of the newest complete checkpoint."""
    resumed_from: str | None = None
    """The checkpoint the trainer last started from (a URI), or ``fresh start`` (the base
    model); written by the trainer each time it starts."""
    weight_version: int | None = None
    """Weights version last published to the rollout servers."""
    restarts: int = 0
    """Trainer restarts so far (bounded by spec.backoffLimit)."""
    sandbox: SandboxHealth | None = None
    """Health of the sandbox the trainer verifies with (written by the trainer)."""
    rollout: RolloutHealth | None = None
    """Whether the trainer found a ready replica of spec.rollout.pool (written by the
    trainer while it waits for one, and when it found them)."""
    rollout_wait: RolloutWait | None = None
    """Fraction of recent step time the trainer spent waiting for rollouts (written by the
    trainer after each RL step); RolloutPools with spec.autoscaling scale on it."""
    reports_uri: str | None = None
    """Where the trainer uploads metrics, eval results, audit alerts, spot checks, plots and
    the report as it writes them; ``posttrain report <reportsUri>`` renders them."""
    ray_cluster: str | None = None
    """The KubeRay RayCluster of the current gang (multi-node runs when KubeRay is installed)."""
    ray_cluster_state: str | None = None
    """That RayCluster's status.state as KubeRay reports it (ready, failed, suspended)."""
    available_workers: int | None = None
    """Ray worker pods available in that RayCluster (of spec.resources.nodes - 1)."""
    start_time: datetime | None = None
    completion_time: datetime | None = None
    message: str | None = None
    """One line on the current state, for kubectl get -o wide."""


class TrainingRun(ApiModel):
    """An RL post-training run."""

    api_version: Literal["posttrain.io/v1alpha1"] = "posttrain.io/v1alpha1"
    kind: Literal["TrainingRun"] = "TrainingRun"
    metadata: ObjectMeta
    spec: TrainingRunSpec
    status: TrainingRunStatus = Field(default_factory=TrainingRunStatus)
