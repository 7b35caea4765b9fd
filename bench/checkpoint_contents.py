"""What a trainer checkpoint holds, by part: the HF export, the DCP training state (fp32 master
weights, AdamW moments), block indexes, RNG and trainer state. Answers "why is the dev-run's
checkpoint 2.1 GiB for a 135M model" (issue #35) with bytes, not guesses.

One CPU process builds the policy the dev-run trains (SmolLM2-135M-Instruct, the trainer's
defaults), takes one optimizer step (AdamW's moments exist only after one), saves a checkpoint
exactly as the trainer does (``Checkpointer.save`` into a local store) and reports the parts:

    .venv/bin/python bench/checkpoint_contents.py            # ~2 GiB in a temporary directory
    .venv/bin/python bench/checkpoint_contents.py --json

Results and the decision they led to: docs/storage.md, "What a checkpoint holds".
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

GIB = 2**30


def safetensors_dtypes(path: Path) -> dict[str, int]:
    """Bytes per dtype declared in a safetensors header."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    out: dict[str, int] = defaultdict(int)
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            out[entry["dtype"]] += end - start
    return dict(out)


def dcp_parts(dcp_dir: Path) -> dict[str, int]:
    """Bytes of the DCP state by what they are: model weights, each AdamW moment, the rest
    (from the checkpoint's own metadata: each tensor's size and dtype)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(dcp_dir)).read_metadata()
    out: dict[str, int] = defaultdict(int)
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        numel = 1
        for dim in entry.size:
            numel *= dim
        nbytes = numel * entry.properties.dtype.itemsize
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        if key.startswith("model."):
            part = f"weights ({dtype})"
        elif key.endswith(".exp_avg"):
            part = f"AdamW exp_avg ({dtype})"
        elif key.endswith(".exp_avg_sq"):
            part = f"AdamW exp_avg_sq ({dtype})"
        else:
            part = f"other optimizer state ({dtype})"
        out[part] += nbytes
    return dict(out)


def measure(model: str) -> dict[str, Any]:
    import torch

    from posttrain.models import resolve_model
    from posttrain.storage.store import LocalStore
    from posttrain.trainer.algorithms.logprobs import TrainSample
    from posttrain.trainer.algorithms.loss import LossConfig, sequence_coefficients
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer, TrainerState
    from posttrain.trainer.model.policy import Policy

    torch.manual_seed(0)
    policy = Policy(resolve_model(model), learning_rate=1e-6)
    prompt = policy.encode_prompt("What is 2 + 2?")
    completions = [[28, 29, 30], [31, 32]]
    coefficients = sequence_coefficients([len(c) for c in completions], "token_mean", 2)
    samples = [
        TrainSample(prompt, c, [0.0] * len(c), a, k)
        for c, a, k in zip(completions, [1.0, -1.0], coefficients, strict=True)
    ]
    with torch.no_grad():
        logp, _, mask = policy.completion_logprobs(policy.model, samples, temperature=1.0)
    for i, sample in enumerate(samples):
        sample.behaviour_logprobs = logp[i, : int(mask[i].sum())].tolist()
    policy.train_step(
        samples, LossConfig(), micro_batch_size=2, grad_clip=1.0, temperature=1.0, step=1
    )
    parameters = sum(p.numel() for p in policy.module.parameters())
    with tempfile.TemporaryDirectory(prefix="ckpt-contents-") as tmp:
        Checkpointer(LocalStore(tmp), keep_last=1, keep_best=False).save(
            policy, TrainerState(1, 1, {}, {}, [], [], 0)
        )
        (step_dir,) = (Path(tmp) / "checkpoints").glob("step-*")
        files = {
            str(p.relative_to(step_dir)): p.stat().st_size
            for p in sorted(step_dir.rglob("*"))
            if p.is_file()
        }
        hf = {
            name: safetensors_dtypes(step_dir / name)
            for name in files
            if name.endswith(".safetensors") and "/" not in name
        }
        dcp = dcp_parts(step_dir / "dcp")
    total = sum(files.values())
    groups: dict[str, int] = defaultdict(int)
    for name, size in files.items():
        if name.endswith(".safetensors") and "/" not in name:
            groups["HF export (safetensors)"] += size
        elif name.startswith("dcp/") and name.endswith(".distcp"):
            groups["DCP data (weights + optimizer)"] += size
        elif name.endswith(".blocks"):
            groups["block indexes"] += size
        else:
            groups["config, tokenizer, RNG, trainer state, manifest"] += size
    return {
        "model": model,
        "parameters": parameters,
        "total_bytes": total,
        "groups": dict(groups),
        "hf_export_dtypes": hf,
        "dcp_parts": dcp,
        "files": files,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON")
    args = parser.parse_args()
    result = measure(args.model)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['model']}: {result['parameters'] / 1e6:.1f} M parameters")
    print(f"checkpoint: {result['total_bytes'] / GIB:.3f} GiB ({result['total_bytes']:,} bytes)")
    for name, size in sorted(result["groups"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:<50} {size / GIB:7.3f} GiB")
    print("  of which, in the DCP state:")
    for name, size in sorted(result["dcp_parts"].items(), key=lambda kv: -kv[1]):
        print(f"    {name:<48} {size / GIB:7.3f} GiB")
    for name, dtypes in result["hf_export_dtypes"].items():
        print(
            f"  HF export {name}: " + ", ".join(f"{d} {b / GIB:.3f} GiB" for d, b in dtypes.items())
        )


if __name__ == "__main__":
    main()
