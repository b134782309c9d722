"""One thread per engine that fails batches still running at their deadline."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

_FAKE_CLOCK_POLL_S = 0.01
"""With a clock other than ``time.monotonic`` (a test's, advanced by hand) the watchdog
cannot know when it moves: it reads it this often."""


class Watchdog:
    """Calls ``on_expiry`` at each deadline unless ``is_done()`` says it is moot. Deadlines
    are ``clock()`` times (``time.monotonic`` unless a test passes a fake clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._longest_wait = None if clock is time.monotonic else _FAKE_CLOCK_POLL_S
        self._heap: list[tuple[float, int, Callable[[], bool], Callable[[], None]]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvbridge-watchdog", daemon=True)
        self._thread.start()

    def watch(
        self, timeout: float, is_done: Callable[[], bool], on_expiry: Callable[[], None]
    ) -> None:
        """Call ``on_expiry`` ``timeout`` seconds from now on the watchdog's clock."""
        self.watch_until(self._clock() + timeout, is_done, on_expiry)

    def watch_until(
        self, due: float, is_done: Callable[[], bool], on_expiry: Callable[[], None]
    ) -> None:
        """Call ``on_expiry`` at ``due``, a ``clock()`` time. A caller that already holds a
        deadline passes it as it is: turning it into a timeout and back reads the clock
        twice, and a clock that moves in between (a test's, advanced by hand) would
        shift the entry past the deadline it stands for."""
        with self._cond:
            entry = (due, next(self._order), is_done, on_expiry)
            heapq.heappush(self._heap, entry)
            if self._heap[0] is entry:
                self._cond.notify()

    def armed(self) -> int:
        """Deadlines waiting (a moot one counts until its time comes)."""
        with self._cond:
            return len(self._heap)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    # Drop entries that finished: a busy engine must not pile them up.
                    while self._heap and self._heap[0][2]():
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - self._clock()
                    if wait <= 0:
                        break
                    if self._longest_wait is not None:
                        wait = min(wait, self._longest_wait)
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, is_done, on_expiry = heapq.heappop(self._heap)
            if not is_done():
                on_expiry()
