"""The cache server's leases in one namespace: who holds which slots, until when.

A staged put (``stage`` .. ``commit``/``abort``) lets one session write the slots it was
given; a read lease (``pin`` .. ``release``) lets one session read the slots of the blocks it
pinned. The store keeps the slots themselves (``TieredStore.stage``, ``pin_resident``); this
book records which session each lease belongs to, so that:

- only the session that took a lease may commit, abort or release it;
- the namespace's region guard admits a remote read only into slots pinned for the reading
  session, under a lease that has not expired (:meth:`LeaseBook.readable`), and a remote
  write only into slots staged for the writing session (the store checks that);
- what one session may hold is bounded (:attr:`LeaseBook.held`), transfers in flight on a
  lease it already gave back included (:meth:`LeaseBook.begin_use`): a lease released with a
  stalled read still on it counts until that read ends;
- a session that ends gives everything back at once (:meth:`LeaseBook.end_session`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import LeaseExpired
from ..local._pins import Lease
from ._lease_counts import LeaseCounts

Use = tuple[str, int]
"""A lease as transfers in flight name it: ``("stage", id)`` or ``("pin", id)`` (the two
kinds of lease number their ids apart)."""


@dataclass
class Staged:
    """A staged put as the server sees it: whose it is and how many slots it holds (its keys,
    slots and deadline are the store's: ``TieredStore.staged_keys``, ``staging_open``)."""

    session: int
    slots: int
    principal: str = ""


@dataclass
class Pinned:
    session: int
    lease: Lease
    slots: list[int]
    principal: str = ""


@dataclass(frozen=True)
class _Holder:
    """Who a lease's slots count against: its session and the session's principal."""

    session: int
    principal: str
    slots: int


class LeaseBook:
    """One namespace's open leases, by id, and what each session holds. Not thread-safe:
    the server calls it under the namespace's lock. Each lease it records was counted in
    ``counts`` (the server's, every namespace together) before it opened; its end gives
    that back."""

    def __init__(self, counts: LeaseCounts) -> None:
        self._counts = counts
        self.stagings: dict[int, Staged] = {}
        self.pins: dict[int, Pinned] = {}
        self.held: Counter[int] = Counter()
        """Slots held per session (staged and pinned)."""
        self.held_by: Counter[str] = Counter()
        """Slots held per principal (a tenant: all its sessions together)."""
        self._readable: dict[int, dict[int, dict[int, bytes]]] = {}
        """session -> slot -> {read lease id: the key pinned there}."""
        self._inflight: Counter[Use] = Counter()
        """Remote transfers admitted on each lease and not done yet."""
        self._ended: dict[Use, _Holder] = {}
        """Leases ended with transfers in flight: their slots still counted as held."""

    # -- staged puts -------------------------------------------------------------------

    def add_staging(self, session: int, lease_id: int, slots: int, principal: str = "") -> None:
        self.stagings[lease_id] = Staged(session, slots, principal)
        self._hold(_Holder(session, principal, slots))

    def take_staging(self, lease_id: int, session: int) -> Staged:
        """End the session's staging ``lease_id``; :class:`LeaseExpired` if it has none."""
        staged = self.stagings.get(lease_id)
        if staged is None or staged.session != session:
            raise LeaseExpired(f"lease {lease_id} is unknown, finished or expired")
        del self.stagings[lease_id]
        self._drop(("stage", lease_id), _Holder(session, staged.principal, staged.slots))
        return staged

    # -- read leases -------------------------------------------------------------------

    def add_pin(self, session: int, lease: Lease, slots: list[int], principal: str = "") -> None:
        self.pins[lease.id] = Pinned(session, lease, slots, principal)
        self._hold(_Holder(session, principal, len(slots)))
        readable = self._readable.setdefault(session, {})
        for key, slot in zip(lease.keys, slots, strict=True):
            readable.setdefault(slot, {})[lease.id] = key

    def take_pin(self, lease_id: int, session: int) -> Pinned:
        """End the session's read lease ``lease_id`` (the caller releases its pin)."""
        pinned = self.pins.get(lease_id)
        if pinned is None or pinned.session != session:
            raise LeaseExpired(f"lease {lease_id} is unknown, finished or expired")
        del self.pins[lease_id]
        self._drop(("pin", lease_id), _Holder(session, pinned.principal, len(pinned.slots)))
        readable = self._readable.get(session, {})
        for slot in pinned.slots:
            by_lease = readable.get(slot)
            if by_lease is not None:
                by_lease.pop(lease_id, None)
                if not by_lease:
                    del readable[slot]
        if not readable:
            self._readable.pop(session, None)
        return pinned

    def readable(
        self, session: int, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[bytes], list[Use]]:
        """Per slot range ``first..last``: whether every slot in it is pinned for
        ``session`` under a lease that has not expired; the keys of those slots (each
        once), and the leases that pin them. Each distinct range is looked up once: a
        frame of a KV cache's pages names each block's slot once per page."""
        allowed = np.zeros(len(first), dtype=bool)
        mine = self._readable.get(session)
        if mine is None or not len(first):
            return allowed, [], []
        ranges, inverse = _distinct_ranges(first, last)
        found: dict[int, tuple[int, bytes]] = {}
        ok = np.zeros(len(ranges), dtype=bool)
        for i, (lo, hi) in enumerate(ranges.tolist()):
            if not 0 <= lo <= hi:
                continue
            entries = {slot: self._live(mine.get(slot)) for slot in range(lo, hi + 1)}
            live = {slot: entry for slot, entry in entries.items() if entry is not None}
            if len(live) == len(entries):
                ok[i] = True
                found.update(live)
        allowed[:] = ok[inverse.reshape(-1)]
        keys = [key for _, key in found.values()]
        leases = {("pin", lease_id) for lease_id, _ in found.values()}
        return allowed, keys, list(leases)

    def _live(self, by_lease: dict[int, bytes] | None) -> tuple[int, bytes] | None:
        for lease_id, key in (by_lease or {}).items():
            if not self.pins[lease_id].lease.expired:
                return lease_id, key
        return None

    # -- transfers in flight -----------------------------------------------------------

    def begin_use(self, leases: list[Use]) -> None:
        """Remote transfers on ``leases`` were admitted: what they hold stays counted as
        held by the lease's session until :meth:`end_use`, even if the lease ends first."""
        for lease in leases:
            self._inflight[lease] += 1

    def end_use(self, leases: list[Use]) -> None:
        for lease in leases:
            self._inflight[lease] -= 1
            if self._inflight[lease] <= 0:
                del self._inflight[lease]
                ended = self._ended.pop(lease, None)
                if ended is not None:
                    self._unhold(ended)

    # -- lifetimes ---------------------------------------------------------------------

    def expired(self, staging_open: Callable[[int], bool]) -> tuple[list[int], list[Pinned]]:
        """End the leases past their deadline: the staged puts the store no longer holds
        open (ids, to abort in the store) and the read leases that expired (to release)."""
        staged = [i for i in self.stagings if not staging_open(i)]
        pinned = [i for i, p in self.pins.items() if p.lease.expired]
        for lease_id in staged:
            self.take_staging(lease_id, self.stagings[lease_id].session)
        return staged, [self.take_pin(i, self.pins[i].session) for i in pinned]

    def end_session(self, session: int) -> tuple[list[int], list[Pinned]]:
        """End every lease of ``session``: staged put ids and read leases, as ``expired``."""
        staged = [i for i, s in self.stagings.items() if s.session == session]
        pinned = [i for i, p in self.pins.items() if p.session == session]
        for lease_id in staged:
            self.take_staging(lease_id, session)
        return staged, [self.take_pin(i, session) for i in pinned]

    def __len__(self) -> int:
        return len(self.stagings) + len(self.pins)

    def _hold(self, holder: _Holder) -> None:
        self.held[holder.session] += holder.slots
        self.held_by[holder.principal] += holder.slots

    def _drop(self, lease: Use, holder: _Holder) -> None:
        self._counts.give(holder.session, holder.principal)
        if self._inflight[lease] > 0:  # still being read or written: counted until done
            self._ended[lease] = holder
        else:
            self._unhold(holder)

    def _unhold(self, holder: _Holder) -> None:
        _take(self.held, holder.session, holder.slots)
        _take(self.held_by, holder.principal, holder.slots)


def _distinct_ranges(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``(first, last)`` pairs, and for each range the index of its pair."""
    if (first == last).all():  # one slot per op: the usual frame
        slots, inverse = np.unique(first, return_inverse=True)
        return np.stack([slots, slots], axis=1), inverse
    return np.unique(np.stack([first, last], axis=1), axis=0, return_inverse=True)


def _take(counter: Counter[Any], who: Any, amount: int) -> None:
    counter[who] -= amount
    if counter[who] <= 0:
        del counter[who]
