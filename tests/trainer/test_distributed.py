"""Several trainer ranks: torchrun's agent on one node (two CPU ranks, a failing rank),
and the Ray launch.

The Ray test starts a real two-node Ray cluster on this machine (two raylets with one
CPU each, private temp dir and ports), then runs ``posttrain run`` as the operator runs it
on the head pod (``RAY_ADDRESS`` set, ``spec.resources.nodes: 2``, rollout endpoints in
``$POSTTRAIN_ROLLOUT_ENDPOINTS``) against a real rollout server process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from posttrain.devenv.process import free_port


def _manifest_two_cpu_ranks(model: Path, storage: Path) -> dict[str, Any]:
    body = _manifest(model, storage)
    body["spec"]["resources"] = {"nodes": 1}
    body["spec"]["engine"] = {"cpuRanks": 2}
    return body


def _run_local(manifest: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``posttrain run MANIFEST --local --out OUT``, output captured."""
    posttrain = str(Path(sys.executable).with_name("posttrain"))
    return subprocess.run(
        [posttrain, "run", str(manifest), "--local", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def two_local_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``posttrain run --local`` with ``engine.cpuRanks: 2``: torchrun's agent starts two
    Gloo ranks that shard the model (FSDP2) and sample from one local rollout server."""
    from posttrain.models import make_tiny_model
    from posttrain.trainer.observe.step_metrics import load_metrics

    root = tmp_path_factory.mktemp("two-local-ranks")
    model = make_tiny_model(root / "model", seed=0)
    manifest = root / "run.yaml"
    manifest.write_text(yaml.safe_dump(_manifest_two_cpu_ranks(model, root / "store")))
    run = _run_local(manifest, root / "out")
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    metrics = [load_metrics(root / "out"), load_metrics(root / "out/rank1")]
    # The same command with one more step: both ranks resume from step 2's shards.
    body = _manifest_two_cpu_ranks(model, root / "store")
    body["spec"]["algorithm"]["maxSteps"] = 3
    manifest.write_text(yaml.safe_dump(body))
    again = _run_local(manifest, root / "out")
    resume_log = again.stdout + again.stderr
    assert again.returncode == 0, resume_log[-6000:]
    return {
        "root": root,
        "log": log,
        "stdout": run.stdout,
        "metrics": metrics,
        "resume_log": resume_log,
        "resumed_metrics": [load_metrics(root / "out"), load_metrics(root / "out/rank1")],
    }


@pytest.mark.slow  # two ranks + a rollout server on 2 cores: ~2-3 min
def test_local_run_trains_on_two_cpu_ranks_in_lockstep(two_local_ranks: dict[str, Any]) -> None:
    assert "starting 2 rank(s) on node 0 of 1 (world 2" in two_local_ranks["log"]
    assert "run finished: 2 steps" in two_local_ranks["stdout"]
    rank0, rank1 = two_local_ranks["metrics"]
    assert [m["step"] for m in rank0] == [m["step"] for m in rank1] == [1, 2]
    assert all(m["applied"] for m in rank0 + rank1)
    for a, b in zip(rank0, rank1, strict=True):
        assert a["grad_norm"] == b["grad_norm"] > 0  # FSDP's reduced gradient: one global norm
        assert a["loss"] == b["loss"]  # the step's loss is reduced over ranks too
    assert [m["staleness"] for m in rank0 + rank1] == [0, 0, 0, 0]
    # both ranks' shards are in the committed checkpoint, with rank 0's HF export
    manifest = json.loads(
        (two_local_ranks["root"] / "store/checkpoints/step-00000002/manifest.json").read_text()
    )
    files = {f["path"] for f in manifest["files"]}
    assert {
        "dcp/__0_0.distcp",
        "dcp/__1_0.distcp",
        "dcp/.metadata",
        "model.safetensors",
        "config.json",
        "trainer_state.json",
    } <= files


@pytest.mark.slow
def test_two_cpu_ranks_resume_from_their_own_slices_without_hf_weights(
    two_local_ranks: dict[str, Any],
) -> None:
    """The loop's resume on sharded ranks: each rank builds its policy without HF weights
    and fetches only its slices of the DCP state, then trains step 3 in lockstep."""
    log = two_local_ranks["resume_log"]
    assert log.count("resumed from checkpoint step 2") == 2, log[-6000:]
    assert log.count("allocated (weights follow from the checkpoint)") == 2
    assert log.count("of the checkpoint's") == 2  # each rank: "fetched X of the checkpoint's Y"
    rank0, rank1 = two_local_ranks["resumed_metrics"]
    assert [m["step"] for m in rank0] == [m["step"] for m in rank1] == [1, 2, 3]
    assert rank0[-1]["applied"] and rank0[-1]["grad_norm"] == rank1[-1]["grad_norm"] > 0


@pytest.mark.slow
def test_a_failing_local_rank_fails_the_run(tmp_path: Path) -> None:
    """Rank 1 cannot create its output directory (a file is in the way) after both ranks
    joined the group: the agent must stop rank 0 and fail, not wait in a collective."""
    from posttrain.models import make_tiny_model

    model = make_tiny_model(tmp_path / "model", seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank1").write_text("not a directory")
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(_manifest_two_cpu_ranks(model, tmp_path / "store")))
    # The timeout only guards the suite: Gloo's collective timeout (30 min) is longer.
    run = subprocess.run(
        [
            str(Path(sys.executable).with_name("posttrain")),
            "run",
            str(manifest),
            "--local",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode != 0
    assert "FileExistsError" in run.stderr and "rank1" in run.stderr, run.stderr[-4000:]
    # Rank 0 did not wait out Gloo's 30-minute collective timeout: the run ended inside the
    # subprocess timeout above (a hang would raise TimeoutExpired).
    assert not (out / "metrics.jsonl").exists()  # rank 0 never finished a step


@pytest.fixture(scope="module")
def ray_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real two-node Ray cluster (GCS + two raylets) private to this module; its address."""
    pytest.importorskip("ray", reason="multi-node needs the `ray` extra: pip install ray==2.60.0")
    from ray.cluster_utils import Cluster

    # Short path: Ray's unix sockets live under it (108-byte limit). RAY_TMPDIR keeps Ray's
    # session files and its "current cluster" address file out of the shared /tmp/ray.
    temp_dir = Path(tempfile.mkdtemp(prefix="ptray-", dir="/tmp"))
    (temp_dir / "ray").mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_TMPDIR", str(temp_dir))
        for attempt in range(3):
            cluster = Cluster()
            try:
                cluster.add_node(
                    num_cpus=1,
                    gcs_server_port=free_port(),
                    include_dashboard=False,
                    temp_dir=str(temp_dir / "ray"),
                    dashboard_agent_listen_port=free_port(),
                    object_store_memory=100 * 1024 * 1024,
                )
                cluster.add_node(num_cpus=1, object_store_memory=100 * 1024 * 1024)
                break
            except Exception:
                # Ray gives a raylet 30 s (hard-coded) to register; on a machine shared with
                # other test runs that can pass. Start over rather than fail the module.
                cluster.shutdown()
                if attempt == 2:
                    shutil.rmtree(temp_dir, ignore_errors=True)
                    raise
        try:
            yield cluster.address
        finally:
            cluster.shutdown()  # kills the processes this cluster started, by handle
            shutil.rmtree(temp_dir, ignore_errors=True)


def _manifest(model: Path, storage: Path) -> dict[str, Any]:
    """Two nodes, one domain, sequence-mean GRPO: per-rank averaging equals the global mean."""
    return {
        "apiVersion": "posttrain.io/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "two-nodes"},
        "spec": {
            "model": str(model),
            "resources": {"nodes": 2},
            "algorithm": {
                "name": "grpo",
                "lossAggregation": "sequence_mean",
                "groupSize": 4,
                "promptsPerStep": 4,
                "maxSteps": 2,
                "learningRate": 1e-3,
                "maxNewTokens": 6,
                "microBatchSize": 4,
                "dynamicSampling": False,
                "seed": 3,
            },
            # A random tiny model never answers arithmetic; "two capital letters" passes about
            # half of its completions, so groups carry signal and the gradient is not zero.
            "domains": [
                {
                    "name": "arithmetic",
                    "dataset": "builtin:arithmetic",
                    "verifier": {"kind": "regex", "config": {"pattern": "[A-Z].*[A-Z]"}},
                }
            ],
            "evaluation": {"everySteps": 2, "maxItemsPerDomain": 2},
            "checkpoint": {"everySteps": 1, "keepLast": 2, "storageUri": str(storage)},
            "audit": {"spotCheckSamples": 4},
        },
    }


@dataclass
class TwoNodeRun:
    """What `posttrain run` left behind after training on the two-node cluster."""

    ray_address: str
    model: Path
    out: Path
    storage: Path
    spec: Any  # TrainingRunSpec
    log: str
    rank_metrics: list[list[dict[str, Any]]]  # [rank][step]
    records: list[dict[str, Any]]  # every rank's trajectory records


@pytest.fixture(scope="module")
def two_node_run(ray_two_nodes: str, tmp_path_factory: pytest.TempPathFactory) -> TwoNodeRun:
    """Run ``posttrain run`` as the operator does on the head pod: RAY_ADDRESS set, nodes from
    the spec (no $POSTTRAIN_NODES), endpoints from $POSTTRAIN_ROLLOUT_ENDPOINTS."""
    from posttrain.api import TrainingRun, load_manifest
    from posttrain.models import make_tiny_model
    from posttrain.storage.store import open_store
    from posttrain.storage.trajectories import read_trajectories
    from posttrain.trainer.observe.step_metrics import load_metrics
    from posttrain.trainer.run.server_process import LocalRolloutServer

    root = tmp_path_factory.mktemp("two-nodes")
    model = make_tiny_model(root / "model", seed=0)
    storage, out = root / "store", root / "out"
    manifest = root / "run.yaml"
    manifest.write_text(yaml.safe_dump(_manifest(model, storage)))
    spec = load_manifest(manifest, TrainingRun).spec
    with LocalRolloutServer(str(model), root / "server.log") as server:
        env = {
            **os.environ,
            "RAY_ADDRESS": ray_two_nodes,
            "POSTTRAIN_ROLLOUT_ENDPOINTS": server.url,
            "POSTTRAIN_RAY_NODE_WAIT_S": "60",
        }
        env.pop("POSTTRAIN_NODES", None)
        posttrain = Path(sys.executable).with_name("posttrain")
        # A relative --out, as a person types it: the actors must not resolve it in Ray's cwd.
        run = subprocess.run(
            [str(posttrain), "run", str(manifest), "--out", "out"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "run finished: 2 steps" in run.stdout, log[-6000:]
    records = list(read_trajectories(open_store(str(storage)), "trajectories"))
    return TwoNodeRun(
        ray_two_nodes,
        model,
        out,
        storage,
        spec,
        log,
        [load_metrics(out), load_metrics(out / "rank1")],
        records,
    )


@pytest.mark.slow  # Ray cluster + two torch actors + a rollout server: ~1.5-2.5 min on 2 cores
def test_both_ranks_train_in_lockstep_on_two_ray_nodes(two_node_run: TwoNodeRun) -> None:
    run = two_node_run
    assert "starting 2 trainer ranks on Ray nodes" in run.log
    rank0, rank1 = run.rank_metrics
    assert [m["step"] for m in rank0] == [m["step"] for m in rank1] == [1, 2]
    assert all(m["applied"] for m in rank0 + rank1)
    assert [m["weight_version"] for m in rank0] == [m["weight_version"] for m in rank1] == [1, 2]
    for a, b in zip(rank0, rank1, strict=True):
        # taken after the all-reduce, the gradient norm is the same global value on both ranks
        assert a["grad_norm"] == b["grad_norm"] > 0
    assert "(Ray Train)" in run.log and "rank 0 did 2 steps" in run.log
    # every rank's trajectories (both writers' chunks), tokens and log-probs, reached the store
    from posttrain.storage.store import open_store
    from posttrain.storage.trajectories import list_chunks

    writers = {
        key.rsplit("/", 1)[-1].split("-")[1]
        for key in list_chunks(open_store(str(run.storage)), "trajectories")
    }
    assert writers == {"rank0", "rank1"}
    per_rank_step = run.spec.algorithm.prompts_per_step // 2 * run.spec.algorithm.group_size
    for step in (1, 2):
        assert sum(r["step"] == step for r in run.records) == 2 * per_rank_step, step
    assert all(
        len(r["completion_logprobs"]) == len(r["completion_token_ids"]) > 0 for r in run.records
    )


def _replay_step(model: Path, records: list[dict[str, Any]], spec: Any) -> Any:
    """One single-process optimizer step over the global batch rebuilt from the records."""
    from posttrain.trainer.algorithms.logprobs import TrainSample
    from posttrain.trainer.algorithms.loss import loss_config, sequence_coefficients
    from posttrain.trainer.model.policy import Policy

    algo = spec.algorithm
    config = loss_config(algo)
    lengths = [len(r["completion_token_ids"]) for r in records]
    coefficients = sequence_coefficients(lengths, config.aggregation, config.max_new_tokens)
    samples = [
        TrainSample(
            r["prompt_token_ids"],
            r["completion_token_ids"],
            r["completion_logprobs"],
            r["advantage"],
            c,
        )
        for r, c in zip(records, coefficients, strict=True)
    ]
    policy = Policy(
        model, learning_rate=algo.learning_rate, weight_decay=algo.weight_decay, seed=algo.seed
    )
    stats = policy.train_step(
        samples,
        config,
        micro_batch_size=algo.micro_batch_size,
        grad_clip=algo.grad_clip,
        temperature=algo.temperature,
    )
    return policy, stats


@pytest.mark.slow
def test_two_rank_step_equals_single_process_step_over_global_batch(
    two_node_run: TwoNodeRun,
) -> None:
    """Well-defined here: sequence-mean over equal per-rank batches averages to the global
    mean. Step 1 only: step 2's samples depend on which weights the pool served when."""
    run = two_node_run
    step1 = [r for r in run.records if r["step"] == 1]
    replayed, stats = _replay_step(run.model, step1, run.spec)
    assert stats.grad_norm == pytest.approx(run.rank_metrics[0][0]["grad_norm"], rel=1e-4)

    after_step1 = load_file(run.storage / "checkpoints/step-00000001/model.safetensors")
    base = load_file(run.model / "model.safetensors")
    lr = run.spec.algorithm.learning_rate
    total = disagreeing = 0
    moved = 0.0
    for name, tensor in replayed.model.state_dict().items():
        if name not in after_step1:
            continue  # tied weights are saved once
        distributed_update = after_step1[name] - base[name]
        single_update = tensor - base[name]
        # Adam's first step moves each weight by ~lr * sign(grad). The two agree except where
        # a gradient is ~0 and the 1e-4 rounding of the logged log-probs flips its sign (a
        # handful of 3.2M weights); a missing or wrong all-reduce disagrees on a large share.
        disagreeing += int(((distributed_update - single_update).abs() > 0.05 * lr).sum())
        total += tensor.numel()
        moved += float(distributed_update.abs().sum())
    assert moved / total > 0.1 * lr  # the step did move the weights
    assert disagreeing / total <= 1e-4, f"{disagreeing} of {total} weights disagree"


@pytest.mark.slow
def test_rank0_checkpoint_loads_with_optimizer_state(
    two_node_run: TwoNodeRun, tmp_path: Path
) -> None:
    from posttrain.storage.store import open_store
    from posttrain.trainer.checkpointing.checkpoint import Checkpointer
    from posttrain.trainer.model.policy import Policy

    run = two_node_run
    lr = run.spec.algorithm.learning_rate
    restored = Checkpointer(open_store(str(run.storage)), keep_last=2, keep_best=False).restore(
        lambda d: Policy(d, learning_rate=lr), tmp_path / "scratch"
    )
    assert restored is not None
    policy, state = restored
    assert state.step == 2 and state.weight_version == 2
    assert policy.optimizer.state_dict()["state"]  # AdamW moments restored, not fresh
    final = load_file(run.storage / "checkpoints/step-00000002/model.safetensors")
    for name, tensor in policy.model.state_dict().items():
        if name in final:
            assert torch.equal(tensor, final[name]), name


@pytest.mark.slow
def test_follower_ranks_sample_from_the_published_weights(two_node_run: TwoNodeRun) -> None:
    """Rank 0 publishes; a follower must not open its next rollout before that (the loop's
    ``dist.barrier()`` after publishing), or its batch is sampled by the old weights and
    dropped as stale -- seen in this test's first runs, before that barrier existed."""
    for rank, metrics in enumerate(two_node_run.rank_metrics):
        assert [m["staleness"] for m in metrics] == [0, 0], f"rank {rank}: {metrics}"


@pytest.mark.slow
def test_a_failing_rank_fails_the_run_instead_of_hanging(
    two_node_run: TwoNodeRun, tmp_path: Path
) -> None:
    """Rank 1 cannot create its output directory (a file is in the way) after both ranks
    joined the process group: rank 0 would block in its first collective until Gloo's
    30-minute timeout unless the driver kills it, which it must do at once."""
    import time

    from posttrain.trainer.run.server_process import LocalRolloutServer

    out = tmp_path / "out"
    (out / "rank1").parent.mkdir(parents=True)
    (out / "rank1").write_text("not a directory")
    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(_manifest(two_node_run.model, tmp_path / "store")))
    with LocalRolloutServer(str(two_node_run.model), tmp_path / "server.log") as server:
        env = {
            **os.environ,
            "RAY_ADDRESS": two_node_run.ray_address,
            "POSTTRAIN_ROLLOUT_ENDPOINTS": server.url,
        }
        started = time.monotonic()
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("posttrain")),
                "run",
                str(manifest),
                "--out",
                str(out),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.monotonic() - started
    assert run.returncode != 0
    assert "FileExistsError" in run.stderr and "rank1" in run.stderr, run.stderr[-4000:]
    assert seconds < 300  # minutes, not Gloo's 30-minute collective timeout
    assert not (out / "metrics.jsonl").exists()  # rank 0 never finished a step


@pytest.mark.slow
def test_too_few_ray_nodes_fails_with_an_actionable_error(ray_two_nodes: str) -> None:
    import ray

    from posttrain.trainer.run.distributed import NODE_WAIT_ENV, _wait_for_nodes

    ray.init(address=ray_two_nodes, log_to_driver=False)
    try:
        assert len(_wait_for_nodes(ray, 2, gpus=0, timeout_s=10)) == 2
        expected = rf"3 trainer nodes requested but only 2 .*{NODE_WAIT_ENV}"
        with pytest.raises(RuntimeError, match=expected):
            _wait_for_nodes(ray, 3, gpus=0, timeout_s=2)
    finally:
        ray.shutdown()


def test_local_server_with_several_nodes_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from posttrain.cli import main

    manifest = tmp_path / "run.yaml"
    manifest.write_text(yaml.safe_dump(_manifest(tmp_path / "model", tmp_path / "store")))
    assert main(["run", str(manifest), "--local", "--out", str(tmp_path / "out")]) == 2
    assert "--local starts one CPU rollout server" in capsys.readouterr().err
