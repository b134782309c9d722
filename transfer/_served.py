"""The data streams an engine serves: a thread each, caps on how many, and who is not yet
past its greeting.

Every stream a peer opens is served on a thread owned here and joined by :meth:`close`.
Past :data:`MAX_SERVED_STREAMS`, or when no thread can be started, a new stream is closed
(and logged) and the listener goes on accepting. Streams not yet past their greeting are
capped apart (:data:`MAX_UNGREETED_STREAMS`): a newcomer pushes out the oldest of them.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from ._pipes import Pipe
from ._regions import RegionTable
from ._streams import ServeHooks, serve

MAX_SERVED_STREAMS = 1024
"""Data streams served at once (a thread each); more are closed as they arrive, so a flood
of connections cannot exhaust threads. Sessions cap their own streams too (``_sessions``)."""

MAX_UNGREETED_STREAMS = 64
"""Streams not yet past their greeting at once. A newcomer pushes out the oldest: an honest
peer greets within a round trip of connecting, so connections that sit silent (a flood by
someone without the secret) can neither fill the served streams nor keep peers out."""

_log = logging.getLogger("kvbridge.transfer")


class ServedStreams:
    """The streams one engine serves, and the threads serving them."""

    def __init__(
        self, name: str, regions: RegionTable, hooks: Callable[[Callable[[Pipe], None]], ServeHooks]
    ) -> None:
        self._name = name
        self._regions = regions
        self._hooks = hooks(self._greeted)
        self._served: dict[Pipe, threading.Thread] = {}
        self._ungreeted: OrderedDict[Pipe, None] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._served)

    def accept(self, pipe: Pipe) -> None:
        """A peer opened a data stream: serve it, or close it past the caps."""
        thread = threading.Thread(target=self._serve, args=(pipe,), daemon=True)
        pushed_out: Pipe | None = None
        with self._lock:
            refused = self._closed or len(self._served) >= MAX_SERVED_STREAMS
            if not refused:
                self._served[pipe] = thread
                thread.name = f"kvbridge-serve-{len(self._served)}"
                self._ungreeted[pipe] = None
                if len(self._ungreeted) > MAX_UNGREETED_STREAMS:
                    pushed_out = self._ungreeted.popitem(last=False)[0]
        if pushed_out is not None:
            pushed_out.close()  # its serve thread wakes with an error and ends
        if refused:
            if not self._closed:
                self._hooks.refusals.refused(
                    "streams_full",
                    logging.WARNING,
                    "%s: %d streams served: one refused",
                    self._name,
                    MAX_SERVED_STREAMS,
                )
            pipe.close()
            return
        try:
            thread.start()
        except RuntimeError as exc:  # can't start new thread: process or memory limits
            _log.error("%s: cannot serve a stream: %s", self._name, exc)
            self._forget(pipe)
            pipe.close()

    def close(self) -> None:
        """Close every served stream and join its thread."""
        with self._lock:
            self._closed = True
            served = list(self._served.items())
        for pipe, thread in served:
            pipe.close()
            if thread.ident is not None:  # a thread that failed to start has nothing to join
                thread.join()

    def _serve(self, pipe: Pipe) -> None:
        try:
            serve(pipe, self._regions, self._hooks)
        finally:
            self._forget(pipe)

    def _greeted(self, pipe: Pipe) -> None:
        with self._lock:
            self._ungreeted.pop(pipe, None)

    def _forget(self, pipe: Pipe) -> None:
        with self._lock:
            self._served.pop(pipe, None)
            self._ungreeted.pop(pipe, None)
