"""Getting the trainer's new weights to the rollout servers after each optimizer step.

One protocol, two transports. The server always receives ``POST /v1/weights/load
{uri, version}``, swaps the weights in between decode steps and tags every sample with the
version (so staleness checks and importance correction are unchanged); what differs is
where ``uri`` points:

* **registry** (any topology): ``save_pretrained`` + storage's ``WeightRegistry`` (files,
  digest manifest, ``latest.json`` pointer), then load from there. Durable: a restarted
  server or a new replica finds the latest version by itself. Measured 3-6 s (2.2 CPU-s)
  per step for SmolLM2-135M in fp32 on 2 cores (540 MB written twice and hashed).
* **shared memory** (every endpoint on this host, e.g. ``posttrain run --local``): one
  safetensors file in a tmpfs directory (``/dev/shm``) that the server reads in place
  (``file://`` URI, :func:`posttrain.rollout.weights.fetch_weights`): no disk, no digest,
  ~0.5 s. The registry still gets the weights whenever a checkpoint is saved
  (``durable=True``), so ``weights/`` keeps up with the checkpoints.

A registry version is published as a **delta** over the previous registry version (only
the elements whose bits changed, :mod:`posttrain.rollout.deltas`) when that pays
(:class:`DeltaPolicy`): at RL learning rates most bf16 weights are bit-identical between
steps. Replicas rebuild and digest-check the full bytes (:func:`posttrain.rollout.weights.
fetch_version`); a full version at least every ``max_chain`` versions bounds what a
replica that joins late replays.

A loopback URL can still hide another machine (``kubectl port-forward``): if the server
cannot read the shared file, the publisher falls back to the registry for the rest of the
run instead of failing it.
"""

from __future__ import annotations

import atexit
import ipaddress
import logging
import shutil
import tempfile
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from prometheus_client import Counter, Histogram

from posttrain.api import env
from posttrain.telemetry import get_tracer, timed
from posttrain.trainer.model.dist_context import DistContext

log = logging.getLogger(__name__)
tracer = get_tracer(__name__)

PUBLISH_SECONDS = Histogram(
    "posttrain_trainer_weight_publish_seconds",
    "Time from a finished optimizer step until every rollout server serves the new weights",
    ["transport"],
)
PUBLISH_BYTES = Counter(
    "posttrain_trainer_weight_publish_bytes_total",
    "Bytes of weights written per publish (the transfer every replica then reads)",
    ["transport"],
)
REGISTRY_VERSIONS = Counter(
    "posttrain_trainer_weight_versions_total",
    "Weight versions committed to the registry, full or as a delta over the previous one",
    ["kind"],
)
PUBLISH_PHASE_SECONDS = Histogram(
    "posttrain_trainer_weight_publish_phase_seconds",
    "Seconds of each phase of a publish: write (the safetensors), delta (diff against the "
    "last registry version), commit (registry copy + digests + manifest), keep_base, load "
    "(every replica fetching, verifying and reloading, in parallel)",
    ["transport", "phase"],
)
SHARED_MEMORY_ROOT = Path("/dev/shm")


def _format_phases(phases: dict[str, float]) -> str:
    """
    >>> _format_phases({"write": 0.25, "load": 1.0})
    'write 0.25s, load 1.00s'
    """
    return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items())


def all_on_this_host(urls: list[str]) -> bool:
    """True when every rollout endpoint is a loopback address (it can read our files).

    >>> all_on_this_host(["http://127.0.0.1:8000", "http://localhost:9"])
    True
    >>> all_on_this_host(["http://127.0.0.1:8000", "http://rollout-0.pool:8000"])
    False
    """
    return bool(urls) and all(_is_loopback(urlparse(u).hostname or "") for u in urls)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback  # 127.0.0.0/8, ::1
    except ValueError:  # a DNS name: another host, as far as we can tell
        return False


SERVING_DTYPES = ("bfloat16", "float16", "float32")  # api EngineArgs.dtype, less "auto"


def serving_dtype(value: str | None) -> Any | None:
    """The rollout pool's serving dtype the operator handed the trainer
    (:attr:`posttrain.api.env.TrainerEnv.rollout_dtype`), as a torch dtype; None when unset
    (local runs, explicit endpoints, ``dtype: auto``).

    A bad value fails the run at start, naming the variable, rather than publishing every
    step in a dtype the replicas do not hold.

    >>> serving_dtype("bfloat16")
    torch.bfloat16
    >>> serving_dtype(None) is None
    True
    >>> serving_dtype("bf16")
    Traceback (most recent call last):
    ...
    ValueError: $POSTTRAIN_ROLLOUT_DTYPE is 'bf16'; expected one of bfloat16, float16, float32
    """
    import torch

    if not value:
        return None
    if value not in SERVING_DTYPES:
        raise ValueError(
            f"${env.ROLLOUT_DTYPE} is {value!r}; expected one of {', '.join(SERVING_DTYPES)}"
        )
    return getattr(torch, value)


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the names of api EngineArgs.dtype).

    >>> import torch
    >>> dtype_name(torch.float32)
    'float32'
    """
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DeltaPolicy:
    """When a registry version ships as a delta over the previous one."""

    max_ratio: float = 0.5
    """Publish a delta only when its bytes are at most this fraction of the full version's:
    a delta costs the replicas a rebuild (read base, XOR, digest every tensor) and
    lengthens the chain a late joiner replays, so it must save real bytes. More than this
    fraction of the *elements* changed (fp32 weights under Adam: all of them) also makes a
    full version, decided before compressing the rest. At the demo's learning rate in bf16
    ~5% change and a delta is ~1/20 of the bytes (docs/benchmarks.md, "Weight deltas")."""
    max_chain: int = 8
    """A full version after this many deltas in a row: bounds what a replica that joins
    late replays (one full download plus at most this many deltas) and what retention keeps
    (up to ``keep_last + max_chain`` versions)."""

    def __post_init__(self) -> None:
        if not 0 < self.max_ratio <= 1 or self.max_chain < 1:
            raise ValueError(f"DeltaPolicy needs 0 < max_ratio <= 1 and max_chain >= 1, got {self}")


class WeightPublisher:
    """Publishes policy versions to the rollout servers through the cheapest working path."""

    def __init__(
        self,
        registry: Any,
        registry_uri: str,
        client: Any,
        scratch: Path,
        *,
        shared: bool,
        dtype: Any | None = None,
        deltas: DeltaPolicy | None = DeltaPolicy(),
        transfer_bucket_bytes: int | None = None,
        stream: bool | None = None,
    ) -> None:
        """``dtype``: publish floating-point tensors in this dtype (the pool's serving dtype,
        e.g. bf16 from fp32 master weights: half the bytes every replica reads); None
        publishes what the trainer holds (bf16 already when it trains in bf16).
        ``deltas``: when registry versions may be deltas; None publishes every one full.
        ``transfer_bucket_bytes``: with ``shared``, first try a direct transfer into the
        replicas' memory in buckets of this size (:mod:`posttrain.rollout.weight_transfer`:
        no file, two buckets of memory); None, or servers without it, use the files.
        ``stream``: whether vLLM replicas stream a full ``s3://`` registry version into the
        engine as it downloads (``WeightLoadRequest.stream``; None lets each replica choose:
        it streams when idle)."""
        self.registry = registry  # posttrain.storage.checkpoints.WeightRegistry
        self.registry_uri = registry_uri
        self.client = client  # posttrain.rollout.client.RolloutClient
        self.scratch = scratch
        self.shared_dir: Path | None = None
        if shared:
            root = SHARED_MEMORY_ROOT if SHARED_MEMORY_ROOT.is_dir() else None
            self.shared_dir = Path(tempfile.mkdtemp(prefix="posttrain-weights-", dir=root))
            # tmpfs is RAM: do not leave 0.5 GB behind when the run dies with an exception.
            atexit.register(shutil.rmtree, self.shared_dir, ignore_errors=True)
        self.durable_versions: list[int] = []  # versions committed to the registry
        self.transfer_bucket_bytes = transfer_bucket_bytes if shared else None
        self._stream: Any = None  # rollout.weight_transfer.BucketStream, kept between publishes
        self.dtype = dtype
        self.stream_registry_loads = stream
        self.last_bytes = 0  # bytes written by the last publish (all transports)
        self.deltas = deltas
        self.last_kind = ""  # "full" | "delta": how the last registry version was published
        self.last_changed_fraction: float | None = None  # of elements, when it was compared
        # Seconds per phase of the last publish (PUBLISH_PHASES), and each replica's own.
        self.last_phases: dict[str, float] = {}
        # The longest any replica waited, in the last publish, for the completions it was
        # generating before it could take the weights (its "drain" phase): with rollouts
        # sampled ahead (maxPolicyLag >= 1) this is where a short pool makes the trainer
        # wait, so the step's rollout wait counts it (trainer/observe/rollout_wait.py).
        self.last_replica_drain_seconds = 0.0
        # The tensors of the last registry version (the next delta's base), and how many
        # deltas in a row lead to it.
        self._base: tuple[int, Path] | None = None
        self._chain = 0

    @property
    def transport(self) -> str:
        if self.shared_dir is None:
            return "registry"
        return "shared" if self.transfer_bucket_bytes is None else "transfer"

    def publish(self, policy: Any, version: int, *, durable: bool = False) -> None:
        """Make every server sample from ``policy``'s weights as ``version``.

        ``durable`` also commits the version to the registry when the shared path served it.
        Collective: every rank calls it; the weights are gathered tensor by tensor
        (:meth:`Policy.full_weights`) and written once, by rank 0, which alone talks to
        the servers and the registry.
        """
        started = time.monotonic()
        self.last_bytes = 0
        self.last_phases = {}
        self.last_replica_drain_seconds = 0.0
        with tracer.start_as_current_span("trainer.publish_weights") as span:
            span.set_attribute("weights.version", version)
            # A same-host server reloads only the safetensors, and cast versions are for
            # servers, not for resuming: weights only. Otherwise a full HF directory.
            weights_only = self.dtype is not None or (self.shared_dir is not None and not durable)
            # The manifest names the dtype written, so a replica's operator can check it.
            written = self.dtype or getattr(policy, "export_dtype", None)
            metadata = {"dtype": dtype_name(written)} if written is not None else {}
            span.set_attribute("weights.dtype", metadata.get("dtype", "unknown"))
            if self._transfer(policy, version):
                if durable:  # the registry still gets checkpoint steps, off the servers' path
                    with self._phase("write"):
                        local = policy.save_weights(
                            self.scratch / f"publish-v{version}",
                            weights_only=weights_only,
                            dtype=self.dtype,
                        )
                    if local is not None:  # rank 0; the others only took part in the gathers
                        self._publish_registry(local, version, load=False, metadata=metadata)
                        shutil.rmtree(local, ignore_errors=True)
            else:
                with self._phase("write"):
                    local = self._write(policy, version, weights_only=weights_only)
                if local is None:  # not rank 0: it only took part in the gathers
                    return
                if self.shared_dir is None:
                    self._publish_registry(local, version, load=True, metadata=metadata)
                    shutil.rmtree(local, ignore_errors=True)
                elif not self._load_shared(local, version):
                    # before tmpfs is emptied
                    self._publish_registry(local, version, load=True, metadata=metadata)
                    self._stop_sharing()
                elif durable:
                    self._publish_registry(local, version, load=False, metadata=metadata)
            self.last_replica_drain_seconds = self._replica_drain()
            span.set_attribute("weights.transport", self.transport)
            span.set_attribute("weights.bytes", self.last_bytes)
        PUBLISH_SECONDS.labels(self.transport).observe(time.monotonic() - started)
        PUBLISH_BYTES.labels(self.transport).inc(self.last_bytes)
        for phase, seconds in self.last_phases.items():
            PUBLISH_PHASE_SECONDS.labels(self.transport, phase).observe(seconds)
        log.info("published weights v%d: %.1f MB in %.2fs (%s, %s; %s)%s", version,
                 self.last_bytes / 1e6, time.monotonic() - started, self.transport,
                 dtype_name(self.dtype) if self.dtype is not None else "trainer dtype",
                 _format_phases(self.last_phases), self._replica_phases())  # fmt: skip

    def _phase(self, name: str) -> AbstractContextManager[None]:
        """Add the block's seconds to ``last_phases[name]``."""
        return timed(self.last_phases, name)

    def _replica_drain(self) -> float:
        """The slowest replica's ``drain`` phase in its answer to this publish's load (or
        transfer); 0 when no replica said."""
        replies = getattr(self.client, "last_load_replies", {}) or {}
        return max(
            (float((reply.get("phases") or {}).get("drain", 0.0)) for reply in replies.values()),
            default=0.0,
        )

    def _replica_phases(self) -> str:
        """Each replica's own phases of the last load, for the publish's log line."""
        replies = getattr(self.client, "last_load_replies", {}) or {}
        return "".join(
            f"; {url}: {_format_phases(reply.get('phases') or {})}"
            for url, reply in sorted(replies.items())
            if reply.get("phases")
        )

    def close(self) -> None:
        self._stop_sharing()
        self._close_stream()
        if self._base is not None:
            shutil.rmtree(self._base[1], ignore_errors=True)
            self._base = None

    def _transfer(self, policy: Any, version: int) -> bool:
        """Stream ``policy``'s weights straight into every replica's memory; False (and the
        files from now on) when that is off or a replica cannot take it.

        Collective with several trainer ranks: every rank walks :meth:`Policy.full_weights`
        (each tensor is an all-gather), rank 0 alone packs and sends. If rank 0's transfer
        fails part way, it still walks the rest of the gathers, so every rank has taken
        part in the same collectives, and then every rank learns the outcome (one
        all-reduce) and falls back to the files together.
        """
        from posttrain.rollout.client import RolloutError

        if self.transfer_bucket_bytes is None:
            return False
        rank = getattr(policy, "rank", None)
        world_size = int(getattr(rank, "world_size", 1))
        main = int(getattr(rank, "rank", 0)) == 0
        # A trainer on a GPU stages on it (CUDA IPC to a vLLM replica on that GPU node).
        device = getattr(getattr(policy, "plan", None), "device", None) or "cpu"
        weights = policy.full_weights(None, device)
        failure: RolloutError | None = None
        if main:
            failure = self._send(weights, version, device, self.transfer_bucket_bytes)
        for _ in weights:  # the gathers rank 0 did not take (all of them on other ranks)
            pass
        failed = DistContext(world_size=world_size).any_rank(failure is not None)
        if failed:
            log.info("direct weight transfer unavailable (%s); publishing through shared "
                     "files from now on",
                     failure or "it failed on trainer rank 0")  # fmt: skip
            self.transfer_bucket_bytes = None
            self._close_stream()
            return False
        return True

    def _send(self, weights: Any, version: int, device: Any, bucket_bytes: int) -> Any:
        """Rank 0's half of :meth:`_transfer`: pack ``weights`` into the staging buckets and
        have every replica load them. Returns the ``RolloutError`` that stopped it, or
        None; ``weights`` may be left part-consumed."""
        from posttrain.rollout.client import RolloutError
        from posttrain.rollout.weight_transfer import BucketStream

        if self._stream is None:
            self._stream = BucketStream(bucket_bytes, device, dtype=self.dtype)
            atexit.register(self._stream.close)  # /dev/shm is RAM
        stream = self._stream
        try:
            with self._phase("transfer"):
                self.client.transfer_weights(
                    version,
                    # In the trainer's dtype: the stream casts while it packs (no temporaries).
                    stream.updates(weights),
                    device=stream.device.type,
                )
        except RolloutError as exc:
            return exc
        self.last_phases["gather"] = stream.gather_seconds
        self.last_phases["pack"] = stream.pack_seconds
        self.last_bytes += stream.bytes
        return None

    def _write(self, policy: Any, version: int, *, weights_only: bool) -> Path | None:
        """The version as an HF directory (in ``self.dtype`` when set): in tmpfs when
        sharing, else in scratch. Collective; rank 0 gets the directory, the others None."""
        from posttrain.rollout.weights import version_dir_name

        if self.shared_dir is not None:
            target = self.shared_dir / version_dir_name(version)
        else:
            target = self.scratch / f"publish-v{version}"
        return policy.save_weights(target, weights_only=weights_only, dtype=self.dtype)

    def _load_shared(self, local: Path, version: int) -> bool:
        """Have the servers load the tmpfs copy; False if they cannot read it."""
        from posttrain.rollout.client import RolloutError

        assert self.shared_dir is not None
        self.last_bytes += sum(f.stat().st_size for f in local.glob("*.safetensors"))
        try:
            with self._phase("load"):
                self.client.load_weights(f"file://{self.shared_dir}", version)
        except RolloutError as exc:
            # Expected whenever the servers run in other pods or hosts (they do not see this
            # pod's /dev/shm): the registry path is the normal one there, so INFO, not WARNING.
            log.info(
                "rollout server cannot read weights from %s (%s); publishing through "
                "the weight registry from now on",
                self.shared_dir,
                exc,
            )
            return False
        # The server has copied the tensors into its model: older files are dead weight.
        for old in self.shared_dir.iterdir():
            if old != local:
                shutil.rmtree(old, ignore_errors=True)
        return True

    def _publish_registry(
        self, local: Path, version: int, *, load: bool, metadata: dict[str, Any] | None = None
    ) -> None:
        with self._phase("delta"):
            delta = self._write_delta(local, version)
        delta_dir = None if delta is None else delta[0]
        meta = dict(metadata or {}) if delta is None else {**(metadata or {}), "delta": delta[1]}
        try:
            with self._phase("commit"):
                manifest = self.registry.publish(version, delta_dir or local, meta)
        finally:
            if delta_dir is not None:
                shutil.rmtree(delta_dir, ignore_errors=True)
        self.last_kind = "full" if delta_dir is None else "delta"
        REGISTRY_VERSIONS.labels(self.last_kind).inc()
        self._chain = 0 if delta_dir is None else self._chain + 1
        with self._phase("keep_base"):
            self._keep_base(local, version)
        self.last_bytes += int(getattr(manifest, "total_bytes", 0))
        self.durable_versions.append(version)
        if load:
            with self._phase("load"):
                stream = self.stream_registry_loads
                options = {} if stream is None else {"stream": stream}
                self.client.load_weights(self.registry_uri, version, **options)

    def _write_delta(self, local: Path, version: int) -> tuple[Path, dict[str, Any]] | None:
        """The delta of ``local`` over the last registry version as a directory to commit
        and its manifest entry, or None when a full version is due or pays better
        (:class:`DeltaPolicy`)."""
        from posttrain.rollout.deltas import SafetensorsDir, diff_state_dicts, write_delta

        policy, base = self.deltas, self._base
        self.last_changed_fraction = None
        if policy is None or base is None or self._chain >= policy.max_chain:
            return None
        if base[0] not in self.registry.versions():  # pruned by another writer: start over
            return None
        plan = diff_state_dicts(
            base[0], SafetensorsDir(base[1]), SafetensorsDir(local), policy.max_ratio
        )
        self.last_changed_fraction = None if plan is None else plan.changed_fraction
        if plan is None or plan.delta_bytes > policy.max_ratio * plan.full_bytes:
            log.info("weights v%d: full version (%s)", version,
                     f"{plan.changed_fraction:.1%} of elements changed" if plan else
                     "tensors renamed, reshaped or recast, or most elements changed")  # fmt: skip
            return None
        log.info("weights v%d: delta over v%d, %.2f%% of elements changed, %.1f MB vs %.1f MB "
                 "full", version, base[0], 100 * plan.changed_fraction, plan.delta_bytes / 1e6,
                 plan.full_bytes / 1e6)  # fmt: skip
        return write_delta(plan, self.scratch / f"delta-v{version}").parent, plan.metadata

    def _keep_base(self, local: Path, version: int) -> None:
        """Keep ``version``'s tensors as the next delta's base (moved out of a scratch
        directory about to be deleted; copied out of shared memory, which a server reads)."""
        if self.deltas is None:
            return
        target = self.scratch / f"delta-base-v{version}"
        target.mkdir(parents=True, exist_ok=True)
        in_scratch = self.shared_dir is None or not local.is_relative_to(self.shared_dir)
        for file in local.glob("*.safetensors"):
            (shutil.move if in_scratch else shutil.copyfile)(file, target / file.name)
        if self._base is not None:
            shutil.rmtree(self._base[1], ignore_errors=True)
        self._base = (version, target)

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _stop_sharing(self) -> None:
        if self.shared_dir is not None:
            shutil.rmtree(self.shared_dir, ignore_errors=True)
            self.shared_dir = None
