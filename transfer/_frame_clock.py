"""A served stream's frame deadline, and the watchdog entry that enforces it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._pipes import Pipe

Watch = Callable[[float, Callable[[], bool], Callable[[], None]], None]
"""``watch(timeout, is_done, on_expiry)``: the engine's watchdog."""


class FrameClock:
    """A served stream's frame deadline: checked between reads by the pipe, and enforced by
    the engine's watchdog for a peer that stops sending at all (it closes the pipe). One
    watchdog entry per stream at a time, re-armed when it comes due during a later frame,
    so a busy stream does not leave an entry per frame in the watchdog's heap."""

    def __init__(
        self, pipe: Pipe, watch: Callable[[float, Callable[[], bool], Callable[[], None]], None]
    ) -> None:
        self._pipe = pipe
        self._watch = watch
        self._deadline: float | None = None
        self._watched = False
        self._lock = threading.Lock()

    def start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._pipe.set_deadline(deadline)
        with self._lock:
            self._deadline = deadline
            arm = not self._watched
            self._watched = True
        if arm:
            self._watch(timeout, self._idle, self._due)

    def end(self) -> None:
        self._pipe.set_deadline(None)
        with self._lock:
            self._deadline = None

    def _idle(self) -> bool:
        with self._lock:
            if self._deadline is None:
                self._watched = False  # the watchdog drops the entry
                return True
            return False

    def _due(self) -> None:
        with self._lock:
            deadline = self._deadline
            left = None if deadline is None else deadline - time.monotonic()
            rearm = left is not None and left > 0  # a later frame's deadline
            self._watched = rearm
        if rearm:
            assert left is not None
            self._watch(left, self._idle, self._due)
        elif left is not None:
            self._pipe.close()  # the frame is overdue: the stream ends, its holds with it
