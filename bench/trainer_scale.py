"""Trainer at scale on the CPU: FSDP2 memory per rank, step time 1 vs 2 ranks, and a GPU plan.

One run measures, side by side on the same randomly initialised Llama-architecture model
and the same global batch:

* **one process, unsharded** (the plain fp32 module): step time, training-state bytes
  (parameters + gradients + AdamW moments) and peak RSS;
* **two Gloo ranks, FSDP2** (``fully_shard`` per block + root): the same per rank.

Training-state bytes are counted exactly from the tensors each rank holds (local shards);
peak RSS (``VmHWM``, see :func:`peak_rss`) also contains the Python/torch baseline. Loading
is measured both ways on two ranks, each in fresh processes: **per-rank sharded loading** (meta device,
``fully_shard``, each rank reads only its slices: what the trainer does) and **the old way**
(``from_pretrained`` of the full model on every rank, then ``fully_shard``); the peak RSS
right after the policy is built is the loading peak. Every process also samples its
anonymous RSS per phase of the step (forward, backward, clip, AdamW step: where a rank's
memory goes); ``--compare-shared-prompts`` adds the two ranks with the shared-prompt forward
side by side, ``--malloc-mmap-threshold`` measures live tensors instead of glibc's retained
heap. Then a planning table: bytes per parameter
measured here, applied through
:func:`posttrain.trainer.model.training_engine.estimate_training_memory` to Llama-2-7B and Llama-3-70B configs on 8 x 80 GB GPUs (bf16 compute, fp32 master weights).

    .venv/bin/python bench/trainer_scale.py --hidden 1024 --layers 12
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

GIB = 1024**3


def make_model(dest: Path, hidden: int, layers: int, heads: int) -> tuple[Path, int]:
    """A random Llama with SmolLM2's tokenizer; returns (dir, parameter count)."""
    from posttrain.models import make_tiny_model

    if not (dest / "config.json").exists():
        make_tiny_model(dest, seed=0, num_layers=layers, hidden_size=hidden, num_heads=heads)
    from posttrain.trainer.model.training_engine import count_parameters

    return dest, count_parameters(dest)[0]


def batch(policy: Any, samples: int, completion: int) -> list[Any]:
    """``samples`` completions of ``completion`` tokens after two prompts (GRPO-like)."""
    from posttrain.trainer.algorithms.logprobs import TrainSample
    from posttrain.trainer.algorithms.loss import sequence_coefficients

    prompts = [
        policy.encode_prompt("What is 12 * 12? Think step by step."),
        policy.encode_prompt("Write a function that reverses a list."),
    ]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (samples, completion), generator=generator).tolist()
    coefficients = sequence_coefficients([completion] * samples, "token_mean", completion)
    return [
        TrainSample(prompts[i % 2], ids[i], [-1.0] * completion, (-1.0) ** i, c)
        for i, c in enumerate(coefficients)
    ]


def _status_kib(field: str) -> int:
    """One ``kB`` field of ``/proc/self/status``; 0 where there is none (not Linux)."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else ():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def peak_rss() -> int:
    """This process's own peak RSS in bytes (``VmHWM``).

    Not ``ru_maxrss``: on Linux that survives ``fork`` + ``exec``, so a spawned rank would
    report at least its parent's peak (here the parent wrote the random model, ~1.4x the
    model's fp32 size), which made every loading peak read the same number. ``VmHWM`` is
    the high-water mark of the process's own address space, which ``exec`` starts anew.
    """
    hwm = _status_kib("VmHWM")
    if hwm:
        return hwm * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux


class AnonPeak:
    """Peak anonymous RSS (``RssAnon``) while the block runs, sampled every 2 ms, per phase.

    ``VmHWM`` also counts file pages: safetensors are memory-mapped, so every page a rank
    reads from the checkpoint is resident (page cache, shared between the node's ranks and
    reclaimable) beside the copy it keeps. Anonymous memory is what a rank really holds.
    :meth:`label` names the phase now running; :attr:`phases` keeps each phase's peak (KiB).
    """

    def __init__(self) -> None:
        self.current = "load"
        self.phases: dict[str, int] = {}

    def __enter__(self) -> AnonPeak:
        import threading

        self.peak = _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def label(self, phase: str) -> None:
        self._record()
        self.current = phase

    def _record(self) -> None:
        now = _status_kib("RssAnon")
        self.peak = max(self.peak, now)
        self.phases[self.current] = max(self.phases.get(self.current, 0), now)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._record()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._record()


def label_phases(policy: Any, sampler: AnonPeak) -> None:
    """Name the phases of :meth:`Policy.train_step` for ``sampler`` (this policy only).

    The loss forward is ``completion_logprobs``; what follows it until the next forward or
    the optimizer is the loss and its backward (including FSDP's reduce-scatters); then
    clipping and AdamW's step."""

    def labelled(call: Any, during: str, after: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            sampler.label(during)
            try:
                return call(*args, **kwargs)
            finally:
                sampler.label(after)

        return run

    policy.completion_logprobs = labelled(policy.completion_logprobs, "forward", "backward")
    policy.optimization.apply = labelled(policy.optimization.apply, "clip", "between steps")
    policy.optimizer.step = labelled(policy.optimizer.step, "optimizer step", "clip")


def state_bytes(policy: Any) -> int:
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in policy.module.parameters():
        total += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * local(p.grad).element_size()
    for state in policy.optimizer.state.values():
        total += sum(
            local(v).numel() * local(v).element_size()
            for v in state.values()
            if torch.is_tensor(v) and v.dim() > 0
        )
    return total


def measure(
    model: Path,
    rank: int,
    world: int,
    samples: int,
    completion: int,
    steps: int,
    full_load: bool = False,
    share_prompts: bool = False,
) -> dict[str, Any]:
    from posttrain.trainer.model.policy import EngineOptions, Policy, RankInfo

    started = time.perf_counter()
    anon = AnonPeak()
    with anon:
        policy = Policy(
            model,
            learning_rate=1e-5,
            rank=RankInfo(rank, world, rank),
            engine=EngineOptions(full_load_before_sharding=full_load),
        )
        if share_prompts:
            # what sharded ranks did before 2026-12-05: each forward runs every block twice
            policy.module.share_prompts = True
        load_seconds = time.perf_counter() - started
        load_peak = peak_rss()
        load_anon = anon.peak
        anon.label("between steps")
        label_phases(policy, anon)
        times = _train(policy, rank, world, samples, completion, steps)
    # gradients still held (set_to_none happens at the next step): count them too
    return {
        "rank": rank,
        "state_bytes": state_bytes(policy),
        "peak_rss_bytes": peak_rss(),
        "step_seconds": times,
        "sharded": policy.sharded,
        "load_peak_rss_bytes": load_peak,
        "load_peak_anon_bytes": load_anon * 1024,
        "phase_peak_anon_bytes": {k: v * 1024 for k, v in anon.phases.items()},
        "load_seconds": load_seconds,
    }


def _train(
    policy: Any, rank: int, world: int, samples: int, completion: int, steps: int
) -> list[float]:
    """``steps`` RL steps of this rank's share of the global batch; seconds per step."""
    from posttrain.trainer.algorithms.loss import LossConfig

    everything = batch(policy, samples, completion)
    mine = everything[rank::world]
    for s in mine:
        s.coefficient *= world  # FSDP averages ranks: keep the global loss scale
    times = []
    for step in range(1, steps + 1):
        started = time.perf_counter()
        policy.train_step(
            mine,
            LossConfig(),
            micro_batch_size=max(1, samples // world),
            grad_clip=1.0,
            temperature=1.0,
            step=step,
        )
        times.append(time.perf_counter() - started)
    return times


def _rank(
    rank: int,
    world: int,
    port: int,
    model: str,
    samples: int,
    completion: int,
    steps: int,
    out: Any,
    full_load: bool = False,
    share_prompts: bool = False,
) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out[rank] = measure(
        Path(model), rank, world, samples, completion, steps, full_load, share_prompts
    )
    dist.destroy_process_group()


def run_unsharded(model: Path, samples: int, completion: int, steps: int) -> dict[str, Any]:
    """In a fresh process, so its peak RSS is its own."""
    out = mp.Manager().dict()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_single, args=(str(model), samples, completion, steps, out))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"unsharded run failed with exit code {proc.exitcode}")
    return dict(out[0])


def run_two_ranks(
    model: Path,
    samples: int,
    completion: int,
    steps: int,
    *,
    full_load: bool = False,
    share_prompts: bool = False,
) -> list[dict[str, Any]]:
    """Two Gloo ranks in fresh processes; each rank's :func:`measure`."""
    from posttrain.processes import free_port

    out = mp.Manager().dict()
    mp.spawn(
        _rank,
        args=(
            2,
            free_port(),
            str(model),
            samples,
            completion,
            steps,
            out,
            full_load,
            share_prompts,
        ),
        nprocs=2,
        join=True,
    )
    return [dict(out[r]) for r in range(2)]


def _single(model: str, samples: int, completion: int, steps: int, out: Any) -> None:
    out[0] = measure(Path(model), 0, 1, samples, completion, steps)


def planning_table(bytes_per_param: float) -> list[dict[str, Any]]:
    """7B and 70B on 8 x 80 GB, full fine-tune and LoRA, from their configs (meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.trainer.model.training_engine import decoder_layers, estimate_training_memory

    configs = {
        "Llama-2-7B": LlamaConfig(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
        ),
        "Llama-3-70B": LlamaConfig(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
        ),
    }
    rows = []
    for name, config in configs.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        total = sum(p.numel() for p in model.parameters())
        layers = decoder_layers(model)
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        outside = total - sum(sum(p.numel() for p in layer.parameters()) for layer in layers)
        lora = sum(
            16 * (m.in_features + m.out_features)
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1].endswith("_proj")
        )
        for mode, trainable in (("full", total), ("LoRA r=16", lora)):
            for gpus in (8, 16, 32):
                # measured bytes for each trained parameter, 4 (fp32 master) for a frozen one,
                # all sharded; plus bf16 copies of the root and two blocks, unsharded, and
                # their gradients (bf16 + the fp32 copy reduced) for the trained fraction
                gathered = outside + 2 * largest
                per_gpu = (
                    (bytes_per_param * trainable + 4 * (total - trainable)) / gpus
                    + 2 * gathered
                    + 6 * gathered * trainable / total
                )
                engine = estimate_training_memory(
                    total,
                    trainable,
                    largest,
                    outside,
                    world_size=gpus,
                    compute_bytes=2,
                    reference=False,
                ).per_rank_bytes
                rows.append(
                    {
                        "model": name,
                        "params_b": round(total / 1e9, 2),
                        "mode": mode,
                        "gpus": gpus,
                        "per_gpu_gib": round(per_gpu / GIB, 1),
                        "engine_estimate_gib": round(engine / GIB, 1),
                        "fits_80gb": per_gpu <= 0.9 * 80e9,
                    }
                )
    return rows


def print_plan(plan: list[dict[str, Any]]) -> None:
    print("plan (bf16 compute, fp32 master + grads + AdamW sharded, activations excluded):")
    for row in plan:
        print(
            f"  {row['model']:<12} {row['params_b']:>6}B {row['mode']:<10} "
            f"{row['gpus']:>2} GPUs: {row['per_gpu_gib']:>6} GiB/GPU "
            f"(engine's check {row['engine_estimate_gib']})  "
            f"{'fits' if row['fits_80gb'] else 'does NOT fit'} 80 GB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8, help="completions per global batch")
    parser.add_argument("--completion", type=int, default=64, help="tokens per completion")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=None,
        metavar="BYTES",
        help="glibc's fixed mmap threshold for every measured process "
        "(MALLOC_MMAP_THRESHOLD_): larger blocks are mmapped and go back to the OS when "
        "freed, so peaks show live tensors rather than the allocator's retained heap",
    )
    parser.add_argument(
        "--skip-old-load",
        action="store_true",
        help="skip the full-load-then-shard phase",
    )
    parser.add_argument(
        "--compare-shared-prompts",
        action="store_true",
        help="also run the two ranks with the shared-prompt forward (two decoder passes)",
    )
    parser.add_argument(
        "--plan-only",
        type=float,
        default=None,
        metavar="BYTES_PER_PARAM",
        help="print only the planning table, from bytes per trained parameter measured "
        "by an earlier run (16.00 for fp32 weights + grads + AdamW)",
    )
    args = parser.parse_args()
    if args.plan_only is not None:
        print_plan(planning_table(args.plan_only))
        return
    if args.malloc_mmap_threshold is not None:
        # read by glibc when each spawned process starts (spawn = fork + exec)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)

    root = Path(tempfile.gettempdir()) / f"posttrain-bench-{args.hidden}x{args.layers}"
    model, params = make_model(root / "model", args.hidden, args.layers, args.heads)
    print(
        f"model: random Llama, hidden {args.hidden}, {args.layers} layers: "
        f"{params / 1e6:.0f}M parameters; batch {args.samples} x {args.completion} tokens",
        flush=True,
    )
    single = run_unsharded(model, args.samples, args.completion, args.steps)
    ranks = run_two_ranks(model, args.samples, args.completion, args.steps)
    # The old way, load only: every rank reads the full model, then shards it.
    old_ranks = (
        []
        if args.skip_old_load
        else run_two_ranks(model, args.samples, args.completion, 0, full_load=True)
    )
    shared = (
        run_two_ranks(model, args.samples, args.completion, args.steps, share_prompts=True)
        if args.compare_shared_prompts
        else []
    )
    bytes_per_param = single["state_bytes"] / params
    result = {
        "parameters": params,
        "unsharded": single,
        "two_ranks": ranks,
        "state_ratio_per_rank": [r["state_bytes"] / single["state_bytes"] for r in ranks],
        "peak_rss_ratio_per_rank": [r["peak_rss_bytes"] / single["peak_rss_bytes"] for r in ranks],
        "load_peak_rss_per_rank": {
            "per-rank sharded load": [r["load_peak_rss_bytes"] for r in ranks],
            "full load, then shard (old)": [r["load_peak_rss_bytes"] for r in old_ranks],
            "1 process (plain module)": single["load_peak_rss_bytes"],
        },
        "load_peak_anon_per_rank": {
            "per-rank sharded load": [r["load_peak_anon_bytes"] for r in ranks],
            "full load, then shard (old)": [r["load_peak_anon_bytes"] for r in old_ranks],
            "1 process (plain module)": single["load_peak_anon_bytes"],
        },
        "load_seconds_per_rank": {
            "per-rank sharded load": [r["load_seconds"] for r in ranks],
            "full load, then shard (old)": [r["load_seconds"] for r in old_ranks],
        },
        "step_seconds_last": {
            "1 rank": single["step_seconds"][-1],
            "2 ranks": max(r["step_seconds"][-1] for r in ranks),
        },
        "phase_peak_anon_per_rank": {
            "1 process": single["phase_peak_anon_bytes"],
            "2 ranks": [r["phase_peak_anon_bytes"] for r in ranks],
        },
        "two_ranks_shared_prompts": shared,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "bytes_per_param_measured": bytes_per_param,
        "plan": planning_table(bytes_per_param),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    print(
        f"training state per rank: 1 rank {single['state_bytes'] / GIB:.2f} GiB; 2 ranks "
        + ", ".join(f"{r['state_bytes'] / GIB:.2f} GiB" for r in ranks)
        + f" (ratio {', '.join(f'{x:.3f}' for x in result['state_ratio_per_rank'])})"
    )
    print(
        f"peak RSS per rank: 1 rank {single['peak_rss_bytes'] / GIB:.2f} GiB; 2 ranks "
        + ", ".join(f"{r['peak_rss_bytes'] / GIB:.2f} GiB" for r in ranks)
    )
    for what, key in (
        ("peak RSS after loading", "load_peak_rss_per_rank"),
        ("peak anonymous RSS while loading", "load_peak_anon_per_rank"),
    ):
        loads = result[key]
        print(
            f"{what}, per rank: per-rank sharded load "
            + ", ".join(f"{b / GIB:.2f}" for b in loads["per-rank sharded load"])
            + " GiB; full load then shard (old) "
            + (
                ", ".join(f"{b / GIB:.2f}" for b in loads["full load, then shard (old)"])
                or "(skipped)"
            )
            + f" GiB; 1 process {loads['1 process (plain module)'] / GIB:.2f} GiB"
        )
    print("peak anonymous RSS per phase of the steps (GiB): 1 process | rank 0, rank 1")
    for phase in ("forward", "backward", "clip", "optimizer step"):
        print(
            f"  {phase:<15} {single['phase_peak_anon_bytes'].get(phase, 0) / GIB:6.2f} | "
            + ", ".join(f"{r['phase_peak_anon_bytes'].get(phase, 0) / GIB:.2f}" for r in ranks)
        )
    if shared:
        print(
            "2 ranks with shared prompts (two decoder passes per forward): peak RSS "
            + ", ".join(f"{r['peak_rss_bytes'] / GIB:.2f}" for r in shared)
            + " GiB; backward anonymous peak "
            + ", ".join(
                f"{r['phase_peak_anon_bytes'].get('backward', 0) / GIB:.2f}" for r in shared
            )
            + f" GiB; last step {max(r['step_seconds'][-1] for r in shared):.1f} s"
        )
    print(
        f"step seconds (last step): 1 rank {single['step_seconds'][-1]:.1f}, 2 ranks "
        f"{result['step_seconds_last']['2 ranks']:.1f}"
    )
    print(f"bytes per parameter (weights + grads + AdamW, fp32): {bytes_per_param:.2f}")
    print_plan(result["plan"])
    print(f"load average: {' '.join(result['loadavg'])}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
