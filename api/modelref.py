"""``pvc://CLAIM/PATH`` model references: a model on a PersistentVolumeClaim.

A platform team keeps base models on a shared volume (KServe's ``storageUri`` takes the same
``pvc://{claim}/{path}`` form), not in object storage. The operator mounts the claim
read-only at :data:`PVC_MOUNT_ROOT`/CLAIM in every pod that loads ``spec.model`` (trainer,
evaluator, rollout replicas and their ``fetch-model`` step), and
:func:`posttrain.models.resolve_model` maps the reference to that directory. One module so
the three sides (API validation, the operator's volumes, the model resolver) agree on the
form and on the path.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

PVC_SCHEME = "pvc://"
PVC_MOUNT_ROOT = "/mnt/pvc"
PVC_MODEL_VOLUME = "model-pvc"
# A PersistentVolumeClaim name is an RFC 1123 subdomain.
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
