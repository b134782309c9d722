"""The queue under every built-in eviction policy: keys ordered by a stamp, oldest first,
where a held key leaves the walk but keeps its place.

A policy stamps a key from its own counter when the key arrives (and, for LRU, when it is
used); the queue keeps keys in stamp order. ``hold`` takes a key out of :meth:`walk`, so
that making room never steps over a pinned block; ``release`` puts it back where its stamp
says, as if it had never left. Everything is O(1) except a release into the middle of the
queue, which is a binary search and a move in a list of the keys released there.
"""

from __future__ import annotations

import bisect
import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from .._keys import BlockKey

Stamped = tuple[BlockKey, int]
"""A key and its stamp."""


class StampOrder:
    """Keys in stamp order (stamps increase with every call that gives one)."""

    def __init__(self) -> None:
        self._live: OrderedDict[BlockKey, int] = OrderedDict()
        """Keys in the walk, stamps ascending (a new stamp goes to the end)."""
        self._back: list[tuple[int, BlockKey]] = []
        """Keys released behind the newest live one, sorted; an entry is stale unless
        ``_back_at`` has the same stamp for its key."""
        self._back_at: dict[BlockKey, int] = {}
        self._held: dict[BlockKey, int] = {}

    def __len__(self) -> int:
        return len(self._live) + len(self._back_at) + len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._live or key in self._back_at or key in self._held

    def add(self, key: BlockKey, stamp: int) -> None:
        """:meth:`stamp` for a key known to be absent (a policy's ``insert``)."""
        self._live[key] = stamp

    def add_many(self, stamped: Iterable[Stamped]) -> None:
        """:meth:`add` for keys known to be absent, stamps ascending."""
        self._live.update(stamped)

    def stamp(self, key: BlockKey, stamp: int) -> None:
        """Give ``key`` (new or present) a stamp newer than any before: it goes to the
        newest end, or stays held with its new stamp."""
        if not self.restamp(key, stamp):
            self._live[key] = stamp

    def restamp(self, key: BlockKey, stamp: int) -> bool:
        """:meth:`stamp` for a key that may be absent: False (and nothing done) if it is."""
        live = self._live
        if key in live:  # the common case first: a use of a key in the walk
            live[key] = stamp
            live.move_to_end(key)
        elif key in self._held:
            self._held[key] = stamp
        elif self._back_at.pop(key, None) is not None:
            live[key] = stamp
            self._compact()
        else:
            return False
        return True

    def is_held(self, key: BlockKey) -> bool:
        return key in self._held

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` (present)."""
        if not self.discard(key):
            raise KeyError(key)

    def discard(self, key: BlockKey) -> bool:
        """Forget ``key`` if present; whether it was."""
        if self._live.pop(key, None) is not None:
            return True
        if self._back_at.pop(key, None) is not None:
            self._compact()
            return True
        return self._held.pop(key, None) is not None

    def hold(self, key: BlockKey) -> None:
        """Take ``key`` (present) out of the walk until :meth:`release`."""
        if key in self._held:
            return
        stamp = self._live.pop(key, None)
        if stamp is None:
            stamp = self._back_at.pop(key)
        self._held[key] = stamp
        self._compact()

    def release(self, key: BlockKey) -> None:
        """Put a held ``key`` back in the walk at its stamp's place."""
        stamp = self._held.pop(key, None)
        if stamp is None:
            return
        if not self._live or stamp > next(reversed(self._live.values())):
            self._live[key] = stamp
        else:  # its old entry may still be there (stale since the hold): then reuse it
            entry = (stamp, key)
            at = bisect.bisect_left(self._back, entry)
            if at == len(self._back) or self._back[at] != entry:
                self._back.insert(at, entry)
            self._back_at[key] = stamp

    def keys(self) -> Iterator[BlockKey]:
        """Keys not held, oldest first."""
        if not self._back_at:
            return iter(self._live)
        return (key for key, _ in self.walk())

    def walk(self) -> Iterator[Stamped]:
        """Keys not held and their stamps, oldest first."""
        live = iter(self._live.items())
        if not self._back_at:
            return live
        back = ((k, s) for s, k in self._back if self._back_at.get(k) == s)
        return heapq.merge(live, back, key=_stamp_of)

    def everything(self) -> Iterator[Stamped]:
        """Every key, held ones at their places, oldest first."""
        held = sorted(self._held.items(), key=_stamp_of)
        return heapq.merge(self.walk(), held, key=_stamp_of)

    def _compact(self) -> None:
        """Drop stale entries from ``_back`` once they are most of it."""
        if len(self._back) > 2 * len(self._back_at) + 64:
            self._back = [(s, k) for s, k in self._back if self._back_at.get(k) == s]


def _stamp_of(entry: Stamped) -> int:
    return entry[1]
