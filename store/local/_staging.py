"""Staged puts: slots handed out under a lease, filled by someone else, then committed.

A cache server gives a client free slots of its top memory tier; the client writes the
blocks straight into them through the transfer engine; ``commit`` then indexes them (only
now can readers see them). Slots of a lease that ends (abort, expiry) without a commit go
back to the free list. Who may write the slots, and when they may be given back with
writes in flight, is the lender's business (a cache server's ledger:
``store/server/_ledger.py``): the store knows slots, never sessions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container
from dataclasses import dataclass

from .._keys import BlockKey


@dataclass(frozen=True)
class Staging:
    id: int
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    deadline: float
    protect: Container[BlockKey] = frozenset()
    """Blocks the commit must not evict to make room (the rest of the put it is part of)."""


class StagingTable:
    """Open staged puts by lease id."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._open: dict[int, Staging] = {}
        self._ids = itertools.count(1)
        self.slots = 0
        """How many slots open stagings hold."""

    def add(
        self,
        keys: tuple[BlockKey, ...],
        slots: tuple[int, ...],
        ttl: float,
        protect: Container[BlockKey] = frozenset(),
    ) -> Staging:
        staging = Staging(next(self._ids), keys, slots, self.clock() + ttl, protect)
        self._open[staging.id] = staging
        self.slots += len(slots)
        return staging

    def get(self, lease_id: int) -> Staging | None:
        return self._open.get(lease_id)

    def pop(self, lease_id: int) -> Staging | None:
        """End an open staging; its slots are the caller's to free or adopt."""
        staging = self._open.pop(lease_id, None)
        if staging is not None:
            self.slots -= len(staging.slots)
        return staging

    def expired(self) -> list[Staging]:
        """End and return every staging past its deadline."""
        now = self.clock()
        late = [lease_id for lease_id, s in self._open.items() if s.deadline <= now]
        return [s for s in (self.pop(lease_id) for lease_id in late) if s is not None]

    def __len__(self) -> int:
        return len(self._open)
