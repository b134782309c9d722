"""Pins: leases that keep blocks where they are (no eviction, no demotion, no removal).

A transfer pins the blocks it reads or writes so that their slots stay valid. Every pin
has a deadline; an expired pin no longer counts, so a reader that died cannot hold blocks
forever. Expiry is checked when the store next looks (a heap of deadlines): there is no
sweeper thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable

from .._closing import Closing
from ._keys import BlockKey

DEFAULT_PIN_TTL_S = 60.0
"""Default pin lifetime: far longer than any single batch transfer (1 GiB at 1 GB/s is one
second), short enough that blocks pinned by a crashed peer come back within a minute."""


PinChange = Callable[[BlockKey, bool], None]
"""Told ``(key, True)`` when a key gains its first live pin, ``(key, False)`` when it loses
its last one (released or expired)."""


class PinTable:
    """Which keys are pinned, by which lease, until when.

    Expired leases are swept by :meth:`expire` (a heap of deadlines: O(log n) per lease),
    which every query calls first, so that a pin is gone the moment its deadline passes.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, on_change: PinChange | None = None
    ) -> None:
        self.clock = clock
        self._on_change = on_change
        self._by_key: dict[BlockKey, set[int]] = {}
        self._leases: dict[int, tuple[float, tuple[BlockKey, ...]]] = {}
        self._due: list[tuple[float, int]] = []
        """Finite deadlines, a heap; an entry whose lease is gone is stale."""
        self._ids = itertools.count(1)

    def add(self, keys: Iterable[BlockKey], ttl: float) -> tuple[int, float]:
        """Pin each key once; return the lease id and its deadline."""
        lease_id = next(self._ids)
        deadline = self.clock() + ttl if ttl != math.inf else math.inf
        pinned = tuple(keys)
        self._leases[lease_id] = (deadline, pinned)
        if deadline != math.inf:
            heapq.heappush(self._due, (deadline, lease_id))
        for key in pinned:
            leases = self._by_key.setdefault(key, set())
            if lease_id in leases:
                continue  # a key named twice in one lease
            leases.add(lease_id)
            if len(leases) == 1 and self._on_change is not None:
                self._on_change(key, True)
        return lease_id, deadline

    def release(self, lease_id: int, keys: Iterable[BlockKey]) -> None:
        """End a lease (a released or unknown one is ignored)."""
        if self._leases.pop(lease_id, None) is not None:
            self._unpin(lease_id, keys)
            self._compact()

    def release_one(self, keys: Iterable[BlockKey]) -> None:
        """Drop the pin that expires first on each key (unpinned keys are ignored)."""
        self.expire()
        for key in keys:
            leases = self._by_key.get(key)
            if leases:
                first = min(leases, key=lambda lease_id: self._leases[lease_id][0])
                self._unpin(first, (key,))
                _, held = self._leases[first]
                if not any(first in self._by_key.get(k, ()) for k in held):
                    del self._leases[first]  # its last key went: the lease is over

    def expire(self) -> None:
        """End every lease whose deadline has passed."""
        if not self._due or self._due[0][0] > self.clock():
            return
        now = self.clock()
        while self._due and self._due[0][0] <= now:
            _, lease_id = heapq.heappop(self._due)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._unpin(lease_id, lease[1])

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a pin, as of the last :meth:`expire`."""
        return key in self._by_key

    def is_pinned(self, key: BlockKey) -> bool:
        self.expire()
        return key in self._by_key

    def pinned(self) -> list[BlockKey]:
        """Every key with a live pin."""
        self.expire()
        return list(self._by_key)

    def _unpin(self, lease_id: int, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            leases = self._by_key.get(key)
            if leases is not None and lease_id in leases:
                leases.discard(lease_id)
                if not leases:
                    del self._by_key[key]
                    if self._on_change is not None:
                        self._on_change(key, False)

    def _compact(self) -> None:
        """Rebuild the deadline heap once released leases are most of it."""
        if len(self._due) > 2 * len(self._leases) + 64:
            self._due = [(d, i) for i, (d, _) in self._leases.items() if d != math.inf]
            heapq.heapify(self._due)


class Lease(Closing):
    """A pin on some blocks; release it (or leave the ``with`` block) when done.

    Releasing twice, or after the deadline, is harmless.
    """

    def __init__(
        self,
        release: Callable[[Lease], None],
        clock: Callable[[], float],
        lease_id: int,
        keys: tuple[BlockKey, ...],
        deadline: float,
    ) -> None:
        self._release = release
        self._clock = clock
        self.id = lease_id
        self.keys = keys
        self.deadline = deadline
        self.released = False

    @property
    def expired(self) -> bool:
        return self._clock() >= self.deadline

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self)

    close = release  # ``with store.pin(keys): ...`` releases on the way out (Closing)
