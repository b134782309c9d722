"""Snapshots of a namespace's keys, read in pages by a subscriber that resynchronises its
view of the namespace (the ``keys`` op; ``docs/EVENTS.md``).

A snapshot is the key set at one moment, with the stream's sequence number then: every
change numbered up to it is in the set, and a subscriber that applies the messages
numbered after it (some of which the set may already show: applying them again changes
nothing) holds the namespace's keys. The first page takes the snapshot; the others read
it by its id, which is good only for the session that took it. Few are kept, briefly:
a session holds one at a time, and the oldest goes when the table is full (its next
page is then refused and the subscriber starts over).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .._keys import BlockKey
from .._wire import BadRequest, TooManyRequests

MAX_SNAPSHOTS = 16
SNAPSHOT_TTL_S = 60.0
SNAPSHOT_EVERY_S = 0.5


@dataclass(frozen=True)
class Snapshot:
    session: int
    handle: int
    seq: int
    keys: list[BlockKey]
    until: float


class Snapshots:
    """The snapshots being read, of every namespace (one short lock of its own: requests
    of different namespaces call it side by side)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._taken: OrderedDict[int, Snapshot] = OrderedDict()
        self._last: dict[int, float] = {}
        """When each session took its last snapshot (dropped with the session)."""

    def check_room(self, session: int) -> None:
        """:class:`TooManyRequests` when ``session`` took a snapshot less than
        :data:`SNAPSHOT_EVERY_S` ago (a snapshot copies every key under its namespace's lock;
        a subscriber resyncs at most once a second)."""
        with self._lock:
            last = self._last.get(session)
            if last is not None and self._clock() - last < SNAPSHOT_EVERY_S:
                raise TooManyRequests(
                    f"a session takes a snapshot at most every {SNAPSHOT_EVERY_S} s"
                )

    def take(self, session: int, handle: int, seq: int, keys: list[BlockKey]) -> int:
        """Keep ``keys`` for ``session`` (its previous snapshot goes); the new id."""
        with self._lock:
            now = self._clock()
            self._last[session] = now
            for sid, snap in list(self._taken.items()):
                if snap.session == session or snap.until < now:
                    del self._taken[sid]
            while len(self._taken) >= MAX_SNAPSHOTS:
                self._taken.popitem(last=False)
            sid = next(self._ids)
            self._taken[sid] = Snapshot(session, handle, seq, keys, now + SNAPSHOT_TTL_S)
            return sid

    def page(self, session: int, handle: int, sid: int) -> Snapshot:
        """The snapshot ``sid`` of ``session``'s namespace ``handle``, or BadRequest."""
        with self._lock:
            snap = self._taken.get(sid)
            if snap is None or snap.session != session or snap.handle != handle:
                raise BadRequest(
                    f"snapshot {sid} is not this session's (or it expired): start over"
                )
            return snap

    def drop(self, session: int) -> None:
        with self._lock:
            self._last.pop(session, None)
            for sid in [sid for sid, snap in self._taken.items() if snap.session == session]:
                del self._taken[sid]
