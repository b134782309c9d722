"""A served stream's deadlines, and the watchdog entry that enforces them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._pipes import Pipe

Watch = Callable[[float, Callable[[], bool], Callable[[], None]], None]
"""``watch_until(due, is_done, on_expiry)``: the engine's watchdog, ``due`` a ``clock()``
time."""


class FrameClock:
    """A served stream's deadline: a frame's, from its header to its end (checked between
    reads by the pipe), and between frames the keepalive's (``silence``: how long the peer
    may send nothing at all; ``None``: for ever). The engine's watchdog enforces both for a
    peer that stops sending altogether: it closes the pipe. A watchdog entry is added only
    when a deadline comes before every entry already armed, and an entry that comes due
    re-arms for the deadline of the moment: a busy stream keeps one or two entries in the
    watchdog's heap, not one per frame.

    Deadlines are ``clock()`` times, the watchdog's clock (a test's fake one advances
    them). The pipe's own check between reads stays on ``time.monotonic``: a socket waits
    in real seconds; with the real clock the two agree."""

    def __init__(
        self,
        pipe: Pipe,
        watch: Watch,
        silence: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._pipe = pipe
        self._watch = watch
        self._silence = silence
        self._deadline: float | None = None
        self._armed: float | None = None  # when the earliest live watchdog entry is due
        self._stopped = False
        self._lock = threading.Lock()

    def start(self, timeout: float) -> None:
        """A frame began: all of it must arrive within ``timeout``."""
        self._pipe.set_deadline(time.monotonic() + timeout)
        self._set(self._clock() + timeout)

    def end(self) -> None:
        """The frame is done: the peer may now be silent for the keepalive's limit."""
        self._pipe.set_deadline(None)
        silence = self._silence
        self._set(None if silence is None else self._clock() + silence)

    def stop(self) -> None:
        """The stream is over: the watchdog drops its entries."""
        with self._lock:
            self._deadline = None
            self._stopped = True

    def _set(self, deadline: float | None) -> None:
        with self._lock:
            self._deadline = deadline
            arm = deadline is not None and (self._armed is None or deadline < self._armed)
            if arm:
                self._armed = deadline
        if arm:
            assert deadline is not None
            self._arm(deadline)

    def _arm(self, due: float) -> None:
        self._watch(due, self._is_stopped, lambda: self._due(due))

    def _is_stopped(self) -> bool:
        with self._lock:
            return self._stopped

    def _due(self, due: float) -> None:
        """An entry armed for ``due`` came due: close an overdue stream, or re-arm for the
        deadline of the moment unless an earlier entry already covers it."""
        with self._lock:
            if self._armed == due:
                self._armed = None
            deadline = self._deadline
            overdue = deadline is not None and deadline <= self._clock()
            rearm = not overdue and deadline is not None and self._armed is None
            if rearm:
                self._armed = deadline
        if overdue:
            self._pipe.close()  # the stream ends, its holds with it
        elif rearm:
            assert deadline is not None
            self._arm(deadline)
