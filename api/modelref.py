"""Model references that need parsing: ``pvc://CLAIM/PATH`` (a model on a PersistentVolumeClaim)
and ``hf://ORG/NAME[@REVISION]`` (a Hugging Face Hub repository).

A platform team keeps base models on a shared volume (KServe's ``storageUri`` takes the same
``pvc://{claim}/{path}`` form), not in object storage. The operator mounts the claim
read-only at :data:`PVC_MOUNT_ROOT`/CLAIM in every pod that loads ``spec.model`` (trainer,
evaluator, rollout replicas and their ``fetch-model`` step), and
:func:`posttrain.models.resolve_model` maps the reference to that directory. One module so
the three sides (API validation, the operator's volumes, the model resolver) agree on the
form and on the path.

A Hugging Face Hub repository is named the way its users name it: ``hf://ORG/NAME``, with an
optional ``@REVISION`` (a branch, a tag, a commit hash or ``refs/pr/N``). The resolver
downloads it into the Hugging Face cache (``$HF_HOME``); the operator puts that cache on a
writable volume of the pods that load ``spec.model``, and the token of ``spec.hfTokenSecret``
in ``HF_TOKEN``. :func:`check_model_ref` is what the API models' validators run, so a malformed
reference of either kind is a spec error, not a failure minutes later in a pod.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from pydantic import Field

from .base import ApiModel

PVC_SCHEME = "pvc://"
PVC_MOUNT_ROOT = "/mnt/pvc"
PVC_MODEL_VOLUME = "model-pvc"
# A PersistentVolumeClaim's (and a Secret's) name is an RFC 1123 subdomain.
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class PvcModelRef:
    """Where a ``pvc://`` model lives: the claim and the directory inside it."""

    claim: str
    path: str  # relative to the claim's root; "" is the root itself

    @property
    def mount_path(self) -> str:
        """Where the operator mounts the claim (read-only)."""
        return f"{PVC_MOUNT_ROOT}/{self.claim}"

    @property
    def local_path(self) -> str:
        """The model directory inside a pod that has the claim mounted.

        >>> parse_pvc_ref("pvc://models/smollm2/v1").local_path
        '/mnt/pvc/models/smollm2/v1'
        >>> parse_pvc_ref("pvc://models").local_path
        '/mnt/pvc/models'
        """
        return posixpath.join(self.mount_path, self.path) if self.path else self.mount_path


def parse_pvc_ref(ref: str) -> PvcModelRef | None:
    """The claim and path of a ``pvc://CLAIM[/PATH]`` reference; None for other references;
    ``ValueError`` naming the fault for a malformed one (a spec error, not a runtime one).

    >>> parse_pvc_ref("s3://bucket/model") is None
    True
    >>> parse_pvc_ref("pvc://shared-models/llama/8b/")
    PvcModelRef(claim='shared-models', path='llama/8b')
    >>> parse_pvc_ref("pvc://Models/x")
    Traceback (most recent call last):
    ...
    ValueError: model 'pvc://Models/x': 'Models' is not a PersistentVolumeClaim name (lowercase RFC 1123 subdomain); use pvc://CLAIM/PATH
    >>> parse_pvc_ref("pvc://models/../etc")
    Traceback (most recent call last):
    ...
    ValueError: model 'pvc://models/../etc': the path inside the claim may not contain '..' or '.'; use pvc://CLAIM/PATH
    """
    if not ref.startswith(PVC_SCHEME):
        return None
    claim, _, path = ref[len(PVC_SCHEME) :].partition("/")
    if not claim or len(claim) > 253 or not _CLAIM.match(claim):
        raise ValueError(
            f"model {ref!r}: {claim!r} is not a PersistentVolumeClaim name (lowercase RFC 1123 "
            "subdomain); use pvc://CLAIM/PATH"
        )
    parts = [p for p in path.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(
            f"model {ref!r}: the path inside the claim may not contain '..' or '.'; "
            "use pvc://CLAIM/PATH"
        )
    return PvcModelRef(claim, "/".join(parts))


HF_SCHEME = "hf://"
HF_FORM = "hf://ORG/NAME[@REVISION]"
HF_DEFAULT_REVISION = "main"  # the Hub's default branch, as huggingface_hub assumes
# One part of a Hub repository id (huggingface_hub's validate_repo_id): ASCII letters, digits,
# '-', '_' and '.', at most 96, starting and ending with a letter, digit or '_'.
_HF_REPO_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")
# A branch, tag, commit hash or refs/pr/N: git ref characters, no spaces, no '@', no '..'.
_HF_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}$")


@dataclass(frozen=True)
class HfModelRef:
    """A Hugging Face Hub model repository and the revision to read."""

    repo_id: str  # ORG/NAME
    revision: str | None  # None: the default branch (main)

    @property
    def cache_folder(self) -> str:
        """The repository's folder in the Hugging Face cache (huggingface_hub's layout).

        >>> parse_hf_ref("hf://HuggingFaceTB/SmolLM2-135M-Instruct").cache_folder
        'models--HuggingFaceTB--SmolLM2-135M-Instruct'
        """
        return "models--" + self.repo_id.replace("/", "--")

    @property
    def revision_or_default(self) -> str:
        """The revision asked for, or ``main``.

        >>> parse_hf_ref("hf://org/m").revision_or_default, parse_hf_ref("hf://org/m@v1").revision
        ('main', 'v1')
        """
        return self.revision or HF_DEFAULT_REVISION


def is_hf_ref(ref: str) -> bool:
    """True for an ``hf://`` reference, well formed or not.

    >>> is_hf_ref("hf://org/m"), is_hf_ref("org/m"), is_hf_ref("s3://b/m")
    (True, False, False)
    """
    return ref.startswith(HF_SCHEME)


def parse_hf_ref(ref: str) -> HfModelRef | None:
    """The repository and revision of an ``hf://ORG/NAME[@REVISION]`` reference; None for other
    references; ``ValueError`` naming the fault for a malformed one (a spec error, not a
    runtime one).

    >>> parse_hf_ref("pvc://models/m") is None
    True
    >>> parse_hf_ref("hf://HuggingFaceTB/SmolLM2-135M-Instruct")
    HfModelRef(repo_id='HuggingFaceTB/SmolLM2-135M-Instruct', revision=None)
    >>> parse_hf_ref("hf://Qwen/Qwen3-0.6B@refs/pr/12")
    HfModelRef(repo_id='Qwen/Qwen3-0.6B', revision='refs/pr/12')
    >>> parse_hf_ref("hf://gpt2")
    Traceback (most recent call last):
    ...
    ValueError: model 'hf://gpt2': 'gpt2' is not ORG/NAME (a Hub repository id with its organisation or user); use hf://ORG/NAME[@REVISION]
    >>> parse_hf_ref("hf://org/my model")
    Traceback (most recent call last):
    ...
    ValueError: model 'hf://org/my model': 'my model' is not a Hub repository name (letters, digits, '-', '_', '.', at most 96, not starting or ending with '-' or '.'); use hf://ORG/NAME[@REVISION]
    >>> parse_hf_ref("hf://org/m@")
    Traceback (most recent call last):
    ...
    ValueError: model 'hf://org/m@': the revision after '@' is empty; use hf://ORG/NAME[@REVISION]
    >>> parse_hf_ref("hf://org/m@../main")
    Traceback (most recent call last):
    ...
    ValueError: model 'hf://org/m@../main': '../main' is not a revision (a branch, tag, commit hash or refs/pr/N: letters, digits, '-', '_', '.', '/', no '..'); use hf://ORG/NAME[@REVISION]
    """
    if not is_hf_ref(ref):
        return None
    repo_id, at, revision = ref[len(HF_SCHEME) :].partition("@")

    def fault(why: str) -> ValueError:
        return ValueError(f"model {ref!r}: {why}; use {HF_FORM}")

    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts):
        raise fault(
            f"{repo_id!r} is not ORG/NAME (a Hub repository id with its organisation or user)"
        )
    for kind, part in zip(("organisation", "repository name"), parts, strict=True):
        if not _HF_REPO_PART.match(part) or ".." in part or "--" in part:
            raise fault(
                f"{part!r} is not a Hub {kind} (letters, digits, '-', '_', '.', at most 96, "
                "not starting or ending with '-' or '.'"
                + (", no '--' or '..'" if ".." in part or "--" in part else "")
                + ")"
            )
    if repo_id.endswith(".git"):
        raise fault(f"{repo_id!r} ends in '.git'; name the repository itself")
    if not at:
        return HfModelRef(repo_id, None)
    if not revision:
        raise fault("the revision after '@' is empty")
    if (
        not _HF_REVISION.match(revision)
        or ".." in revision
        or "//" in revision
        or revision.endswith(("/", ".", ".lock"))
    ):
        raise fault(
            f"{revision!r} is not a revision (a branch, tag, commit hash or refs/pr/N: letters, "
            "digits, '-', '_', '.', '/', no '..')"
        )
    return HfModelRef(repo_id, revision)


def check_model_ref(ref: str) -> str:
    """``ref`` itself when its form is sound; ``ValueError`` for a malformed ``pvc://`` or
    ``hf://`` reference (what ``spec.model``'s validators run). Other forms (a packaged id, a
    path, ``s3://``) are only known to be wrong when a pod resolves them.

    >>> check_model_ref("hf://org/m@v2")
    'hf://org/m@v2'
    >>> check_model_ref("hf://org/")
    Traceback (most recent call last):
    ...
    ValueError: model 'hf://org/': 'org/' is not ORG/NAME (a Hub repository id with its organisation or user); use hf://ORG/NAME[@REVISION]
    """
    parse_pvc_ref(ref)
    parse_hf_ref(ref)
    return ref


class HfTokenSecret(ApiModel):
    """A Secret in the resource's namespace holding a Hugging Face token (for a private or
    gated ``hf://`` model): the operator passes it to the pods that download the model as
    ``HF_TOKEN`` (a secretKeyRef, never a literal)."""

    name: str = Field(pattern=_CLAIM.pattern, max_length=253)
    """The Secret's name."""
    key: str = Field(default="HF_TOKEN", pattern=r"^[-._a-zA-Z0-9]+$", max_length=253)
    """The key of the token inside the Secret."""


def check_hf_token_secret(model: str, secret: HfTokenSecret | None) -> None:
    """``ValueError`` when a spec names a token Secret for a model that is not ``hf://``
    (nothing would read it: a sign the model is not the one meant).

    >>> check_hf_token_secret("hf://org/private", HfTokenSecret(name="hf-token"))
    >>> check_hf_token_secret("s3://b/m", HfTokenSecret(name="hf-token"))
    Traceback (most recent call last):
    ...
    ValueError: hfTokenSecret is only read for an hf://ORG/NAME model, and model is 's3://b/m'; remove hfTokenSecret or name an hf:// model
    """
    if secret is not None and not is_hf_ref(model):
        raise ValueError(
            f"hfTokenSecret is only read for an hf://ORG/NAME model, and model is {model!r}; "
            "remove hfTokenSecret or name an hf:// model"
        )
