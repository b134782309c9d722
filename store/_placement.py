"""Where a TieredStore's blocks go: the placement cascade, and the state all of it shares.

A new block goes to the highest tier with room or an evictable block (``_place``); making
room evicts the coldest unprotected blocks of the tier's order (``_make_room_for``; pinned
blocks are out of it, see ``_held``), each moving one tier down (``_evict``, ``_demote``)
or out of the store from the last. A hit below the
top tier is copied up (``_use``, ``_lift``). Every method here runs under the store's lock;
the public API that calls them is in ``_store`` (local use) and ``_remote`` (a server's
staged puts and resident pins).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._buffers import BlockArray, Positions, copy_blocks, fill_slots
from ._errors import (
    StoreClosed,
    StoreError,
    StoreFull,
)
from ._held import HeldOrder
from ._keys import BlockKey
from ._pins import Lease, PinTable
from ._slab import HostSlab
from ._slots import SlotTier
from ._staging import StagingTable
from ._stats import StoreStats
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
    """The shared state of a :class:`~kvbridge.store.TieredStore` and its placement cascade."""

    block_bytes: int
    write_through: bool
    promote: bool
    pin_ttl: float
    clock: Callable[[], float]
    """Times pins and staged puts (``time.monotonic`` unless a test gives its own)."""
    _tiers: list[Tier]
    _persistent: int | None
    _lock: threading.RLock
    _pins: PinTable
    _orders: list[HeldOrder]
    """Each tier's eviction order less its pinned blocks (``tier.policy`` is the same object)."""
    _staging: StagingTable
    _stats: StoreStats
    _tier_evictions: list[int]
    _closed: bool

    def _locate(self, key: BlockKey) -> int | None:
        """Index of the highest tier holding ``key``."""
        for t, tier in enumerate(self._tiers):
            if key in tier.index:
                return t
        return None

    def _room(self) -> int:
        """How many new blocks fit: every slot not held by a pin or a staged put can be
        freed (exact, and O(tiers): pinned blocks are counted per tier as they come)."""
        if self.write_through:
            assert self._persistent is not None
            return self._freeable(self._persistent)
        return sum(self._freeable(t) for t in range(len(self._tiers)))

    def _room_beside(self, keys: Iterable[BlockKey]) -> int:
        """How many new blocks fit while every block of ``keys`` stays: :meth:`_room`, less
        the unpinned blocks of ``keys`` that are stored (a put keeps its own blocks: one
        evicted for another would leave a chain with a hole, which never hits past it)."""
        kept = {key for key in keys if key not in self._pins and self._locate(key) is not None}
        return self._room() - len(kept)

    def _freeable(self, t: int) -> int:
        """Slots of tier ``t`` that are not pinned nor staged (the top tier's staged puts
        hold slots): the most it can hold after evicting everything it may."""
        self._pins.expire()
        staged = self._staging.slots if t == 0 else 0
        return self._tiers[t].capacity - len(self._orders[t].held) - staged

    def _pin_changed(self, key: BlockKey, pinned: bool) -> None:
        """Take a key that gained its first pin out of every eviction walk, or put one
        that lost its last back (see :mod:`._held`)."""
        for tier, order in zip(self._tiers, self._orders, strict=True):
            if key in tier.index:
                if pinned:
                    order.hold(key)
                else:
                    order.release(key)

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        with contextlib.ExitStack() as scopes:
            for tier in self._tiers:
                scopes.enter_context(tier.batch())
            yield

    def _place_all(
        self,
        fresh: dict[BlockKey, int],
        sources: Sequence[BlockArray],
        source_at: Positions,
        protect: Container[BlockKey],
    ) -> bool:
        """Put every new block of a batch in the top tier at once, when it is host memory
        with a free slot for each: one index update, one copy per run of adjacent slots
        (a block at a time cost ~6 us of Python each). False, doing nothing, otherwise."""
        top = self._tiers[0]
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
                self._write_through(key, sources[i], protect)
        return True

    def _place_each(
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
                slot_at.append(self._tiers[placed].position(key))
                filling.append(sources[i])
                filling_at.append(None if source_at is None else source_at[i])
            if self.write_through and placed != self._persistent:
                self._write_through(key, sources[i], protect)
        # New blocks are protected from eviction, so nothing read their slots yet.
        copy_blocks(slots, filling, slot_at, filling_at)

    def _place(
        self, key: BlockKey, src: BlockArray, protect: Container[BlockKey]
    ) -> tuple[int, BlockArray | None]:
        """Put ``key`` in the highest tier with room: its index, and the slot to fill (or
        ``None`` when the tier stored ``src`` itself)."""
        for t, tier in enumerate(self._tiers):
            if self._make_room(t, protect):
                slot = tier.reserve(key)
                if slot is None:
                    tier.store(key, src)
                return t, slot
        raise StoreFull("no tier has room")  # unreachable: put checked the room first

    def _write_through(self, key: BlockKey, src: BlockArray, protect: Container[BlockKey]) -> None:
        assert self._persistent is not None
        if not self._make_room(self._persistent, protect):
            raise StoreFull("no room for the write-through copy")  # unreachable, see _room
        self._tiers[self._persistent].store(key, src)

    def _make_room(self, t: int, protect: Container[BlockKey]) -> bool:
        """Ensure tier ``t`` has a free slot, evicting one unpinned, unprotected block."""
        return self._make_room_for(t, 1, protect)

    def _make_room_for(self, t: int, count: int, protect: Container[BlockKey]) -> bool:
        """Free ``count`` slots of tier ``t`` (staged slots count as used), evicting the
        coldest unprotected blocks in one walk of its order (pinned blocks are not in it).
        Evicts nothing when it cannot free them all."""
        tier = self._tiers[t]
        used = len(tier) + (self._staging.slots if t == 0 else 0)
        need = used + count - tier.capacity
        if need <= 0:
            return True
        self._pins.expire()
        victims = []
        for key in self._orders[t].candidates():
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
        return key in protect.soft and not any(key in tier for tier in self._tiers[t + 1 :])

    def _evict(self, t: int, key: BlockKey, protect: Container[BlockKey]) -> None:
        """Move ``key`` from tier ``t`` one tier down, or out of the store from the last."""
        tier = self._tiers[t]
        self._tier_evictions[t] += 1
        below = t + 1
        if below < len(self._tiers) and (
            key in self._tiers[below] or self._demote(tier, below, key, protect)
        ):
            self._stats.demotions += 1
        elif all(key not in other for other in self._tiers if other is not tier):
            self._stats.evictions += 1
        tier.delete(key)

    def _demote(self, tier: Tier, below: int, key: BlockKey, protect: Container[BlockKey]) -> bool:
        if not self._make_room(below, protect):
            return False
        with tier.reading() as read:
            src = read(key)
            if src is None:
                self._stats.corrupt += 1
                return False
            self._tiers[below].store(key, src)
        return True

    def _use(self, key: BlockKey, data: BlockArray, protect: set[BlockKey]) -> None:
        """Record a hit on ``key`` and promote it to the top tier where policy says so."""
        t = self._locate(key)
        assert t is not None
        source = self._tiers[t]
        if t == 0 or not self.promote or self._pins.is_pinned(key):
            source.touch(key)
            return
        if source.persistent:  # copy up; the persistent copy stays and counts as used
            if not self._make_room(0, protect):
                source.touch(key)
                return
            source.touch(key)
        else:  # move up: free the slot first, so that the top tier's victim can swap into it
            source.delete(key)
            if not self._make_room(0, protect):
                source.store(key, data)
                return
        self._tiers[0].store(key, data)
        self._stats.promotions += 1

    def _fresh(self, keys: Sequence[BlockKey]) -> dict[BlockKey, int]:
        """The keys not stored yet, each with its first index; present keys count as used
        and repeats as duplicates."""
        fresh: dict[BlockKey, int] = {}
        top, lower = self._tiers[0], len(self._tiers) > 1
        top_index = top.index
        for i, key in enumerate(keys):  # per key: the top tier and the batch asked inline
            if key in top_index:
                top.touch(key)
            elif key in fresh:
                continue
            elif lower and (t := self._locate(key)) is not None:
                self._tiers[t].touch(key)
            else:
                fresh[key] = i
        self._stats.duplicates += len(keys) - len(fresh)
        return fresh

    def _drop_corrupt(self, keys: list[BlockKey]) -> None:
        """Drop blocks found bad, for good (see Tier.discard); one purge for them all."""
        shown = ", ".join(key.hex()[:16] for key in keys[:4])
        _log.warning(
            "%d corrupt block(s) dropped (%s): a miss, never wrong bytes", len(keys), shown
        )
        self._stats.corrupt += len(keys)
        self._stats.misses += len(keys)
        with self._batch():
            for key in keys:
                for tier in self._tiers:
                    if key in tier and tier.persistent:
                        tier.discard(key)

    def _withdraw(self, keys: Iterable[BlockKey]) -> None:
        """Take the blocks of a failed put or commit out of every tier. A disk delete
        stands even when its batch fails, so that failure hides nothing: it is dropped."""
        with contextlib.suppress(StoreError), self._batch():
            for key in keys:
                for tier in self._tiers:
                    if key in tier:
                        tier.delete(key)

    def _check_lift_room(self, top: SlotTier, protect: set[BlockKey], lifts: int) -> None:
        """Raise StoreFull unless the top tier can take ``lifts`` more blocks next to the
        ones of ``protect`` it holds: slots of staged puts and pinned blocks stay."""
        room = self._freeable(0) - (len(protect) - lifts)
        room += sum(key in self._orders[0].held for key in protect)  # counted once, as kept
        if lifts > room:
            raise StoreFull(
                f"{lifts} block(s) to copy up but the {top.name} tier can free at most "
                f"{max(room, 0)} slot(s) (the others are pinned or staged)"
            )

    def _lift(
        self, t: int, key: BlockKey, protect: set[BlockKey], early: Prefetched | None = None
    ) -> bool:
        """Copy ``key`` from tier ``t`` into the top tier (moving it out of a memory tier);
        False when it is found bad (it is dropped, and nothing was moved for it). A copy in
        ``early`` stands in for the read if it is still of the block's current version."""
        source = self._tiers[t]
        data = early.get(source, key) if early is not None else None
        if data is not None:
            self._store_lifted(key, data, protect)
        else:
            with source.reading() as read:
                data = read(key)
                if data is None:
                    self._drop_corrupt([key])
                    return False
                self._store_lifted(key, data, protect)
        if not source.persistent:
            source.delete(key)
        self._stats.promotions += 1
        return True

    def _store_lifted(self, key: BlockKey, data: BlockArray, protect: set[BlockKey]) -> None:
        if not self._make_room(0, protect):  # unreachable: pin_resident checked
            raise StoreFull(f"the {self._tiers[0].name} tier has no unpinned slot")
        self._tiers[0].store(key, data)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _lifetime(self, ttl: float | None) -> float:
        lifetime = self.pin_ttl if ttl is None else ttl
        if not lifetime > 0:
            raise ValueError(f"ttl must be positive, got {lifetime}")
        return lifetime

    def _release(self, lease: Lease) -> None:
        with self._lock:
            self._pins.release(lease.id, lease.keys)


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
