"""Handoff holds: freshly committed blocks kept for their first read.

Prefill pushes a request's blocks and decode pulls them moments later; until then nothing
says they are wanted, and a policy that evicts never-reused blocks first (``reuse``) would
drop them first. So a commit pins its new blocks for ``ttl`` seconds; the pin goes at the
first read, at the deadline, or oldest first once holds would fill more than half of the
namespace's memory (so pushes alone cannot fill it with pins), or more than the committing
tenant's share of that half (so one tenant's pushes cannot take what another's leave). A
tenant's holds count against its share of the namespace (``CacheServer._check_slots``).
A namespace's ledger (``_ledger``) owns one :class:`HandoffHolds`, under the namespace's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..local._store import TieredStore


@dataclass(frozen=True)
class Hold:
    """A committed block held for its first read: until when, and for which tenant."""

    deadline: float
    principal: str


class HandoffHolds:
    """One namespace's handoff holds (pins on its ``store``), oldest first; at most
    ``limit`` in all (half the namespace's memory slots)."""

    def __init__(self, store: TieredStore, limit: int) -> None:
        self._store = store
        self._limit = limit
        self._holds: dict[bytes, Hold] = {}
        self._by: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, key: object) -> bool:
        return key in self._holds

    def of(self, principal: str) -> int:
        """How many holds ``principal``'s commits have."""
        return self._by[principal]

    def keys(self) -> list[bytes]:
        return list(self._holds)

    def get(self, key: bytes) -> Hold | None:
        """The hold on ``key``, if it has one."""
        return self._holds.get(key)

    def hand_off(
        self, keys: Sequence[bytes], ttl: float, principal: str = "", share: float = 1.0
    ) -> None:
        """Hold the committed ``keys`` (those still present) for their first read, as
        ``principal``'s, which holds at most ``share`` of them."""
        store = self._store
        candidates = [key for key in keys if key not in self._holds]
        if ttl <= 0 or not candidates:
            return
        present = store.contains(candidates)
        fresh = [key for key, here in zip(candidates, present, strict=True) if here]
        if not fresh:
            return
        # The store's own deadline, not the clock read again: a hold its record calls live
        # must still pin in the store, or its end (``unpin``: the pin that expires first)
        # would take another's pin of the block, a reader's.
        deadline = store.pin(fresh, ttl=ttl).deadline
        for key in fresh:
            self._holds[key] = Hold(deadline, principal)
            self._by[principal] += 1
        mine = max(1, int(self._limit * share))
        excess = self._by[principal] - mine
        released: dict[bytes, Hold] = {}
        if excess > 0:  # its own oldest first
            own = [k for k, hold in self._holds.items() if hold.principal == principal]
            released = {key: self._holds.pop(key) for key in own[:excess]}
        while len(self._holds) > self._limit:
            key = next(iter(self._holds))
            released[key] = self._holds.pop(key)
        self._release(released)

    def take(self, keys: Sequence[bytes]) -> dict[bytes, Hold]:
        """Release the holds on ``keys`` (being read, or removed: the holds have done their
        job); return them for :meth:`restore`."""
        taken = {key: self._holds.pop(key) for key in keys if key in self._holds}
        self._release(taken)
        return taken

    def restore(self, taken: dict[bytes, Hold]) -> None:
        """Put back holds taken for a request that was then refused (it changes nothing)."""
        now = self._store.clock()
        for key, hold in taken.items():
            if hold.deadline > now:
                pin = self._store.pin([key], ttl=hold.deadline - now)
                self._holds[key] = Hold(pin.deadline, hold.principal)  # as in hand_off
                self._by[hold.principal] += 1

    def _release(self, holds: dict[bytes, Hold]) -> None:
        """Unpin the blocks of ``holds`` (already out of the table) in one store call."""
        now = self._store.clock()
        for hold in holds.values():
            self._by[hold.principal] -= 1
            if self._by[hold.principal] <= 0:
                del self._by[hold.principal]
        live = [key for key, hold in holds.items() if hold.deadline > now]
        if live:  # an expired pin is gone already (handoff_ttl <= lease_ttl)
            self._store.unpin(live)
