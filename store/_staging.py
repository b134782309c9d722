"""Staged puts: slots handed out under a lease, filled by someone else, then committed.

A cache server gives a client free slots of its top memory tier; the client writes the
blocks straight into them through the transfer engine; ``commit`` then indexes them (only
now can readers see them). Slots of a lease that expires before its commit go back to the
free list. ``writable`` answers, per slot, whether a staged put owns it: the server lets
remote writes land only there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._keys import BlockKey


@dataclass(frozen=True)
class Staging:
    id: int
    keys: tuple[BlockKey, ...]
    slots: tuple[int, ...]
    deadline: float


class StagingTable:
    """Open staged puts by lease id, and a per-slot mask of the slots they own."""

    def __init__(self, slots: int, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._open: dict[int, Staging] = {}
        self._ids = itertools.count(1)
        self._writable = np.zeros(slots, dtype=bool)
        self.slots = 0
        """How many slots open stagings hold."""

    def add(self, keys: tuple[BlockKey, ...], slots: tuple[int, ...], ttl: float) -> Staging:
        staging = Staging(next(self._ids), keys, slots, self.clock() + ttl)
        self._open[staging.id] = staging
        self._writable[list(slots)] = True
        self.slots += len(slots)
        return staging

    def pop(self, lease_id: int) -> Staging | None:
        staging = self._open.pop(lease_id, None)
        if staging is not None:
            self._writable[list(staging.slots)] = False
            self.slots -= len(staging.slots)
        return staging

    def expired(self) -> list[Staging]:
        """Remove and return every staging past its deadline."""
        now = self.clock()
        late = [lease_id for lease_id, s in self._open.items() if s.deadline <= now]
        return [s for s in (self.pop(lease_id) for lease_id in late) if s is not None]

    def writable(self, first: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Per range of slots ``first..last`` (inclusive): whether staged puts own all."""
        if len(self._writable) == 0:
            return np.zeros(len(first), dtype=bool)
        inside = (first <= last) & (last < len(self._writable))
        counts = np.concatenate(([0], np.cumsum(self._writable)))
        last_ok = np.where(inside, last, 0)
        first_ok = np.where(inside, first, 0)
        owned = counts[last_ok + 1] - counts[first_ok]
        result: np.ndarray = inside & (owned == last_ok - first_ok + 1)
        return result

    def __len__(self) -> int:
        return len(self._open)
