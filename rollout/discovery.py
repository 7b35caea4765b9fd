"""Which replicas of a RolloutPool are ready, read from the pool's status.

A Service URL hides the replicas behind one ClusterIP: a weight publish through it reaches
one replica, and sampling cannot tell replicas apart. The operator therefore lists the
ready replicas' own URLs in ``RolloutPool.status.replicaEndpoints`` (from the pods it
watches, pod IP + port), and the trainer reads that list -- with a Role allowing ``get``
on that one pool -- before each publish and every few seconds while sampling.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain.api import GROUP, VERSION
from posttrain.api.env import TrainerEnv
from posttrain.kubeapi import custom_objects_api

log = logging.getLogger(__name__)


class PoolDiscovery:
    """Reads one RolloutPool's ready replica URLs through the Kubernetes API."""

    def __init__(self, name: str, namespace: str, api: Any | None = None) -> None:
        self.name = name
        self.namespace = namespace
        if api is None:
            api = custom_objects_api()
        self.api = api

    @classmethod
    def for_trainer(cls, contract: TrainerEnv) -> PoolDiscovery | None:
        """The pool the operator resolved for this trainer pod (None: it named none)."""
        name, namespace = contract.rollout_pool, contract.run_namespace
        return cls(name, namespace) if name and namespace else None

    def status(self) -> dict[str, Any]:
        body = self.api.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "rolloutpools", self.name
        )
        return body.get("status") or {}

    def ready_endpoints(self) -> list[str]:
        """URLs of the pool's ready replicas (empty while none is ready)."""
        return list(self.status().get("replicaEndpoints") or [])

    def wait_ready(
        self,
        timeout_s: float,
        poll_s: float = 2.0,
        report: Callable[[dict[str, Any]], None] | None = None,
    ) -> list[str]:
        """Block until at least one replica is ready, logging why not; TimeoutError after.

        The pool's Ready condition carries the reason (a model that cannot be fetched, a
        crash-looping replica), so the wait says what the trainer is waiting on.
        ``report`` gets the TrainingRun's ``status.rollout`` (wire form) when the wait
        starts, when its reason changes and when replicas are found: the operator shows it
        as the run's RolloutAvailable condition.
        """
        started = time.monotonic()
        next_log = started
        reported: str | None = None
        while True:
            status = self.status()
            urls = list(status.get("replicaEndpoints") or [])
            if urls:
                if report is not None:
                    # message: None deletes the waiting message (status is merge-patched), or
                    # a run that found its replicas would keep saying it waits for them.
                    report({"pool": self.name, "available": True, "readyReplicas": len(urls),
                            "message": None})  # fmt: skip
                return urls
            conditions: list[dict[str, Any]] = status.get("conditions") or []
            ready = next((c for c in conditions if c.get("type") == "Ready"), {})
            why = f"{ready.get('reason', 'no status yet')}: {ready.get('message', '')}"
            elapsed = time.monotonic() - started
            if elapsed >= timeout_s:
                raise TimeoutError(
                    f"RolloutPool {self.namespace}/{self.name} has no ready replica after "
                    f"{timeout_s:.0f}s ({why})"
                )
            if report is not None and why != reported:
                reported = why
                report({"pool": self.name, "available": False, "readyReplicas": 0,
                        "message": f"{why}; the trainer waits up to {timeout_s:.0f}s "
                                   "(spec.rollout.timeoutSeconds), then fails"})  # fmt: skip
            if time.monotonic() >= next_log:
                log.info("waiting for a ready replica of RolloutPool %s/%s (%.0fs of %.0fs; %s)",
                         self.namespace, self.name, elapsed, timeout_s, why)  # fmt: skip
                next_log = time.monotonic() + 15
            time.sleep(poll_s)


def follow_pool(
    client: Any, discover: Callable[[], list[str]], interval_s: float = 5.0
) -> threading.Event:
    """Keep ``client``'s endpoints equal to the pool's ready replicas; set the event to stop.

    A replica that joined is first brought to the version the trainer last published
    (:meth:`RolloutClient.catch_up`), so it never serves a sample older than its peers.
    An empty answer (every replica restarting) keeps the last known set: the client's
    retries and cool-downs handle dead endpoints better than having none.
    """
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            try:
                urls = discover()
                if urls and sorted(urls) != sorted(client.urls):
                    client.catch_up(urls)
            except Exception as exc:  # the API being briefly unreachable must not kill a run
                log.warning("refreshing rollout endpoints failed: %s", exc)

    threading.Thread(target=run, name="rollout-discovery", daemon=True).start()
    return stop
