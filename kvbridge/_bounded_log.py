"""Refusals counted, and logged at a bounded rate.

A server refuses what strangers send it (a wrong secret, a malformed greeting, one
connection too many). Logging every refusal lets anyone who can reach a port write to the
server's log as fast as they can connect, and where nobody drains the log (a full stderr
pipe) the thread that logs blocks. So each kind of refusal is counted always and logged at
most once per :data:`INTERVAL_S`: the first at once, then one line per interval saying how
many more there were.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

INTERVAL_S = 10.0
"""At most one line per kind of refusal in this time (an operator sees a flood at once, and
then how big it is, without one line per connection)."""


class BoundedLog:
    """Counts refusals by kind and logs each kind at most once per ``interval_s``."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()

    def refused(self, kind: str, level: int, message: str, *args: object) -> None:
        """Count one refusal of ``kind``; log ``message % args`` if this kind's interval
        allows a line, with how many were held back since the last one."""
        with self._lock:
            self._counts[kind] += 1
            now = self._clock()
            if now < self._next.get(kind, -float("inf")):
                self._held[kind] += 1
                return
            held = self._held.pop(kind, 0)
            self._next[kind] = now + self._interval
        if held:
            message += f" (and {held} more like it since the last such line)"
        self._logger.log(level, message, *args)

    def counts(self) -> dict[str, int]:
        """Refusals so far, by kind."""
        with self._lock:
            return dict(self._counts)
