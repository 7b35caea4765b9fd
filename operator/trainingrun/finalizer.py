"""The TrainingRun storage finalizer, kept by the TrainingRun reconciler itself.

Only a run with ``spec.checkpoint.deleteOnRunDeletion: true`` carries :data:`FINALIZER`:
deleting its storage is the one cleanup a deletion needs (children go with the garbage
collector). The reconciler adds the finalizer before the run's gang can write anything, takes
it off again if the field is turned off, and on deletion deletes the storage and then removes
it (a failure requeues the run with backoff). The name is the one Kopf's ``on.delete`` used
before, so runs created under it are finalized the same way.

Finalizer writes are merge patches that carry the ``resourceVersion`` the decision was made
from: the apiserver refuses them (409) if the object changed meanwhile, and the retry decides
again from the newer version (a plain list patch could drop another controller's finalizer).
"""

from __future__ import annotations

from typing import Any

from ..shared.state import Body

FINALIZER = "posttrain.io/finalizer"


def deletes_storage(body: Body) -> bool:
    """Whether the run asked for its storage to go with it.

    >>> deletes_storage({"spec": {"checkpoint": {"deleteOnRunDeletion": True}}})
    True
    >>> deletes_storage({"spec": {}}), deletes_storage({})
    (False, False)
    """
    checkpoint = (body.get("spec") or {}).get("checkpoint") or {}
    return bool(checkpoint.get("deleteOnRunDeletion"))


def has_finalizer(body: Body) -> bool:
    return FINALIZER in ((body.get("metadata") or {}).get("finalizers") or [])


def finalizer_patch(body: Body, present: bool) -> dict[str, Any] | None:
    """The merge patch that adds (``present``) or removes :data:`FINALIZER`, keeping every
    other finalizer and guarded by the body's resourceVersion; None when nothing changes.

    >>> body = {"metadata": {"resourceVersion": "7", "finalizers": ["other.io/x"]}}
    >>> finalizer_patch(body, True)
    {'metadata': {'resourceVersion': '7', 'finalizers': ['other.io/x', 'posttrain.io/finalizer']}}
    >>> finalizer_patch(body, False) is None
    True
    >>> body["metadata"]["finalizers"].append(FINALIZER)
    >>> finalizer_patch(body, False)
    {'metadata': {'resourceVersion': '7', 'finalizers': ['other.io/x']}}
    """
    meta = body.get("metadata") or {}
    current: list[str] = list(meta.get("finalizers") or [])
    if (FINALIZER in current) == present:
        return None
    wanted = [*current, FINALIZER] if present else [f for f in current if f != FINALIZER]
    return {"metadata": {"resourceVersion": meta.get("resourceVersion"), "finalizers": wanted}}
