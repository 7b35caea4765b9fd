"""Whether the apiserver serves an optional resource (KubeRay's RayClusters, Kueue's
Workloads), through API discovery, and who is told when that answer changes.

Discovery is readable by every authenticated user (no CRD permission needed). The answer is
cached for a period; when it flips, :meth:`Discovery.watch`'s callback is told, which is how
the runtime starts that kind's informers when the CRD appears (also after the operator
started) and stops them when it goes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..kube import KubeClient, KubeError

log = logging.getLogger(__name__)


class Discovery:
    """API discovery of ``plural`` in ``api_version``, at most once per ``period`` seconds
    (and never when ``enabled`` is False: the resource is then taken as absent)."""

    def __init__(
        self,
        kube: KubeClient,
        api_version: str,
        plural: str,
        enabled: bool,
        period: float,
        describe: Callable[[bool], str],
    ) -> None:
        self.kube = kube
        self.api_version, self.plural = api_version, plural
        self.enabled, self.period = enabled, period
        self.describe = describe  # the log line for a new answer
        self._lock = threading.Lock()
        self._installed = False
        self._checked_at = float("-inf")
        self._on_change: Callable[[bool], None] = lambda installed: None

    def installed(self, fresh: bool = False) -> bool:
        """Whether the resource is served: the cached answer while younger than the period,
        else (or with ``fresh``) asked now. A failed discovery keeps the last answer."""
        if not self.enabled:
            return False
        with self._lock:
            if not fresh and time.monotonic() - self._checked_at < self.period:
                return self._installed
        try:
            installed = self.kube.serves(self.api_version, self.plural)
        except KubeError as exc:
            log.warning(
                "API discovery of %s failed (%s); keeping the last answer", self.api_version, exc
            )
            installed = self._installed
        with self._lock:
            changed = installed != self._installed
            self._installed, self._checked_at = installed, time.monotonic()
            if changed:  # under the lock: the callbacks come in the order of the answers
                self._on_change(installed)
        if changed:
            log.info("%s", self.describe(installed))
        return installed

    def forget(self) -> None:
        """Ask discovery again at the next use (e.g. the CRD was removed under us)."""
        with self._lock:
            self._checked_at = float("-inf")

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Tell ``on_change(installed)`` each time the answer flips (from any thread; it must
        not block), starting with the answer now if that is "installed"."""
        with self._lock:
            self._on_change = on_change
            if self._installed:
                on_change(True)
