"""LoRA through PEFT: a step trains only the adapters; the published weights are merged."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from posttrain.trainer.loss import LossConfig, sequence_coefficients
from posttrain.trainer.policy import EngineOptions, LoraOptions, Policy, TrainSample

pytest.importorskip("peft", reason="LoRA needs peft (in the train extra)")


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Policy, dict[str, torch.Tensor]]:
    """A LoRA policy after one applied step, and its state before the step."""
    from posttrain.models import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=2)
    policy = Policy(
        model, learning_rate=1e-2, engine=EngineOptions(lora=LoraOptions(rank=4, alpha=8.0))
    )
    before = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    prompt = policy.encode_prompt("What is 3 + 4?")
    completions = [[28, 29, 30], [31, 32], [33, 34, 35, 36], [37]]
    coefficients = sequence_coefficients([len(c) for c in completions], "token_mean", 8)
    samples = [
        TrainSample(prompt, c, [0.0] * len(c), a, k)
        for c, a, k in zip(completions, [1.0, -1.0, 0.5, -0.5], coefficients, strict=True)
    ]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, samples, 1.0)
    for i, sample in enumerate(samples):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    # Step 1 moves only B (A's gradient is B^T ... = 0 while B is still zero); step 2 moves A.
    for step in (1, 2):
        stats = policy.train_step(
            samples, LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=step
        )
        assert stats.applied
    return policy, before


def test_a_lora_step_changes_only_adapter_weights(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
) -> None:
    policy, before = lora_policy
    after = policy.model.state_dict()
    changed = {name for name, value in after.items() if not torch.equal(value, before[name])}
    adapters = {name for name in after if ".lora_" in name}
    assert adapters and changed == adapters, sorted(changed ^ adapters)[:5]
    trained = [p for g in policy.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in trained) == sum(after[n].numel() for n in adapters)


def test_merged_export_equals_base_plus_adapter(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
) -> None:
    """What servers load equals PEFT's own merge (W + alpha/r * B @ A) under base names."""
    policy, _ = lora_policy
    assert policy.peft is not None
    reference = copy.deepcopy(policy.peft).merge_and_unload().state_dict()
    exported = dict(policy.full_weights())
    assert set(exported) == set(reference) - {"lm_head.weight"}  # tied, as save_pretrained
    merged = [n for n in exported if n.endswith("q_proj.weight")]
    assert merged
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7)
    # and the merge did something: the adapted weights differ from the frozen base
    base = policy.model.state_dict()
    assert not torch.equal(
        exported[merged[0]], base[merged[0].replace(".weight", ".base_layer.weight")]
    )


def test_lora_export_loads_as_a_plain_model(
    lora_policy: tuple[Policy, dict[str, torch.Tensor]],
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    policy, _ = lora_policy
    policy.save_weights(tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    exported = dict(policy.full_weights())
    for name, tensor in exported.items():
        assert torch.equal(loaded[name], tensor), name
