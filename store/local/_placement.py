"""Where a TieredStore's blocks go: the placement cascade, and the state all of it shares.

A new block goes to the highest tier with room or an evictable block (``_place``); making
room evicts the coldest unprotected blocks of the tier's order (``make_room_for``; pinned
blocks are out of it, see ``_held``), each moving one tier down (``_evict``, ``_demote``)
or out of the store from the last. A hit below the
top tier is copied up (``use``, ``lift``). Every method here runs under :attr:`Placement.lock`,
held by its callers: ``TieredStore`` (``_store``, local use) and ``RemoteAccess``
(``_remote``, a server's staged puts and resident pins), each holding the one Placement.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._buffers import BlockArray, Positions, copy_blocks, fill_slots, to_host
from .._checksums import NO_SUM, block_sum
from .._errors import (
    BlockCorrupt,
    StoreClosed,
    StoreError,
    StoreFull,
)
from .._keys import BlockKey
from .._lease import Lease
from .._stats import StoreStats
from ._changes import Changes, Report, ReportingLock
from ._held import HeldOrder
from ._pins import PinTable
from ._policy import check_policy
from ._slab import HostSlab
from ._slots import SlotTier
from ._staging import StagingTable
from ._tier import Tier

_log = logging.getLogger("kvbridge.store")


@dataclass(frozen=True)
class Keep:
    """What making room must not evict: ``hard`` blocks (a put's new ones, a pin's) from
    any tier; ``soft`` ones (the rest of the put they belong to) only where that would lose
    them: a block a lower tier holds too may leave a memory tier (a write-through disk
    copy backs it), so a put larger than memory still fits its disk."""

    hard: Container[BlockKey]
    soft: Container[BlockKey] = frozenset()

    def __contains__(self, key: object) -> bool:
        return key in self.hard or key in self.soft


class Placement:
    """The state of a :class:`~kvbridge.store.TieredStore` and its placement cascade: the
    tiers (highest first), each tier's eviction order less its pinned blocks, the pins, the
    top tier's slots staged for remote writers, the counters, and the lock that guards all
    of it. The store (local use) and :class:`~kvbridge.store.RemoteAccess` (a server's
    staged puts and resident pins) hold one and call it under :attr:`lock`."""

    def __init__(
        self,
        tiers: list[Tier],
        *,
        write_through: bool,
        promote: bool,
        pin_ttl: float,
        clock: Callable[[], float],
    ) -> None:
        if not tiers:
            raise ValueError("a store needs at least one tier with a non-zero capacity")
        sizes = {tier.block_bytes for tier in tiers}
        if len(sizes) != 1:
            raise ValueError(f"tiers disagree on the block size: {sorted(sizes)}")
        if not pin_ttl > 0:
            raise ValueError(f"pin_ttl must be positive, got {pin_ttl}")
        persistent = [i for i, tier in enumerate(tiers) if tier.persistent]
        if write_through and not persistent:
            raise ValueError("write_through needs a disk tier")
        self.block_bytes: int = sizes.pop()
        self.tiers = tiers
        self.persistent: int | None = persistent[-1] if persistent else None
        """The lowest persistent tier (the disk), if there is one."""
        self.write_through = write_through
        self.promote = promote
        self.pin_ttl = pin_ttl
        self.clock = clock
        """Times pins and staged puts (``time.monotonic`` unless a test gives its own)."""
        self.changes = Changes()
        """Keys that entered or left the store, for its watcher (see :meth:`watch`)."""
        self.lock = ReportingLock(lambda: self.changes.flush(self.where))
        self.pins = PinTable(clock, on_change=self._pin_changed)
        self.orders = [
            HeldOrder(check_policy(tier.policy), self.pins, self.changes) for tier in tiers
        ]
        """Each tier's eviction order less its pinned blocks (``tier.policy`` is the same)."""
        for tier, order in zip(tiers, self.orders, strict=True):
            tier.policy = order  # the tier tells it what happens; pinned keys leave its walk
        self.staging = StagingTable(clock=self.pins.clock)
        self._condemned: dict[BlockKey, list[Tier]] = {}
        """Copies found bad while pinned: dropped when their last pin ends."""
        self.stats = StoreStats()
        self.tier_evictions = [0] * len(tiers)
        self.closed = False

    def watch(self, report: Report | None) -> None:
        """Report the keys each operation added or removed, with the tier each is in now,
        as it lets go of the lock (``None``: stop)."""
        with self.lock:
            self.changes.watch(report)

    def where(self, key: BlockKey) -> str | None:
        """The name of the highest tier holding ``key`` (``None``: none does)."""
        t = self.locate(key)
        return None if t is None else self.tiers[t].name

    def locate(self, key: BlockKey) -> int | None:
        """Index of the highest tier holding ``key``."""
        for t, tier in enumerate(self.tiers):
            if key in tier.index:
                return t
        return None

    def room(self) -> int:
        """How many new blocks fit: every slot not held by a pin or a staged put can be
        freed (exact, and O(tiers): pinned blocks are counted per tier as they come)."""
        if self.write_through:
            assert self.persistent is not None
            return self.freeable(self.persistent)
        return sum(self.freeable(t) for t in range(len(self.tiers)))

    def room_beside(self, keys: Iterable[BlockKey]) -> int:
        """How many new blocks fit while every block of ``keys`` stays: :meth:`_room`, less
        the unpinned blocks of ``keys`` that are stored (a put keeps its own blocks: one
        evicted for another would leave a chain with a hole, which never hits past it)."""
        kept = {key for key in keys if key not in self.pins and self.locate(key) is not None}
        return self.room() - len(kept)

    def freeable(self, t: int) -> int:
        """Slots of tier ``t`` that are not pinned nor staged (the top tier's staged puts
        hold slots): the most it can hold after evicting everything it may."""
        self.pins.expire()
        staged = self.staging.slots if t == 0 else 0
        return self.tiers[t].capacity - len(self.orders[t].held) - staged

    def _pin_changed(self, key: BlockKey, pinned: bool) -> None:
        """Take a key that gained its first pin out of every eviction walk, or put one
        that lost its last back (see :mod:`._held`)."""
        for tier, order in zip(self.tiers, self.orders, strict=True):
            if key in tier.index:
                if pinned:
                    order.hold(key)
                else:
                    order.release(key)
        if not pinned and key in self._condemned:
            self._drop_condemned(key)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        with contextlib.ExitStack() as scopes:
            for tier in self.tiers:
                scopes.enter_context(tier.batch())
            yield

    def place_all(
        self,
        fresh: dict[BlockKey, int],
        sources: Sequence[BlockArray],
        source_at: Positions,
        protect: Container[BlockKey],
    ) -> bool:
        """Put every new block of a batch in the top tier at once, when it is host memory
        with a free slot for each: one index update, one copy per run of adjacent slots
        (a block at a time cost ~6 us of Python each). False, doing nothing, otherwise."""
        top = self.tiers[0]
        if (
            not isinstance(top, SlotTier)
            or not isinstance(top.memory, HostSlab)
            or top.free_count() < len(fresh)
        ):
            return False
        index = list(fresh.values())
        slots = top.adopt_many(list(fresh))
        at = None if source_at is None else [source_at[i] for i in index]
        fill_slots(top.memory.array, top.block_bytes, slots, [sources[i] for i in index], at)
        if self.write_through:
            for key, i in fresh.items():
                self.copy_through(key, sources[i], protect)
        return True

    def place_each(
        self,
        fresh: dict[BlockKey, int],
        sources: Sequence[BlockArray],
        source_at: Positions,
        protect: Container[BlockKey],
    ) -> None:
        """Put each new block in the highest tier with room, one by one, evicting none of
        ``protect`` (the new blocks are among them)."""
        slots: list[BlockArray] = []  # memory slots to fill, and what goes in them
        slot_at: list[int | None] = []
        filling: list[BlockArray] = []
        filling_at: list[int | None] = []
        for key, i in fresh.items():
            placed, slot = self._place(key, sources[i], protect)
            if slot is not None:
                slots.append(slot)
                slot_at.append(self.tiers[placed].position(key))
                filling.append(sources[i])
                filling_at.append(None if source_at is None else source_at[i])
            if self.write_through and placed != self.persistent:
                self.copy_through(key, sources[i], protect)
        # New blocks are protected from eviction, so nothing read their slots yet.
        copy_blocks(slots, filling, slot_at, filling_at)

    def _place(
        self, key: BlockKey, src: BlockArray, protect: Container[BlockKey]
    ) -> tuple[int, BlockArray | None]:
        """Put ``key`` in the highest tier with room: its index, and the slot to fill (or
        ``None`` when the tier stored ``src`` itself)."""
        for t, tier in enumerate(self.tiers):
            if self._make_room(t, protect):
                slot = tier.reserve(key)
                if slot is None:
                    tier.store(key, src)
                return t, slot
        raise StoreFull("no tier has room")  # unreachable: put checked the room first

    def copy_through(
        self,
        key: BlockKey,
        src: BlockArray,
        protect: Container[BlockKey],
        checksum: int = NO_SUM,
    ) -> None:
        """The write-through copy of a new block (:class:`BlockCorrupt` when its bytes do
        not match its writer's ``checksum``)."""
        assert self.persistent is not None
        if not self._make_room(self.persistent, protect):
            raise StoreFull("no room for the write-through copy")  # unreachable, see _room
        self.tiers[self.persistent].store(key, src, checksum)

    def _make_room(self, t: int, protect: Container[BlockKey]) -> bool:
        """Ensure tier ``t`` has a free slot, evicting one unpinned, unprotected block."""
        return self.make_room_for(t, 1, protect)

    def make_room_for(self, t: int, count: int, protect: Container[BlockKey]) -> bool:
        """Free ``count`` slots of tier ``t`` (staged slots count as used), evicting the
        coldest unprotected blocks in one walk of its order (pinned blocks are not in it).
        Evicts nothing when it cannot free them all."""
        tier = self.tiers[t]
        used = len(tier) + (self.staging.slots if t == 0 else 0)
        need = used + count - tier.capacity
        if need <= 0:
            return True
        self.pins.expire()
        victims = []
        for key in self.orders[t].candidates():
            if not self._stops(protect, t, key):
                victims.append(key)
                if len(victims) == need:
                    break
        else:
            return False
        for key in victims:
            self._evict(t, key, protect)
        return True

    def _stops(self, protect: Container[BlockKey], t: int, key: BlockKey) -> bool:
        """Whether ``protect`` keeps ``key`` in tier ``t``: every key of a plain container;
        of a :class:`Keep`, its ``hard`` keys, and its ``soft`` ones only where leaving
        ``t`` would lose them (no tier under ``t`` holds them too)."""
        if not isinstance(protect, Keep):
            return key in protect
        if key in protect.hard:
            return True
        return key in protect.soft and not any(key in tier for tier in self.tiers[t + 1 :])

    def _evict(self, t: int, key: BlockKey, protect: Container[BlockKey]) -> None:
        """Move ``key`` from tier ``t`` one tier down, or out of the store from the last."""
        tier = self.tiers[t]
        self.tier_evictions[t] += 1
        below = t + 1
        if below < len(self.tiers) and (
            key in self.tiers[below] or self._demote(tier, below, key, protect)
        ):
            self.stats.demotions += 1
        elif all(key not in other for other in self.tiers if other is not tier):
            self.stats.evictions += 1
        tier.delete(key)

    def _demote(self, tier: Tier, below: int, key: BlockKey, protect: Container[BlockKey]) -> bool:
        """Copy ``key`` one tier down; False when there is no room, or when its bytes are
        found bad on the way (they fail the disk's read or the block's checksum)."""
        if not self._make_room(below, protect):
            return False
        with tier.reading() as read:
            src = read(key)
            with contextlib.suppress(BlockCorrupt):
                if src is not None:
                    self.tiers[below].store(key, src, tier.checksum(key))
                    return True
        self.stats.corrupt += 1
        _log.warning("block %s failed its checksum on its way down", key.hex()[:16])
        return False

    def use(self, key: BlockKey, data: BlockArray, protect: set[BlockKey]) -> None:
        """Record a hit on ``key`` and promote it to the top tier where policy says so."""
        t = self.locate(key)
        assert t is not None
        source = self.tiers[t]
        if t == 0 or not self.promote or self.pins.is_pinned(key):
            source.touch(key)
            return
        if source.persistent:  # copy up; the persistent copy stays and counts as used
            if not self._make_room(0, protect):
                source.touch(key)
                return
            source.touch(key)
        checksum = source.checksum(key)
        if not source.persistent:  # move up: free the slot first, for the top's victim
            source.delete(key)
            if not self._make_room(0, protect):
                source.store(key, data, checksum)
                return
        self.tiers[0].store(key, data, checksum)
        self.stats.promotions += 1

    def fresh(self, keys: Sequence[BlockKey]) -> dict[BlockKey, int]:
        """The keys not stored yet, each with its first index; present keys count as used
        and repeats as duplicates."""
        fresh: dict[BlockKey, int] = {}
        top, lower = self.tiers[0], len(self.tiers) > 1
        top_index = top.index
        for i, key in enumerate(keys):  # per key: the top tier and the batch asked inline
            if key in top_index:
                top.touch(key)
            elif key in fresh:
                continue
            elif lower and (t := self.locate(key)) is not None:
                self.tiers[t].touch(key)
            else:
                fresh[key] = i
        self.stats.duplicates += len(keys) - len(fresh)
        return fresh

    def drop_corrupt(self, keys: list[BlockKey]) -> None:
        """Drop blocks found bad, for good (see Tier.discard); one purge for them all."""
        shown = ", ".join(key.hex()[:16] for key in keys[:4])
        _log.warning(
            "%d corrupt block(s) dropped (%s): a miss, never wrong bytes", len(keys), shown
        )
        self.stats.corrupt += len(keys)
        self.stats.misses += len(keys)
        with self.batch():
            for key in keys:
                for tier in self.tiers:
                    if key in tier and tier.persistent:
                        tier.discard(key)

    def verify(self, keys: Iterable[BlockKey]) -> list[bool]:
        """A reader found these blocks bad once they landed: check each stored copy again
        (a memory copy against its checksum, a disk copy against its own) and drop the bad
        ones, a pinned one as its last pin ends (its slot is not reused under a reader).
        Per key, whether a bad copy was found; one whose copies are sound went bad on its
        way."""
        found = []
        for key in keys:
            if key in self._condemned:  # found bad already, dropped when its pins end
                found.append(True)
                continue
            bad = [tier for tier in self.tiers if key in tier and not self._sound(tier, key)]
            found.append(bool(bad))
            if bad:
                self.stats.corrupt += 1
                self._condemned[key] = bad
                if key not in self.pins:
                    self._drop_condemned(key)
        return found

    def _drop_condemned(self, key: BlockKey) -> None:
        for tier in self._condemned.pop(key, []):
            if key in tier:
                tier.discard(key)

    def _sound(self, tier: Tier, key: BlockKey) -> bool:
        """Whether ``tier``'s copy of ``key`` matches its checksum (or has none to match)."""
        with tier.reading() as read:
            data = read(key)
            if data is None:
                return False
            checksum = tier.checksum(key)
            return checksum == NO_SUM or block_sum(to_host(data).data) == checksum

    def withdraw(self, keys: Iterable[BlockKey]) -> None:
        """Take the blocks of a failed put or commit out of every tier. A disk delete
        stands even when its batch fails, so that failure hides nothing: it is dropped."""
        with contextlib.suppress(StoreError), self.batch():
            for key in keys:
                for tier in self.tiers:
                    if key in tier:
                        tier.delete(key)

    def check_lift_room(self, top: SlotTier, protect: set[BlockKey], lifts: int) -> None:
        """Raise StoreFull unless the top tier can take ``lifts`` more blocks next to the
        ones of ``protect`` it holds: slots of staged puts and pinned blocks stay."""
        room = self.freeable(0) - (len(protect) - lifts)
        room += sum(key in self.orders[0].held for key in protect)  # counted once, as kept
        if lifts > room:
            raise StoreFull(
                f"{lifts} block(s) to copy up but the {top.name} tier can free at most "
                f"{max(room, 0)} slot(s) (the others are pinned or staged)"
            )

    def lift(
        self, t: int, key: BlockKey, protect: set[BlockKey], early: Prefetched | None = None
    ) -> bool:
        """Copy ``key`` from tier ``t`` into the top tier (moving it out of a memory tier);
        False when it is found bad (it is dropped, and nothing was moved for it). A copy in
        ``early`` stands in for the read if it is still of the block's current version."""
        source = self.tiers[t]
        checksum = source.checksum(key)
        data = early.get(source, key) if early is not None else None
        if data is not None:
            self._store_lifted(key, data, checksum, protect)
        else:
            with source.reading() as read:
                data = read(key)
                if data is None:
                    self.drop_corrupt([key])
                    return False
                self._store_lifted(key, data, checksum, protect)
        if not source.persistent:
            source.delete(key)
        self.stats.promotions += 1
        return True

    def _store_lifted(
        self, key: BlockKey, data: BlockArray, checksum: int, protect: set[BlockKey]
    ) -> None:
        if not self._make_room(0, protect):  # unreachable: pin_resident checked
            raise StoreFull(f"the {self.tiers[0].name} tier has no unpinned slot")
        self.tiers[0].store(key, data, checksum)

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed("the store is closed")

    def lifetime(self, ttl: float | None) -> float:
        lifetime = self.pin_ttl if ttl is None else ttl
        if not lifetime > 0:
            raise ValueError(f"ttl must be positive, got {lifetime}")
        return lifetime

    def release(self, lease: Lease) -> None:
        with self.lock:
            self.pins.release(lease.id, lease.keys)


class Prefetched:
    """Copies of disk blocks read ahead of a lift, each with the version it was read at."""

    def __init__(self, copies: dict[Any, dict[BlockKey, tuple[bytes, np.ndarray]]]) -> None:
        self._copies = copies  # tier -> key -> (version, bytes)

    def __len__(self) -> int:
        return sum(len(found) for found in self._copies.values())

    def get(self, tier: Tier, key: BlockKey) -> np.ndarray | None:
        """The copy of ``key`` read from ``tier``, if the tier still holds that version of it
        (caller holds the store's lock)."""
        found = self._copies.get(tier, {}).get(key)
        version = getattr(tier, "version", None)
        if found is None or version is None or version(key) != found[0]:
            return None
        return found[1]
