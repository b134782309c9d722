"""What a cache server hands to remote clients: staged puts and resident pins.

A staged put (``stage`` .. ``commit``/``abort``) reserves top-tier slots for someone else to
fill; ``commit`` makes the blocks visible all at once or not at all. ``pin_resident`` lifts
blocks into the top memory tier and pins them for someone else to read. Who that someone
is, and which remote transfer may touch which slot, is not the store's to know: a cache
server's ledger (``store/server/_ledger.py``) lends the slots and pins to its sessions.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from .._checksums import NO_SUM
from .._errors import (
    BlockNotFound,
    LeaseExpired,
    StoreFull,
    TierUnavailable,
)
from .._keys import BlockKey, check_keys
from .._lease import Lease
from ._placement import Keep, Prefetched
from ._slots import SlotTier
from ._staging import Staging
from .disk._tier import DiskTier

if TYPE_CHECKING:
    from ._store import TieredStore


class RemoteAccess:
    """Staged puts and resident pins over a :class:`~kvbridge.store.TieredStore`: the lease
    protocol a cache server runs on each namespace's store (it holds one beside the store).
    It works on the store's :class:`Placement`, under its lock."""

    def __init__(self, store: TieredStore) -> None:
        self._p = store.placement
        self.block_bytes = store.block_bytes

    def stage(
        self,
        keys: Sequence[bytes],
        *,
        ttl: float | None = None,
        protect: Container[BlockKey] = frozenset(),
    ) -> tuple[int, list[int | None]]:
        """Reserve top-tier slots for the keys not yet stored, for someone else to fill.

        ``protect``: blocks no room is made by evicting (the rest of a put that takes
        several stagings, so that none evicts another's), until the commit.

        Returns a lease id and, per key, the slot to write (``None`` for a key already
        stored, which counts as a use, or repeated earlier in ``keys``). The blocks become
        visible only with :meth:`commit`; :meth:`abort`, or the lease expiring after ``ttl``
        seconds (default ``pin_ttl``), gives the slots back. The lease id is 0 when there
        is nothing to fill. Raises :class:`StoreFull`, staging nothing, when the top tier
        cannot free enough unpinned slots.
        """
        checked = check_keys(keys)
        lifetime = self._p.lifetime(ttl)
        with self._p.lock:
            self._p.check_open()
            top = self._slot_top()
            self._sweep_staged()
            fresh = self._p.fresh(checked)
            positions: list[int | None] = [None] * len(checked)
            if not fresh:
                return 0, positions
            room = self._p.freeable(0)
            if len(fresh) > room:
                raise StoreFull(
                    f"{len(fresh)} new block(s) but the {top.name} tier can free at most "
                    f"{max(room, 0)} slot(s) ({len(self._p.orders[0].held)} pinned, "
                    f"{self._p.staging.slots} staged)"
                )
            slots: list[int] = []
            # The request's stored blocks stay too (a chain with a hole never hits past it).
            kept = Keep(fresh.keys(), _Both(checked, protect))
            with self._p.batch():
                if not self._p.make_room_for(0, len(fresh), kept):  # evicts nothing if not
                    raise StoreFull(
                        f"{len(fresh)} new block(s) but the {top.name} tier holds the rest "
                        "of the put they belong to"
                    )
                for i in fresh.values():
                    slots.append(top.take_slot())
                    positions[i] = slots[-1]
            staging = self._p.staging.add(tuple(fresh), tuple(slots), lifetime, protect)
            return staging.id, positions

    def room_for(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """How many of ``keys`` are new (not stored, each counted once) and how many new
        blocks the tiers can take now, as :meth:`put` counts them. A client whose put takes
        several staged requests asks this first: the requests would otherwise make room by
        evicting one another's blocks, and a put that cannot fit whole must store nothing
        (:class:`StoreFull`), as a local put does."""
        checked = check_keys(keys)
        with self._p.lock:
            self._p.check_open()
            self._sweep_staged()
            new = {key for key in checked if self._p.locate(key) is None}
            return len(new), self._p.room_beside(checked)

    def commit(self, lease_id: int, checksums: Sequence[int] = ()) -> int:
        """Make a staged put visible; return how many blocks it added (a key stored by
        someone else meanwhile is not stored twice). Raises :class:`LeaseExpired` when the
        lease is unknown or expired: the slots are then reclaimed and nothing is stored.
        ``checksums``: per staged key (in the order :meth:`stage` gave slots), its writer's
        end-to-end checksum, kept beside the block (none: ``NO_SUM``).

        All or nothing: when the write-through copy cannot be made (the disk tier holds
        fewer blocks, the disk is full) it raises :class:`StoreFull`, no block of the put
        stays visible, and the staged put ends (its slots go back).
        """
        with self._p.lock:
            self._p.check_open()
            staging = self._p.staging.pop(lease_id)
            top = self._slot_top()
            if staging is None:
                raise LeaseExpired(f"staged put {lease_id} is unknown, committed or expired")
            if staging.deadline <= self._p.pins.clock():
                self._give_back(staging, [])
                raise LeaseExpired(f"staged put {lease_id} expired before its commit")
            if self._p.write_through and self._p.persistent != 0:
                fresh = [key for key in dict.fromkeys(staging.keys) if self._p.locate(key) is None]
                room = self._p.room()
                if len(fresh) > room:
                    self._give_back(staging, [])
                    raise StoreFull(
                        f"{len(fresh)} new block(s) but the disk tier holds at most {room} "
                        "more for their write-through copies"
                    )
            protect = Keep(set(staging.keys), staging.protect)
            adopted: dict[BlockKey, int] = {}
            sums = list(checksums) or [NO_SUM] * len(staging.keys)
            try:
                with self._p.batch():
                    for key, slot, checksum in zip(staging.keys, staging.slots, sums, strict=True):
                        where = self._p.locate(key)
                        if where is not None:
                            self._p.tiers[where].touch(key)
                            continue
                        top.adopt(key, slot)
                        top.set_checksum(key, checksum)
                        adopted[key] = slot
                        if self._p.write_through and self._p.persistent != 0:
                            copy = top.memory.slot(slot)
                            self._p.copy_through(key, copy, protect, checksum)
            except BaseException:
                self._give_back(staging, list(adopted))
                raise
            taken = set(adopted.values())
            self._free_slots([slot for slot in staging.slots if slot not in taken])
            self._p.stats.puts += len(adopted)
            self._p.stats.bytes_in += len(adopted) * self.block_bytes
            return len(adopted)

    def abort(self, lease_id: int) -> None:
        """Give back the slots of a staged put (unknown or expired leases are fine)."""
        with self._p.lock:
            staging = self._p.staging.pop(lease_id)
            if staging is not None:
                self._free_slots(staging.slots)

    def prefetch(self, keys: Sequence[bytes]) -> Prefetched:
        """Read the blocks of ``keys`` that only a disk tier holds, holding the store's lock
        only to look them up: pass the result to :meth:`pin_resident`, which then lifts
        them without reading the disk under the lock (so other callers are not held up by
        it). Changes nothing; a block rewritten or dropped in between is read again."""
        checked = check_keys(keys)
        wanted: dict[DiskTier, list[BlockKey]] = {}
        with self._p.lock:
            self._p.check_open()
            top = self._slot_top()
            for key in dict.fromkeys(checked):
                t = self._p.locate(key)
                tier = self._p.tiers[t] if t is not None and key not in top else None
                if isinstance(tier, DiskTier):
                    wanted.setdefault(tier, []).append(key)
        return Prefetched({tier: tier.copies(keys) for tier, keys in wanted.items()})

    def pin_resident(
        self, keys: Sequence[bytes], *, ttl: float | None = None, early: Prefetched | None = None
    ) -> tuple[Lease, list[int]]:
        """Pin blocks in the top memory tier, copying up those held lower; return the lease
        and each key's slot there, for someone else to read. Counts as a hit on every key.

        Pins nothing when it raises: :class:`BlockNotFound` naming every absent key, or
        every block found bad on the way (dropped for good; the others copied up stay
        there, and blocks moved to make room stay where they went), and
        :class:`StoreFull`, before anything moves, when the top tier cannot free enough
        unpinned slots. ``early`` is what :meth:`prefetch` read of these keys.
        """
        checked = check_keys(keys)
        lifetime = self._p.lifetime(ttl)
        with self._p.lock:
            self._p.check_open()
            top = self._slot_top()
            missing = [key for key in checked if self._p.locate(key) is None]
            if missing:
                self._p.stats.misses += len(missing)
                raise BlockNotFound(missing)
            protect = set(checked)
            lifts = [key for key in dict.fromkeys(checked) if key not in top]
            self._p.check_lift_room(top, protect, len(lifts))
            corrupt: list[BlockKey] = []
            with self._p.batch():
                # Room for every lift in one walk (best effort: a copy out of a memory
                # tier frees a slot there too); _lift then finds a free slot.
                self._p.make_room_for(0, len(lifts), protect)
                for key in dict.fromkeys(checked):
                    t = self._p.locate(key)
                    if t == 0:
                        top.touch(key)
                        continue
                    assert t is not None
                    if not self._p.lift(t, key, protect, early):
                        corrupt.append(key)
            if corrupt:
                raise BlockNotFound(corrupt)
            lease_id, deadline = self._p.pins.add(checked, lifetime)
            self._p.stats.hits += len(checked)
            self._p.stats.bytes_out += len(checked) * self.block_bytes
            lease = Lease(self._p.release, self._p.pins.clock, lease_id, tuple(checked), deadline)
            return lease, [top.position(key) for key in checked]

    def checksums(self, keys: Sequence[BlockKey]) -> list[int]:
        """The end-to-end checksum of each of ``keys``, pinned in the top tier by the
        caller (``NO_SUM`` where none is known)."""
        with self._p.lock:
            top = self._slot_top()
            return [top.checksum(key) for key in keys]

    def _slot_top(self) -> SlotTier:
        top = self._p.tiers[0]
        if not isinstance(top, SlotTier):
            raise TierUnavailable("staged puts and resident pins need a memory top tier")
        return top

    def _sweep_staged(self) -> None:
        """Reclaim the slots of staged puts whose lease expired."""
        for staging in self._p.staging.expired():
            self._free_slots(staging.slots)

    def _free_slots(self, slots: Sequence[int]) -> None:
        if slots and not self._p.closed:
            top = self._p.tiers[0]
            assert isinstance(top, SlotTier)
            for slot in slots:
                top.free_slot(slot)

    def _give_back(self, staging: Staging, adopted: Sequence[BlockKey]) -> None:
        """End a staged put that is not committed: the blocks it adopted leave every tier
        and all its slots go back."""
        top = self._slot_top()
        for key in adopted:
            top.disown(key)
        self._p.withdraw(adopted)
        self._free_slots(staging.slots)


class _Both:
    """Keys of a request or of the rest of its put (no union built: a put may be long)."""

    def __init__(self, request: Sequence[BlockKey], put: Container[BlockKey]) -> None:
        self._request, self._put = set(request), put

    def __contains__(self, key: object) -> bool:
        return key in self._request or key in self._put
