"""Progress lines for long waits: done/total, rate and ETA, or elapsed time when no total
is known.

A person looking at a silent terminal for minutes cannot tell a slow job from a hung one.
Every wait longer than a few seconds (evaluation, model conversion, uploads) logs through
these two helpers, at most one line per ``interval_s``, so the lines read the same
everywhere and a log never floods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """A short human duration.

    >>> format_duration(4.2), format_duration(250), format_duration(7322)
    ('4s', '4m 10s', '2h 02m')
    """
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    return f"{whole // 3600}h {whole % 3600 // 60:02d}m"


class ItemProgress:
    """Counts finished items and logs ``label: done/total (pct), rate, ETA``.

    Thread-safe; the first line comes after ``interval_s`` (a job that finishes sooner
    needs none) and the last one from :meth:`finish`.

    >>> lines = []
    >>> p = ItemProgress("eval", 4, interval_s=0.0, emit=lines.append, clock=iter([0, 2, 4]).__next__)
    >>> p.advance(2); p.finish()
    >>> lines
    ['eval: 2/4 items (50%), 1.00 items/s, ETA 2s', 'eval: 2/4 items (50%) in 4s']
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "items",
        interval_s: float = 10.0,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.done = 0
        self._interval_s = interval_s
        self._emit = emit or log.info
        self._clock = clock
        self._start = clock()
        self._last = self._start
        self._lock = threading.Lock()

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.done += count
            now = self._clock()
            if now - self._last < self._interval_s or self.done >= self.total:
                return  # too soon, or done: finish() says so
            self._last = now
            done = self.done
        self._emit(self.line(done, now - self._start))

    def line(self, done: int, elapsed: float) -> str:
        """``eval: 64/164 items (39%), 0.21 items/s, ETA 7m 56s``."""
        rate = done / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {done}/{self.total} {self.unit} ({100 * done / max(self.total, 1):.0f}%)"
        if rate > 0:
            eta = (self.total - done) / rate
            text += f", {rate:.2f} {self.unit}/s, ETA {format_duration(eta)}"
        return text

    def finish(self) -> None:
        elapsed = self._clock() - self._start
        done_pct = 100 * self.done / max(self.total, 1)
        self._emit(
            f"{self.label}: {self.done}/{self.total} {self.unit} ({done_pct:.0f}%) "
            f"in {format_duration(elapsed)}"
        )


@contextmanager
def still_working(
    label: str,
    interval_s: float = 15.0,
    emit: Callable[[str], None] | None = None,
    detail: Callable[[], str] | None = None,
) -> Iterator[None]:
    """Log ``label: still working (30s)`` every ``interval_s`` while the block runs.

    For waits that report no progress of their own (a library call that dequantises a
    model): the person sees the job is alive and how long it has taken so far. ``detail``
    adds what can be measured from outside the call (``1.2 GB on disk``) to each line; it
    runs on the heartbeat's thread, and a failing one is left out of the line.

    >>> import time
    >>> lines = []
    >>> with still_working("download", interval_s=0.05, emit=lines.append, detail=lambda: "3 MB"):
    ...     time.sleep(0.2)
    >>> lines[0]
    'download: still working (0s), 3 MB'
    """
    say = emit or log.info
    started = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(interval_s):
            line = f"{label}: still working ({format_duration(time.monotonic() - started)})"
            if detail is not None:
                try:
                    line += f", {detail()}"
                except Exception:  # a measurement, never worth a heartbeat
                    log.debug("still_working detail failed", exc_info=True)
            say(line)

    thread = threading.Thread(target=beat, name="still-working", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1)
