"""Pins: leases that keep blocks where they are (no eviction, no demotion, no removal).

A transfer pins the blocks it reads or writes so that their slots stay valid. Every pin
has a deadline; an expired pin no longer counts, so a reader that died cannot hold blocks
forever. Expiry is checked lazily when the store looks for room: there is no sweeper thread.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable

from .._closing import Closing
from ._keys import BlockKey

DEFAULT_PIN_TTL_S = 60.0
"""Default pin lifetime: far longer than any single batch transfer (1 GiB at 1 GB/s is one
second), short enough that blocks pinned by a crashed peer come back within a minute."""


class PinTable:
    """Which keys are pinned, by which lease, until when."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_key: dict[BlockKey, dict[int, float]] = {}
        self._ids = itertools.count(1)

    def add(self, keys: Iterable[BlockKey], ttl: float) -> tuple[int, float]:
        """Pin each key once; return the lease id and its deadline."""
        lease_id = next(self._ids)
        deadline = self.clock() + ttl if ttl != math.inf else math.inf
        for key in keys:
            self._by_key.setdefault(key, {})[lease_id] = deadline
        return lease_id, deadline

    def release(self, lease_id: int, keys: Iterable[BlockKey]) -> None:
        for key in keys:
            leases = self._by_key.get(key)
            if leases is not None:
                leases.pop(lease_id, None)
                if not leases:
                    del self._by_key[key]

    def release_one(self, keys: Iterable[BlockKey]) -> None:
        """Drop the pin that expires first on each key (unpinned keys are ignored)."""
        for key in keys:
            leases = self._by_key.get(key)
            if leases:
                self.release(min(leases, key=leases.__getitem__), (key,))

    def __len__(self) -> int:
        """Keys with a pin, expired ones not yet swept included (an upper bound)."""
        return len(self._by_key)

    def is_pinned(self, key: BlockKey) -> bool:
        leases = self._by_key.get(key)
        if not leases:
            return False
        now = self.clock()
        for lease_id in [i for i, deadline in leases.items() if deadline <= now]:
            del leases[lease_id]
        if not leases:
            del self._by_key[key]
            return False
        return True

    def pinned(self) -> list[BlockKey]:
        """Every key with a live pin (expired pins are swept)."""
        return [key for key in list(self._by_key) if self.is_pinned(key)]


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
