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
from dataclasses import dataclass

from .._keys import BlockKey

DEFAULT_PIN_TTL_S = 60.0
"""Default pin lifetime: far longer than any single batch transfer (1 GiB at 1 GB/s is one
second), short enough that blocks pinned by a crashed peer come back within a minute."""


PinChange = Callable[[BlockKey, bool], None]
"""Told ``(key, True)`` when a key gains its first live pin, ``(key, False)`` when it loses
its last one (released or expired)."""


@dataclass
class _Pinned:
    """One lease: its deadline, its keys, and how many of them it still pins."""

    deadline: float
    keys: tuple[BlockKey, ...]
    left: int


class PinTable:
    """Which keys are pinned, by which lease, until when.

    Expired leases are swept by :meth:`expire` (a heap of deadlines: O(log n) per lease),
    which every query calls first, so that a pin is gone the moment its deadline passes.
    A lease ends when its last key is unpinned (released, expired, or ``release_one``).
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, on_change: PinChange | None = None
    ) -> None:
        self.clock = clock
        self._on_change = on_change
        self._by_key: dict[BlockKey, set[int]] = {}
        self._leases: dict[int, _Pinned] = {}
        self._due: list[tuple[float, int]] = []
        """Finite deadlines, a heap; an entry whose lease is gone is stale."""
        self._ids = itertools.count(1)

    def add(self, keys: Iterable[BlockKey], ttl: float) -> tuple[int, float]:
        """Pin each key once; return the lease id and its deadline."""
        lease_id = next(self._ids)
        deadline = self.clock() + ttl if ttl != math.inf else math.inf
        lease = _Pinned(deadline, tuple(keys), 0)
        self._leases[lease_id] = lease
        if deadline != math.inf:
            heapq.heappush(self._due, (deadline, lease_id))
        for key in lease.keys:
            leases = self._by_key.setdefault(key, set())
            if lease_id in leases:
                continue  # a key named twice in one lease
            leases.add(lease_id)
            lease.left += 1
            if len(leases) == 1 and self._on_change is not None:
                self._on_change(key, True)
        if not lease.left:
            del self._leases[lease_id]  # pins nothing
        return lease_id, deadline

    def release(self, lease_id: int, keys: Iterable[BlockKey]) -> None:
        """End a lease (a released or unknown one is ignored)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            self._unpin(lease_id, lease.keys)
            self._compact()

    def release_one(self, keys: Iterable[BlockKey]) -> None:
        """Drop the pin that expires first on each key (unpinned keys are ignored)."""
        self.expire()
        for key in keys:
            leases = self._by_key.get(key)
            if leases:
                first = min(leases, key=lambda lease_id: self._leases[lease_id].deadline)
                self._unpin(first, (key,))
        self._compact()

    def expire(self) -> None:
        """End every lease whose deadline has passed."""
        if not self._due or self._due[0][0] > self.clock():
            return
        now = self.clock()
        while self._due and self._due[0][0] <= now:
            _, lease_id = heapq.heappop(self._due)
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._unpin(lease_id, lease.keys)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has a pin, as of the last :meth:`expire`."""
        return key in self._by_key

    def __len__(self) -> int:
        """Keys with a pin, as of the last :meth:`expire`."""
        return len(self._by_key)

    @property
    def open_leases(self) -> int:
        """Leases that still pin a key (an ended lease leaves nothing behind)."""
        return len(self._leases)

    def is_pinned(self, key: BlockKey) -> bool:
        self.expire()
        return key in self._by_key

    def pinned(self) -> list[BlockKey]:
        """Every key with a live pin."""
        self.expire()
        return list(self._by_key)

    def _unpin(self, lease_id: int, keys: Iterable[BlockKey]) -> None:
        """Take ``lease_id``'s pin off ``keys``; the lease ends with its last key."""
        for key in keys:
            leases = self._by_key.get(key)
            if leases is None or lease_id not in leases:
                continue
            leases.discard(lease_id)
            if not leases:
                del self._by_key[key]
                if self._on_change is not None:
                    self._on_change(key, False)
            lease = self._leases[lease_id]
            lease.left -= 1
            if not lease.left:
                del self._leases[lease_id]

    def _compact(self) -> None:
        """Rebuild the deadline heap once released leases are most of it."""
        if len(self._due) > 2 * len(self._leases) + 64:
            self._due = [(p.deadline, i) for i, p in self._leases.items() if p.deadline != math.inf]
            heapq.heapify(self._due)
