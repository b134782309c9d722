"""TieredStore: KV blocks in a stack of tiers (device, host, disk), deduplicated by key.

Placement. ``put`` stores a new block in the highest tier that has room or an evictable
block; a victim moves one tier down (demotion), recursively, and leaves the store from the
last tier. A ``get`` hit below the top tier is copied up (promotion): memory tiers are
exclusive (the block moves), a persistent tier keeps its copy so that evicting the block
from memory later costs no write. With ``write_through`` every new block is also written to
the persistent tier before ``put`` returns.

Contracts. Every public method validates all of its arguments before it changes anything:
a bad key, a wrong buffer size or a count mismatch raises a typed error and leaves the store
and the caller's buffers as they were. ``get`` leaves ``out`` untouched when it raises.
``put`` checks up front that the new blocks fit in the unpinned room of all tiers together
and raises :class:`StoreFull` otherwise. Pinned blocks (see :meth:`TieredStore.pin`) are
never evicted, demoted, promoted or removed. All methods are thread-safe (one lock; the
copies run under it, and numpy releases the GIL while copying).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Literal

import numpy as np

from ._buffers import BlockArray, as_sequence, copy_blocks, split_blocks
from ._disk import CheckReport, DiskTier
from ._errors import (
    BlockNotFound,
    BlockPinned,
    LeaseExpired,
    StoreClosed,
    StoreError,
    StoreFull,
    TierUnavailable,
)
from ._keys import KEY_BYTES, BlockKey, namespace_bytes, validate_key
from ._pins import DEFAULT_PIN_TTL_S, Lease, PinTable
from ._policy import EvictionPolicy, make_policy
from ._sizes import parse_size
from ._slab import DeviceSlab, HostSlab
from ._slots import SlotTier
from ._spill import spill
from ._staging import NO_OWNER, Staging, StagingTable
from ._stats import StoreStats, TierStats
from ._tier import Tier

PolicySpec = str | Callable[[], EvictionPolicy]
_KEY_LENGTHS = frozenset(KEY_BYTES.values())


_log = logging.getLogger("kvbridge.store")


class TieredStore:
    """A KV-block store over device, host and disk tiers (any subset, in that order).

    ``block_bytes`` is the fixed size of every block. Capacities are bytes or strings like
    ``"4GiB"``; a tier with capacity 0 is absent. ``disk_path`` with a ``disk_capacity``
    adds an LMDB tier that persists across restarts (see :class:`DiskTier` for ``disk_sync``).
    ``namespace`` is recorded in the disk tier; reopening it with another namespace or block
    size is refused. ``policy`` names an eviction policy (``"lru"``, ``"fifo"``) or is a
    factory; each tier gets its own instance. ``pin_ttl`` is the default pin lifetime in
    seconds. ``pin_host_memory``: ``"auto"`` pins the host slab through cupy when a GPU is
    present. ``prefault`` maps the host slab's pages at once (see :class:`HostSlab`).
    """

    def __init__(
        self,
        block_bytes: int,
        *,
        host_capacity: int | str,
        disk_path: str | os.PathLike[str] | None = None,
        disk_capacity: int | str = 0,
        device_capacity: int | str = 0,
        device_id: int = 0,
        policy: PolicySpec = "lru",
        namespace: bytes | str = b"",
        disk_sync: bool = False,
        write_through: bool = False,
        promote: bool = True,
        pin_ttl: float = DEFAULT_PIN_TTL_S,
        pin_host_memory: bool | Literal["auto"] = "auto",
        prefault: bool = False,
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        make_policy(policy)  # reject an unknown name before allocating anything
        device_slots = _slots("device_capacity", device_capacity, block_bytes)
        host_slots = _slots("host_capacity", host_capacity, block_bytes)
        disk_blocks = _slots("disk_capacity", disk_capacity, block_bytes)
        if disk_path is not None and not disk_blocks:
            raise ValueError("disk_path needs a disk_capacity of at least one block")
        if disk_blocks and disk_path is None:
            raise ValueError("disk_capacity needs a disk_path")
        ns = namespace_bytes(namespace)

        tiers: list[Tier] = []
        try:
            if device_slots:
                memory = DeviceSlab(device_slots, block_bytes, device_id=device_id)
                tiers.append(SlotTier("device", memory, make_policy(policy)))
            if host_slots:
                slab = HostSlab(host_slots, block_bytes, pin=pin_host_memory, prefault=prefault)
                tiers.append(SlotTier("host", slab, make_policy(policy)))
            if disk_path is not None:
                disk = DiskTier(
                    disk_path,
                    block_bytes,
                    disk_blocks,
                    policy=make_policy(policy),
                    namespace=ns,
                    sync=disk_sync,
                )
                tiers.append(disk)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        self._setup(tiers, write_through=write_through, promote=promote, pin_ttl=pin_ttl)

    @classmethod
    def from_tiers(
        cls,
        tiers: Sequence[Tier],
        *,
        write_through: bool = False,
        promote: bool = True,
        pin_ttl: float = DEFAULT_PIN_TTL_S,
    ) -> TieredStore:
        """Build a store over tiers made by the caller, highest first (all one block size)."""
        store = cls.__new__(cls)
        store._setup(list(tiers), write_through=write_through, promote=promote, pin_ttl=pin_ttl)
        return store

    def _setup(
        self, tiers: list[Tier], *, write_through: bool, promote: bool, pin_ttl: float
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
        self._tiers = tiers
        self._persistent: int | None = persistent[-1] if persistent else None
        self.write_through = write_through
        self.promote = promote
        self.pin_ttl = pin_ttl
        self._lock = threading.RLock()
        self._pins = PinTable()
        top = tiers[0]
        self._staging = StagingTable(
            top.capacity if isinstance(top, SlotTier) else 0, clock=self._pins.clock
        )
        self._stats = StoreStats()
        self._tier_evictions = [0] * len(tiers)
        self._closed = False

    # -- queries -----------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, highest first (for inspection; mutate them only through the store)."""
        return tuple(self._tiers)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present in any tier. Does not count as a use."""
        checked = _keys(keys)
        with self._lock:
            self._check_open()
            return [self._locate(key) is not None for key in checked]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present: the cache hit of a chained prefix, in blocks.

        Side-effect free: it neither counts as a use nor pins. Pin the matched blocks
        before reading them if other threads may evict them meanwhile.
        """
        checked = _keys(keys)
        with self._lock:
            self._check_open()
            indexes = [tier.index for tier in self._tiers]
            for count, key in enumerate(checked):
                for index in indexes:
                    if key in index:
                        break
                else:
                    return count
            return len(checked)

    def stats(self) -> StoreStats:
        """A snapshot of the counters and of each tier's occupancy."""
        with self._lock:
            snapshot = StoreStats(**{**self._stats.__dict__, "tiers": []})
            snapshot.tiers = [
                TierStats(
                    name=tier.name,
                    blocks=len(tier),
                    bytes=len(tier) * self.block_bytes,
                    capacity_blocks=tier.capacity,
                    capacity_bytes=tier.capacity * self.block_bytes,
                    evictions=evictions,
                )
                for tier, evictions in zip(self._tiers, self._tier_evictions, strict=True)
            ]
            return snapshot

    # -- put / get ---------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: object) -> list[bool]:
        """Store each block under its key; return, per key, whether it was newly stored.

        ``blocks`` is one contiguous buffer of ``len(keys) * block_bytes`` bytes or a
        sequence of ``len(keys)`` buffers of ``block_bytes`` bytes (numpy, memoryview,
        bytes, cupy...). A key already present anywhere (or earlier in the same call) is not
        stored again and counts as a use. Raises :class:`StoreFull`, storing nothing, when
        the new blocks do not fit in the unpinned room of the tiers or the disk refuses them
        (full): all or nothing, no block of a failed put stays visible.
        """
        checked = _keys(keys)
        sources, source_at = split_blocks(blocks, len(checked), self.block_bytes, writable=False)
        with self._lock:
            self._check_open()
            stored = [False] * len(checked)
            fresh = self._fresh(checked)
            if not fresh:
                return stored
            room = self._room(len(fresh))
            if len(fresh) > room:
                raise StoreFull(
                    f"{len(fresh)} new block(s) but the tiers hold at most {room} more "
                    f"({len(self._pins.pinned())} pinned block(s) cannot be evicted)"
                )
            protect = fresh.keys()
            slots: list[BlockArray] = []  # memory slots to fill, and what goes in them
            slot_at: list[int | None] = []
            filling: list[BlockArray] = []
            filling_at: list[int | None] = []
            try:
                with self._batch():
                    # One walk frees the top tier for the whole batch when it can (else each
                    # block finds its tier below); per-block walks past pinned blocks were
                    # O(pinned x batch).
                    self._make_room_for(0, len(fresh), protect)
                    for key, i in fresh.items():
                        placed, slot = self._place(key, sources[i], protect)
                        if slot is not None:
                            slots.append(slot)
                            slot_at.append(self._tiers[placed].position(key))
                            filling.append(sources[i])
                            filling_at.append(None if source_at is None else source_at[i])
                        if self.write_through and placed != self._persistent:
                            self._write_through(key, sources[i], protect)
                        stored[i] = True
                    # New blocks are protected from eviction, so nothing read their slots yet.
                    copy_blocks(slots, filling, slot_at, filling_at)
            except BaseException:
                self._withdraw(fresh)  # blocks moved to make room stay where they went
                raise
            self._stats.puts += len(fresh)
            self._stats.bytes_in += len(fresh) * self.block_bytes
            return stored

    def get(self, keys: Sequence[bytes], out: object) -> None:
        """Fill ``out`` with the blocks of ``keys`` (same forms as ``put``'s ``blocks``).

        Hits below the top tier are promoted (unless ``promote=False`` or pinned). Raises
        :class:`BlockNotFound` naming every missing key, with ``out`` untouched. A block that
        fails its checksum is dropped and reported missing: never wrong bytes.
        """
        checked = _keys(keys)
        targets, target_at = split_blocks(out, len(checked), self.block_bytes, writable=True)
        with self._lock:
            self._check_open()
            found = [self._locate(key) for key in checked]
            missing = [key for key, t in zip(checked, found, strict=True) if t is None]
            if missing:
                self._stats.misses += len(missing)
                raise BlockNotFound(missing)
            where = [t for t in found if t is not None]
            with contextlib.ExitStack() as scopes:
                readers = {t: scopes.enter_context(self._tiers[t].reading()) for t in set(where)}
                sources: list[BlockArray | None] = [
                    readers[t](key) for key, t in zip(checked, where, strict=True)
                ]
                corrupt = [key for key, src in zip(checked, sources, strict=True) if src is None]
                if not corrupt:
                    source_at = [
                        self._tiers[t].position(key) for key, t in zip(checked, where, strict=True)
                    ]
                    copy_blocks(targets, sources, target_at, source_at)
            if corrupt:
                self._drop_corrupt(corrupt)
                raise BlockNotFound(corrupt)
            self._stats.hits += len(checked)
            self._stats.bytes_out += len(checked) * self.block_bytes
            protect = set(checked)
            # Promotion is best effort: a disk that refuses a demoted block ends it (what
            # moved stays consistent, see DiskTier.batch); the hit stands.
            with contextlib.suppress(StoreError), self._batch():
                for key, dst in zip(checked, targets, strict=True):
                    self._use(key, dst, protect)

    # -- staged puts and resident pins (what a cache server hands to remote clients) -----

    def stage(
        self, keys: Sequence[bytes], *, ttl: float | None = None, owner: int = NO_OWNER
    ) -> tuple[int, list[int | None]]:
        """Reserve top-tier slots for the keys not yet stored, for someone else to fill.

        ``owner`` (a cache server's session number) is who may write the slots remotely:
        see :meth:`admit_writes`.

        Returns a lease id and, per key, the slot to write (``None`` for a key already
        stored, which counts as a use, or repeated earlier in ``keys``). The blocks become
        visible only with :meth:`commit`; :meth:`abort`, or the lease expiring after ``ttl``
        seconds (default ``pin_ttl``), gives the slots back. The lease id is 0 when there
        is nothing to fill. Raises :class:`StoreFull`, staging nothing, when the top tier
        cannot free enough unpinned slots.
        """
        checked = _keys(keys)
        lifetime = self._lifetime(ttl)
        with self._lock:
            self._check_open()
            top = self._slot_top()
            self._sweep_staged()
            fresh = self._fresh(checked)
            positions: list[int | None] = [None] * len(checked)
            if not fresh:
                return 0, positions
            room = top.capacity - self._staging.slots - len(self._pins)  # at least this
            if len(fresh) > room:  # count exactly: only pinned keys held by this tier count
                pinned_here = sum(key in top for key in self._pins.pinned())
                room = top.capacity - self._staging.slots - pinned_here
            if len(fresh) > room:
                raise StoreFull(
                    f"{len(fresh)} new block(s) but the {top.name} tier can free at most "
                    f"{max(room, 0)} slot(s) ({top.capacity - self._staging.slots - room} "
                    f"pinned, {self._staging.slots} staged)"
                )
            slots: list[int] = []
            with self._batch():
                if not self._make_room_for(0, len(fresh), fresh.keys()):
                    raise StoreFull("no room")  # unreachable: room was checked above
                for i in fresh.values():
                    slots.append(top.take_slot())
                    positions[i] = slots[-1]
            staging = self._staging.add(tuple(fresh), tuple(slots), lifetime, owner)
            return staging.id, positions

    def commit(self, lease_id: int) -> int:
        """Make a staged put visible; return how many blocks it added (a key stored by
        someone else meanwhile is not stored twice). Raises :class:`LeaseExpired` when the
        lease is unknown or expired: the slots are then reclaimed and nothing is stored.

        All or nothing: when the write-through copy cannot be made (the disk tier holds
        fewer blocks, the disk is full) it raises :class:`StoreFull`, no block of the put
        stays visible, and the staged put ends (its slots go back).
        """
        with self._lock:
            self._check_open()
            staging = self._staging.pop(lease_id)
            top = self._slot_top()
            if staging is None:
                raise LeaseExpired(f"staged put {lease_id} is unknown, committed or expired")
            if staging.deadline <= self._pins.clock():
                self._give_back(staging, [])
                raise LeaseExpired(f"staged put {lease_id} expired before its commit")
            if self.write_through and self._persistent != 0:
                fresh = [key for key in dict.fromkeys(staging.keys) if self._locate(key) is None]
                room = self._room(len(fresh))
                if len(fresh) > room:
                    self._give_back(staging, [])
                    raise StoreFull(
                        f"{len(fresh)} new block(s) but the disk tier holds at most {room} "
                        "more for their write-through copies"
                    )
            protect = set(staging.keys)
            adopted: dict[BlockKey, int] = {}
            try:
                with self._batch():
                    for key, slot in zip(staging.keys, staging.slots, strict=True):
                        where = self._locate(key)
                        if where is not None:
                            self._tiers[where].touch(key)
                            continue
                        top.adopt(key, slot)
                        adopted[key] = slot
                        if self.write_through and self._persistent != 0:
                            self._write_through(key, top.memory.slot(slot), protect)
            except BaseException:
                self._give_back(staging, list(adopted))
                raise
            taken = set(adopted.values())
            self._free_slots([slot for slot in staging.slots if slot not in taken])
            self._stats.puts += len(adopted)
            self._stats.bytes_in += len(adopted) * self.block_bytes
            return len(adopted)

    def abort(self, lease_id: int) -> None:
        """Give back the slots of a staged put (unknown or expired leases are fine); slots
        still being written come back once those writes are done."""
        with self._lock:
            staging = self._staging.pop(lease_id)
            if staging is not None:
                self._free_slots(self._staging.freeable(staging))

    def admit_writes(
        self, owner: int, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """Per slot range ``first..last`` of the top tier: whether ``owner`` may write it
        now (it lies in slots of open staged puts of that owner). When all may, the staged
        puts are held until :meth:`end_writes` with the returned ids: a staged put that ends
        meanwhile (abort, expiry) keeps its slots out of use until then."""
        with self._lock:
            return self._staging.admit(owner, first, last)

    def end_writes(self, leases: Sequence[int]) -> None:
        """Writes admitted by :meth:`admit_writes` have landed or failed."""
        with self._lock:
            self._free_slots(self._staging.release(leases))

    def staging_busy(self, lease_id: int) -> bool:
        """Whether admitted writes into the staged put's slots are still in flight."""
        with self._lock:
            return self._staging.busy(lease_id)

    def pin_resident(
        self, keys: Sequence[bytes], *, ttl: float | None = None
    ) -> tuple[Lease, list[int]]:
        """Pin blocks in the top memory tier, copying up those held lower; return the lease
        and each key's slot there, for someone else to read. Counts as a hit on every key.

        Pins nothing when it raises: :class:`BlockNotFound` naming every absent key, or
        every block found bad on the way (dropped for good; the others copied up stay
        there, and blocks moved to make room stay where they went), and
        :class:`StoreFull`, before anything moves, when the top tier cannot free enough
        unpinned slots.
        """
        checked = _keys(keys)
        lifetime = self._lifetime(ttl)
        with self._lock:
            self._check_open()
            top = self._slot_top()
            missing = [key for key in checked if self._locate(key) is None]
            if missing:
                self._stats.misses += len(missing)
                raise BlockNotFound(missing)
            protect = set(checked)
            lifts = [key for key in dict.fromkeys(checked) if key not in top]
            self._check_lift_room(top, protect, len(lifts))
            corrupt: list[BlockKey] = []
            with self._batch():
                # Room for every lift in one walk (best effort: a copy out of a memory
                # tier frees a slot there too); _lift then finds a free slot.
                self._make_room_for(0, len(lifts), protect)
                for key in dict.fromkeys(checked):
                    t = self._locate(key)
                    if t == 0:
                        top.touch(key)
                        continue
                    assert t is not None
                    if not self._lift(t, key, protect):
                        corrupt.append(key)
            if corrupt:
                raise BlockNotFound(corrupt)
            lease_id, deadline = self._pins.add(checked, lifetime)
            self._stats.hits += len(checked)
            self._stats.bytes_out += len(checked) * self.block_bytes
            lease = Lease(self._release, self._pins.clock, lease_id, tuple(checked), deadline)
            return lease, [top.position(key) for key in checked]

    # -- pins and removal --------------------------------------------------------------

    def pin(self, keys: Sequence[bytes], *, ttl: float | None = None) -> Lease:
        """Pin present blocks for ``ttl`` seconds (default ``pin_ttl``; ``math.inf`` for ever).

        Returns a :class:`Lease`; ``with store.pin(keys): ...`` releases it on exit. Raises
        :class:`BlockNotFound` (pinning nothing) if a key is absent.
        """
        checked = _keys(keys)
        lifetime = self.pin_ttl if ttl is None else ttl
        if not lifetime > 0:
            raise ValueError(f"ttl must be positive, got {lifetime}")
        with self._lock:
            self._check_open()
            missing = [key for key in checked if self._locate(key) is None]
            if missing:
                raise BlockNotFound(missing)
            lease_id, deadline = self._pins.add(checked, lifetime)
            return Lease(self._release, self._pins.clock, lease_id, tuple(checked), deadline)

    def hold(self, keys: Sequence[bytes]) -> Lease:
        """Pin keys the caller knows are present and valid (already pinned by a lease of
        its own) until released: :meth:`pin` without its checks, for a hot path."""
        held = tuple(BlockKey(key) for key in keys)
        with self._lock:
            lease_id, deadline = self._pins.add(held, math.inf)
            return Lease(self._release, self._pins.clock, lease_id, held, deadline)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release one pin on each key (the one that expires first); unpinned keys are fine."""
        checked = _keys(keys)
        with self._lock:
            self._pins.release_one(checked)

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove blocks from every tier; return whether each key was present.

        Raises :class:`BlockPinned`, removing nothing, if any present key is pinned.
        """
        checked = _keys(keys)
        with self._lock:
            self._check_open()
            pinned = [key for key in checked if self._pins.is_pinned(key)]
            if pinned:
                raise BlockPinned(pinned)
            removed = []
            with self._batch():
                for key in checked:
                    holders = [tier for tier in self._tiers if key in tier]
                    for tier in holders:
                        tier.delete(key)
                    removed.append(bool(holders))
            self._stats.removed += sum(removed)
            return removed

    def check(self, *, repair: bool = False) -> CheckReport:
        """Verify every block of the persistent tier against its checksum."""
        with self._lock:
            self._check_open()
            if self._persistent is None:
                return CheckReport()
            disk = self._tiers[self._persistent]
            assert isinstance(disk, DiskTier)
            return disk.check(repair=repair)

    def close(self) -> None:
        """Close every tier (the disk tier is synced). Idempotent. With a disk tier, the
        blocks held only in memory are first written to it (newest first, as many as its
        free room takes: it evicts nothing for them), so that a reopened store serves them:
        ``close()`` costs one disk write per memory-only block (see ``_spill``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._persistent is not None:
                    spill(self._tiers, self._tiers[self._persistent])
            finally:
                for tier in self._tiers:
                    tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the store is closed")

    def _locate(self, key: BlockKey) -> int | None:
        """Index of the highest tier holding ``key``."""
        for t, tier in enumerate(self._tiers):
            if key in tier.index:
                return t
        return None

    def _room(self, needed: int) -> int:
        """How many new blocks fit (every slot not held by a pin or a staged put can be
        freed), counted exactly only when a cheap lower bound says fewer than ``needed``:
        walking every pinned key on every put cost O(pins)."""
        if self.write_through:
            assert self._persistent is not None
            tiers = [self._tiers[self._persistent]]
        else:
            tiers = self._tiers
        staged = self._staging.slots if tiers[0] is self._tiers[0] else 0
        capacity = sum(tier.capacity for tier in tiers) - staged
        if capacity - len(self._pins) * len(tiers) >= needed:
            return capacity - len(self._pins) * len(tiers)
        pinned = self._pins.pinned()
        return capacity - sum(sum(key in tier for key in pinned) for tier in tiers)

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        with contextlib.ExitStack() as scopes:
            for tier in self._tiers:
                scopes.enter_context(tier.batch())
            yield

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
        """Free ``count`` slots of tier ``t`` (staged slots count as used), evicting
        unpinned, unprotected blocks found in one walk of the policy's candidates (one walk
        per block cost O(pinned) each time: a policy that ranks pinned blocks coldest made
        a batch O(pinned x batch)). Evicts nothing when it cannot free them all."""
        tier = self._tiers[t]
        used = len(tier) + (self._staging.slots if t == 0 else 0)
        need = used + count - tier.capacity
        if need <= 0:
            return True
        victims = []
        for key in tier.policy.candidates():
            if key not in protect and not self._pins.is_pinned(key):
                victims.append(key)
                if len(victims) == need:
                    break
        else:
            return False
        for key in victims:
            self._evict(t, key, protect)
        return True

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
        for i, key in enumerate(keys):
            if key in fresh:
                continue
            where = self._locate(key)
            if where is None:
                fresh[key] = i
            else:
                self._tiers[where].touch(key)
        self._stats.duplicates += len(keys) - len(fresh)
        return fresh

    def _lifetime(self, ttl: float | None) -> float:
        lifetime = self.pin_ttl if ttl is None else ttl
        if not lifetime > 0:
            raise ValueError(f"ttl must be positive, got {lifetime}")
        return lifetime

    def _slot_top(self) -> SlotTier:
        top = self._tiers[0]
        if not isinstance(top, SlotTier):
            raise TierUnavailable("staged puts and resident pins need a memory top tier")
        return top

    def _sweep_staged(self) -> None:
        """Reclaim the slots of staged puts whose lease expired (not yet those being written)."""
        for staging in self._staging.expired():
            self._free_slots(self._staging.freeable(staging))

    def _free_slots(self, slots: Sequence[int]) -> None:
        if slots and not self._closed:
            top = self._tiers[0]
            assert isinstance(top, SlotTier)
            for slot in slots:
                top.free_slot(slot)

    def _check_lift_room(self, top: SlotTier, protect: set[BlockKey], lifts: int) -> None:
        """Raise StoreFull unless the top tier can take ``lifts`` more blocks next to the
        ones of ``protect`` it holds: slots of staged puts and pinned blocks stay."""
        room = top.capacity - self._staging.slots - (len(protect) - lifts)
        if lifts <= room - len(self._pins):  # a cheap bound first, as in _room
            return
        room -= sum(key in top and key not in protect for key in self._pins.pinned())
        if lifts > room:
            raise StoreFull(
                f"{lifts} block(s) to copy up but the {top.name} tier can free at most "
                f"{max(room, 0)} slot(s) (the others are pinned or staged)"
            )

    def _lift(self, t: int, key: BlockKey, protect: set[BlockKey]) -> bool:
        """Copy ``key`` from tier ``t`` into the top tier (moving it out of a memory tier);
        False when it is found bad (it is dropped, and nothing was moved for it)."""
        source = self._tiers[t]
        with source.reading() as read:
            data = read(key)
            if data is None:
                self._drop_corrupt([key])
                return False
            if not self._make_room(0, protect):  # unreachable: pin_resident checked
                raise StoreFull(f"the {self._tiers[0].name} tier has no unpinned slot")
            self._tiers[0].store(key, data)
        if not source.persistent:
            source.delete(key)
        self._stats.promotions += 1
        return True

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

    def _give_back(self, staging: Staging, adopted: Sequence[BlockKey]) -> None:
        """End a staged put that is not committed: the blocks it adopted leave every tier
        and all its slots go back (once no admitted write into them is in flight)."""
        top = self._slot_top()
        for key in adopted:
            top.disown(key)
        self._withdraw(adopted)
        self._free_slots(self._staging.freeable(staging))

    def _release(self, lease: Lease) -> None:
        with self._lock:
            self._pins.release(lease.id, lease.keys)


def _keys(keys: Sequence[bytes]) -> Sequence[BlockKey]:
    """Validate every key (a 16- or 32-byte ``bytes``) before anything else happens."""
    checked = as_sequence(keys, "keys")
    for key in checked:
        if type(key) is not bytes or len(key) not in _KEY_LENGTHS:
            validate_key(key)  # raises InvalidKey with the details
    return checked


def _slots(what: str, capacity: int | str, block_bytes: int) -> int:
    size = parse_size(capacity)
    if 0 < size < block_bytes:
        raise ValueError(f"{what}={capacity!r} is smaller than one block ({block_bytes} bytes)")
    return size // block_bytes
