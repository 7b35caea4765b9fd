"""Who may change a replica's weights: the holder of the pool's weight token, and only to a
version under the pool's own registry.

The operator issues one random token per RolloutPool (the Secret ``<pool>-weights-token``,
owned by the pool) and hands it to the pool's replicas and to the trainers of the runs that
sample from that pool, as ``$POSTTRAIN_WEIGHTS_TOKEN``. ``POST /v1/weights/load`` then needs
``Authorization: Bearer <token>``, compared in constant time; anything that merely reaches the
pool's port (another run's trainer, a sandbox, a curious pod) can sample but not swap weights.
A server started without a token (``posttrain run --local``, a laptop) keeps the endpoint open:
it listens where only its own trainer is.

With a registry prefix (``--weights-uri``), a load must also name a version under it, or the
trainer's shared-memory directory (``file:///dev/shm/posttrain-weights-*``, same host only), so
a leaked token still cannot load another run's weights or an arbitrary path.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from posttrain.api.env import WEIGHTS_TOKEN

SHARED_MEMORY_PREFIX = "file:///dev/shm/posttrain-weights-"
"""Where the trainer's shared-memory publisher writes (trainer/model/weight_sync.py)."""


class WeightLoadDenied(Exception):
    """A weight load refused before anything is fetched; ``status`` is 401 or 403."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def weights_token() -> str | None:
    """This process's weight token (replica or trainer), None when none was issued."""
    return os.environ.get(WEIGHTS_TOKEN) or None


def auth_headers(token: str | None = None) -> dict[str, str]:
    """What a caller of ``/v1/weights/load`` sends: the bearer token, when it has one."""
    token = token if token is not None else weights_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_weight_load(
    headers: Mapping[str, str], uri: str, token: str | None, registry: str | None
) -> None:
    """Raise :class:`WeightLoadDenied` unless the caller holds ``token`` and ``uri`` lies under
    ``registry`` (each check only where the server was given one).

    >>> check_weight_load({"authorization": "Bearer t"}, "s3://b/runs/a/weights", "t",
    ...                   "s3://b/runs/a/weights")
    >>> check_weight_load({}, "s3://b/x", "t", None)
    Traceback (most recent call last):
    ...
    posttrain.rollout.auth.WeightLoadDenied: /v1/weights/load needs the pool's weight token (Authorization: Bearer ...; the operator gives it to the trainers of runs that use this pool)
    >>> check_weight_load({"authorization": "Bearer t"}, "s3://b/runs/other/weights", "t",
    ...                   "s3://b/runs/a/weights")
    Traceback (most recent call last):
    ...
    posttrain.rollout.auth.WeightLoadDenied: uri s3://b/runs/other/weights is not under this pool's registry s3://b/runs/a/weights
    """
    if token is not None:
        given = headers.get("authorization") or headers.get("Authorization") or ""
        if not given:
            raise WeightLoadDenied(
                401,
                "/v1/weights/load needs the pool's weight token (Authorization: Bearer ...; "
                "the operator gives it to the trainers of runs that use this pool)",
            )
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise WeightLoadDenied(403, "the weight token does not match this pool's")
    if registry is not None and not _under(uri, registry) and not _under_shared_memory(uri):
        raise WeightLoadDenied(403, f"uri {uri} is not under this pool's registry {registry}")


def _under(uri: str, prefix: str) -> bool:
    """
    >>> _under("s3://b/runs/a/weights/", "s3://b/runs/a/weights"), _under("s3://b/runs/ab", "s3://b/runs/a")
    (True, False)
    """
    uri, prefix = uri.rstrip("/"), prefix.rstrip("/")
    return uri == prefix or uri.startswith(prefix + "/")


def _under_shared_memory(uri: str) -> bool:
    """
    >>> _under_shared_memory("file:///dev/shm/posttrain-weights-x1"), _under_shared_memory("file:///dev/shm/posttrain-weights-x/../../etc")
    (True, False)
    """
    rest = uri.removeprefix(SHARED_MEMORY_PREFIX)
    return rest != uri and "/" not in rest.strip("/") and ".." not in rest
