"""Staged puts: slots handed out under a lease, filled by someone else, then committed.

A cache server gives a client free slots of its top memory tier; the client writes the
blocks straight into them through the transfer engine; ``commit`` then indexes them (only
now can readers see them). Slots of a lease that ends (abort, expiry) without a commit go
back to the free list.

Remote writes. A staging names its ``owner`` (the server's session number); only that owner
may write its slots, and only while the lease is open (:meth:`StagingTable.admit`). An
admitted write holds its leases until its bytes have landed (:meth:`StagingTable.release`):
a lease that ends meanwhile stops admitting writes at once, but its slots go back to the
free list only when the last write in flight into them is done. So a late or slow writer
can never put bytes into a slot that was handed to someone else.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import numpy as np

from .._keys import BlockKey

NO_OWNER = 0
"""Owner of a staging nobody may write remotely (a local ``stage`` without an owner)."""


@dataclass(frozen=True)
class Staging:
    id: int
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    deadline: float
    owner: int = NO_OWNER
    protect: Container[BlockKey] = frozenset()
    """Blocks the commit must not evict to make room (the rest of the put it is part of)."""


class StagingTable:
    """Open staged puts by lease id, who may write each slot, and the writes in flight."""

    def __init__(self, slots: int, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._open: dict[int, Staging] = {}
        self._ended: dict[int, Staging] = {}  # ended with writes in flight: slots not free yet
        self._writes: Counter[int] = Counter()  # lease id -> admitted writes not yet landed
        self._ids = itertools.count(1)
        self._owner = np.zeros(slots, dtype=np.int64)  # per slot: who may write it
        self._lease = np.zeros(slots, dtype=np.int64)  # per slot: the open staging holding it
        self.slots = 0
        """How many slots stagings hold (open ones, and ended ones still being written)."""

    def add(
        self,
        keys: tuple[BlockKey, ...],
        slots: tuple[int, ...],
        ttl: float,
        owner: int,
        protect: Container[BlockKey] = frozenset(),
    ) -> Staging:
        staging = Staging(next(self._ids), keys, slots, self.clock() + ttl, owner, protect)
        self._open[staging.id] = staging
        self._owner[list(slots)] = owner
        self._lease[list(slots)] = staging.id
        self.slots += len(slots)
        return staging

    def get(self, lease_id: int) -> Staging | None:
        return self._open.get(lease_id)

    def busy(self, lease_id: int) -> bool:
        """Whether admitted writes into the lease's slots have not landed yet."""
        return self._writes[lease_id] > 0

    def pop(self, lease_id: int) -> Staging | None:
        """End an open staging (no write is admitted into it from now on). Its slots are
        the caller's to free or adopt, unless writes are in flight: call :meth:`freeable`."""
        staging = self._open.pop(lease_id, None)
        if staging is not None:
            self._owner[list(staging.slots)] = NO_OWNER
            self._lease[list(staging.slots)] = 0
            if self._writes[lease_id] > 0:
                self._ended[lease_id] = staging
            else:
                self.slots -= len(staging.slots)
        return staging

    def freeable(self, staging: Staging) -> tuple[int, ...]:
        """The slots of a popped staging that may be freed now (none while written)."""
        return () if staging.id in self._ended else staging.slots

    def expired(self) -> list[Staging]:
        """End and return every staging past its deadline."""
        now = self.clock()
        late = [lease_id for lease_id, s in self._open.items() if s.deadline <= now]
        return [s for s in (self.pop(lease_id) for lease_id in late) if s is not None]

    def admit(
        self, owner: int, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """Per range of slots ``first..last`` (inclusive): whether ``owner`` may write all of
        it now. When every range is allowed, the leases they touch are held (one write each)
        and returned, for :meth:`release` once the bytes landed; otherwise nothing is held."""
        count = len(self._owner)
        inside = (first >= 0) & (first <= last) & (last < count)
        lo, hi = np.where(inside, first, 0), np.where(inside, last, 0)
        allowed: np.ndarray = inside & (self._owner[lo] == owner) & (self._owner[hi] == owner)
        allowed &= owner != NO_OWNER
        for i in np.flatnonzero(allowed & (lo != hi)):  # ranges over several slots: rare
            allowed[i] = bool((self._owner[lo[i] : hi[i] + 1] == owner).all())
        if not allowed.all():
            return allowed, []
        touched = self._lease[lo]
        if (lo == hi).all() and (touched == touched[0]).all():  # the usual frame: one put
            leases = [int(touched[0])]
        elif (lo == hi).all():
            leases = np.unique(touched).tolist()
        else:
            spans = [self._lease[a : b + 1] for a, b in zip(lo, hi, strict=True)]
            leases = np.unique(np.concatenate(spans)).tolist()
        now = self.clock()
        if any(self._open[lease_id].deadline <= now for lease_id in leases):
            return np.zeros(len(first), dtype=bool), []  # expired: ended, just not swept yet
        for lease_id in leases:
            self._writes[lease_id] += 1
        return allowed, leases

    def release(self, leases: Sequence[int]) -> list[int]:
        """Admitted writes into ``leases`` have landed (or failed); return the slots of
        ended stagings that are free now."""
        free: list[int] = []
        for lease_id in leases:
            self._writes[lease_id] -= 1
            if self._writes[lease_id] <= 0:
                del self._writes[lease_id]
                staging = self._ended.pop(lease_id, None)
                if staging is not None:
                    self.slots -= len(staging.slots)
                    free.extend(staging.slots)
        return free

    def __len__(self) -> int:
        return len(self._open)
