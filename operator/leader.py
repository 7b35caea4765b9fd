"""Leader election on a ``coordination.k8s.io/v1`` Lease, by client-go's rules: which of the
operator's replicas works (docs/operator.md, "Leader election"). ``runtime.run_async`` gates
the informers, the requeue and the resync with a :class:`LeaseGate` unless ``--standalone``.

client-go's ``leaderelection`` in short, which :class:`LeaseGate` follows:

- every ``retry_period`` a candidate reads the Lease; it takes it when it does not exist, has
  no holder, or its record has not changed for ``lease_duration`` *as observed locally*
  (client-go never compares the holder's ``renewTime`` with its own clock: clocks differ);
- the holder renews ``renewTime`` every ``retry_period``; one that has not renewed within
  ``renew_deadline`` stops leading (``renew_deadline < lease_duration``, so it stops before
  anyone else may take over);
- every write is an update carrying the ``resourceVersion`` it read (a lost race is a 409,
  tried again next period); ``leaseTransitions`` counts changes of holder;
- on a clean stop the holder releases the Lease (``holderIdentity`` emptied,
  ``leaseDurationSeconds: 1``), so a successor need not wait out the duration.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from .informer import GATE_POLL_S, Gate
from .kube import AsyncKube, KubeError, resource_path

log = logging.getLogger(__name__)

LEASE_API_VERSION = "coordination.k8s.io/v1"


def micro_time(moment: datetime) -> str:
    """A ``metav1.MicroTime`` as the apiserver writes it.

    >>> micro_time(datetime(2026, 12, 6, 10, 0, 1, 5, tzinfo=UTC))
    '2026-12-06T10:00:01.000005Z'
    """
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_spec(identity: str, duration_s: int, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The spec ``identity`` writes to hold the Lease now: a renewal keeps ``acquireTime`` and
    the transition count; a takeover (``previous`` held by another, or none) starts them anew.

    >>> now = datetime(2026, 12, 6, 10, 0, 0, tzinfo=UTC)
    >>> old = {"holderIdentity": "a", "acquireTime": "t0", "leaseTransitions": 2}
    >>> spec = lease_spec("b", 15, old)
    >>> spec["holderIdentity"], spec["leaseTransitions"], spec["acquireTime"] != "t0"
    ('b', 3, True)
    >>> lease_spec("a", 15, old)["acquireTime"], lease_spec("a", 15, old)["leaseTransitions"]
    ('t0', 2)
    """
    now = micro_time(datetime.now(UTC))
    previous = previous or {}
    renewal = previous.get("holderIdentity") == identity
    transitions = int(previous.get("leaseTransitions") or 0)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": duration_s,
        "acquireTime": previous.get("acquireTime") if renewal else now,
        "renewTime": now,
        "leaseTransitions": transitions if renewal or not previous else transitions + 1,
    }


class LeaseGate(Gate):
    """Open while this replica holds the Lease ``namespace/name`` (see the module docstring).
    :meth:`run` campaigns until cancelled, then releases what it holds."""

    def __init__(
        self,
        kube: AsyncKube,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
    ) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "leader election needs retry period < renew deadline < lease duration, got "
                f"{retry_period_s} / {renew_deadline_s} / {lease_duration_s} s"
            )
        self.kube = kube
        self.path = resource_path(LEASE_API_VERSION, "leases", namespace, name)
        self.identity = identity
        self.lease_duration_s, self.renew_deadline_s = lease_duration_s, renew_deadline_s
        self.retry_period_s = retry_period_s
        self._renewed_at = float("-inf")  # monotonic time of our last successful write
        self._observed: tuple[str, float] | None = None  # (resourceVersion, seen at)

    def is_open(self) -> bool:
        return time.monotonic() - self._renewed_at < self.renew_deadline_s

    async def wait_paused(self) -> None:
        while self.is_open():
            await asyncio.sleep(GATE_POLL_S)

    async def run(self) -> None:
        """Try to acquire or renew every retry period until cancelled; then release."""
        try:
            while True:
                try:
                    await self.try_acquire_or_renew()
                except KubeError as exc:  # a lost race (409) or an unreachable apiserver
                    log.info("lease %s: %s; trying again", self.path, exc)
                await asyncio.sleep(self.retry_period_s)
        finally:
            await asyncio.shield(self.release())

    async def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards."""
        status, lease = await self.kube.request("GET", self.path, ok=(200, 404))
        if status == 404:
            namespace, name = self.path.split("/")[-3], self.path.split("/")[-1]
            body = {
                "apiVersion": LEASE_API_VERSION,
                "kind": "Lease",
                "metadata": {"namespace": namespace, "name": name},
                "spec": lease_spec(self.identity, round(self.lease_duration_s), None),
            }
            await self.kube.request("POST", self.path.rsplit("/", 1)[0], body)
            log.info("lease %s: acquired by %s (created)", self.path, self.identity)
            return self._won()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        rv = lease["metadata"]["resourceVersion"]
        now = time.monotonic()
        if self._observed is None or self._observed[0] != rv:
            self._observed = (rv, now)  # the record changed: its lease starts now, for us
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and now - self._observed[1] < duration:
            return False  # another live holder
        lease["spec"] = lease_spec(self.identity, round(self.lease_duration_s), spec)
        await self.kube.request("PUT", self.path, lease)
        if holder != self.identity:
            log.info("lease %s: acquired by %s (was %r)", self.path, self.identity, holder)
        return self._won()

    def _won(self) -> bool:
        self._renewed_at = time.monotonic()
        return True

    async def release(self) -> None:
        """Give the Lease up if this replica holds it (a clean stop), so a successor need not
        wait out the lease duration."""
        if not self.is_open():
            return
        self._renewed_at = float("-inf")
        try:
            status, lease = await self.kube.request("GET", self.path, ok=(200, 404))
            spec = lease.get("spec") or {}
            if status == 404 or spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**spec, "holderIdentity": "", "leaseDurationSeconds": 1}
            await self.kube.request("PUT", self.path, lease)
            log.info("lease %s: released by %s", self.path, self.identity)
        except KubeError as exc:
            log.warning("lease %s: release failed (%s); it expires instead", self.path, exc)
