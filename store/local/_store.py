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

The store holds one :class:`Placement` (``_placement``: the tiers, their orders, the pins and
the lock, and the placement cascade: room, place, evict, demote, promote, lift) and is the
local API over it; ``_store_build`` builds the tiers from the settings. What a cache server
hands to remote clients (staged puts, resident pins, write admission) is a second object
over the same placement, :class:`RemoteAccess` (``_remote``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Literal

from ..._closing import Closing
from .._buffers import BlockArray, copy_blocks, split_blocks
from .._errors import (
    BlockNotFound,
    BlockPinned,
    StoreError,
    StoreFull,
)
from .._keys import BlockKey, check_keys
from .._lease import Lease
from .._stats import StoreStats, TierStats
from ._build import DiskBound, PolicySpec, build_tiers
from ._changes import Report
from ._pins import DEFAULT_PIN_TTL_S
from ._placement import Keep, Placement
from ._spill import spill
from ._tier import Tier
from .disk._tier import CheckReport, DiskTier

_log = logging.getLogger("kvbridge.store")


class TieredStore(Closing):
    """A KV-block store over device, host and disk tiers (any subset, in that order).

    ``block_bytes`` is the fixed size of every block. Capacities are bytes or strings like
    ``"4GiB"``; a tier with capacity 0 is absent. ``disk_path`` with a ``disk_capacity``
    adds an LMDB tier that persists across restarts (see :class:`DiskTier` for ``disk_sync``).
    ``disk_bound``: ``"blocks"`` (the default) holds ``disk_capacity`` bytes of blocks, and
    LMDB's files take more (its pages and records: about 1.06x for 64 KiB blocks, 2x for
    4 KiB ones, plus one transaction's room); ``"files"`` keeps the files themselves within
    ``disk_capacity`` (fewer blocks fit), as the cache server does.
    ``namespace`` is recorded in the disk tier; reopening it with another namespace or block
    size is refused. ``policy`` names an eviction policy (``"lru"``, ``"fifo"``) or is a
    factory; each tier gets its own instance. ``pin_ttl`` is the default pin lifetime in
    seconds. ``pin_host_memory``: ``"auto"`` pins the host slab through cupy when a GPU is
    present. ``prefault`` maps the host slab's pages at once (see :class:`HostSlab`).
    ``clock`` (``time.monotonic``) times pins and staged puts: tests pass a fake one.
    """

    def __init__(
        self,
        block_bytes: int,
        *,
        host_capacity: int | str,
        disk_path: str | os.PathLike[str] | None = None,
        disk_capacity: int | str = 0,
        disk_bound: DiskBound = "blocks",
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        tiers = build_tiers(
            block_bytes,
            host_capacity=host_capacity,
            disk_path=disk_path,
            disk_capacity=disk_capacity,
            disk_bound=disk_bound,
            device_capacity=device_capacity,
            device_id=device_id,
            policy=policy,
            namespace=namespace,
            disk_sync=disk_sync,
            pin_host_memory=pin_host_memory,
            prefault=prefault,
        )
        self._setup(
            tiers, write_through=write_through, promote=promote, pin_ttl=pin_ttl, clock=clock
        )

    @classmethod
    def from_tiers(
        cls,
        tiers: Sequence[Tier],
        *,
        write_through: bool = False,
        promote: bool = True,
        pin_ttl: float = DEFAULT_PIN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> TieredStore:
        """Build a store over tiers made by the caller, highest first (all one block size)."""
        store = cls.__new__(cls)
        store._setup(
            list(tiers), write_through=write_through, promote=promote, pin_ttl=pin_ttl, clock=clock
        )
        return store

    def _setup(
        self,
        tiers: list[Tier],
        *,
        write_through: bool,
        promote: bool,
        pin_ttl: float,
        clock: Callable[[], float],
    ) -> None:
        self._placement = Placement(
            tiers, write_through=write_through, promote=promote, pin_ttl=pin_ttl, clock=clock
        )
        self.block_bytes: int = self._placement.block_bytes

    @property
    def placement(self) -> Placement:
        """The state and cascade under the store, for :class:`RemoteAccess` (a cache
        server's staged puts and resident pins over this store): mutate it only under its
        lock, through its methods."""
        return self._placement

    @property
    def write_through(self) -> bool:
        return self._placement.write_through

    @property
    def promote(self) -> bool:
        return self._placement.promote

    @property
    def pin_ttl(self) -> float:
        return self._placement.pin_ttl

    @property
    def clock(self) -> Callable[[], float]:
        """Times pins and staged puts (``time.monotonic`` unless a test gives its own)."""
        return self._placement.clock

    # -- queries -----------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers, highest first (for inspection; mutate them only through the store)."""
        return tuple(self._placement.tiers)

    def watch(self, report: Report | None) -> None:
        """Hear of every key that enters or leaves the store: after each operation,
        ``report([(key, tier name or None), ...])`` runs under the store's lock (it must
        only hand the changes on). A key whose block moved between tiers is reported with
        its new tier; one the operation did not keep (a failed batch) is not reported as
        added. ``None`` stops it."""
        self._placement.watch(report)

    def keys(self) -> list[BlockKey]:
        """Every key the store holds, in any tier (a copy, taken under the lock)."""
        placement = self._placement
        with placement.lock:
            placement.check_open()
            if len(placement.tiers) == 1:
                return list(placement.tiers[0].keys())
            return list(set().union(*(tier.keys() for tier in placement.tiers)))

    def where(self, keys: Sequence[BlockKey]) -> list[str | None]:
        """The name of the highest tier holding each key (``None``: none does), as the
        store's change reports name it. Does not count as a use."""
        placement = self._placement
        with placement.lock:
            placement.check_open()
            return [placement.where(key) for key in keys]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is present in any tier. Does not count as a use."""
        checked = check_keys(keys)
        with self._placement.lock:
            self._placement.check_open()
            indexes = [tier.index for tier in self._placement.tiers]
            if len(indexes) == 1:  # a server's usual store: one lookup per key, inline
                (index,) = indexes
                return [key in index for key in checked]
            return [any(key in index for index in indexes) for key in checked]

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are present: the cache hit of a chained prefix, in blocks.

        Side-effect free: it neither counts as a use nor pins. Pin the matched blocks
        before reading them if other threads may evict them meanwhile.
        """
        checked = check_keys(keys)
        with self._placement.lock:
            self._placement.check_open()
            indexes = [tier.index for tier in self._placement.tiers]
            for count, key in enumerate(checked):
                for index in indexes:
                    if key in index:
                        break
                else:
                    return count
            return len(checked)

    def stats(self) -> StoreStats:
        """A snapshot of the counters and of each tier's occupancy."""
        placement = self._placement
        with placement.lock:
            snapshot = StoreStats(**{**self._placement.stats.__dict__, "tiers": []})
            snapshot.tiers = [
                TierStats(
                    name=tier.name,
                    blocks=len(tier),
                    bytes=len(tier) * self.block_bytes,
                    capacity_blocks=tier.capacity,
                    capacity_bytes=tier.capacity * self.block_bytes,
                    evictions=evictions,
                )
                for tier, evictions in zip(
                    self._placement.tiers, self._placement.tier_evictions, strict=True
                )
            ]
            return snapshot

    # -- put / get ---------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: object) -> list[bool]:
        """Store each block under its key; return, per key, whether it was newly stored.

        ``blocks`` is one contiguous buffer of ``len(keys) * block_bytes`` bytes or a
        sequence of ``len(keys)`` buffers of ``block_bytes`` bytes (numpy, memoryview,
        bytes, cupy...). A key already present anywhere (or earlier in the same call) is not
        stored again and counts as a use. Raises :class:`StoreFull`, storing nothing, when
        the new blocks do not fit in the unpinned room of the tiers beside the put's stored
        ones, or the disk refuses them (full): all or nothing, no block of a failed put
        stays visible, and after a put every one of its keys is stored (none is evicted to
        make room for another of the same put).
        """
        checked = check_keys(keys)
        sources, source_at = split_blocks(blocks, len(checked), self.block_bytes, writable=False)
        with self._placement.lock:
            self._placement.check_open()
            stored = [False] * len(checked)
            fresh = self._placement.fresh(checked)
            if not fresh:
                return stored
            room = self._placement.room_beside(checked)
            if len(fresh) > room:
                raise StoreFull(
                    f"{len(fresh)} new block(s) but the tiers hold at most {max(room, 0)} "
                    f"more beside the put's stored ones ({len(self._placement.pins.pinned())} "
                    "pinned block(s) cannot be evicted)"
                )
            protect = Keep(fresh.keys(), set(checked))  # none of the put for another of it
            try:
                with self._placement.batch():
                    # One walk frees the top tier for the whole batch when it can (else each
                    # block finds its tier below); per-block walks past pinned blocks were
                    # O(pinned x batch).
                    self._placement.make_room_for(0, len(fresh), protect)
                    if not self._placement.place_all(fresh, sources, source_at, protect):
                        self._placement.place_each(fresh, sources, source_at, protect)
            except BaseException:
                self._placement.withdraw(fresh)  # blocks moved to make room stay where they went
                raise
            for i in fresh.values():
                stored[i] = True
            self._placement.stats.puts += len(fresh)
            self._placement.stats.bytes_in += len(fresh) * self.block_bytes
            return stored

    def get(self, keys: Sequence[bytes], out: object) -> None:
        """Fill ``out`` with the blocks of ``keys`` (same forms as ``put``'s ``blocks``).

        Hits below the top tier are promoted (unless ``promote=False`` or pinned). Raises
        :class:`BlockNotFound` naming every missing key, with ``out`` untouched. A block that
        fails its checksum is dropped and reported missing: never wrong bytes.
        """
        checked = check_keys(keys)
        targets, target_at = split_blocks(out, len(checked), self.block_bytes, writable=True)
        with self._placement.lock:
            self._placement.check_open()
            found = [self._placement.locate(key) for key in checked]
            missing = [key for key, t in zip(checked, found, strict=True) if t is None]
            if missing:
                self._placement.stats.misses += len(missing)
                raise BlockNotFound(missing)
            where = [t for t in found if t is not None]
            with contextlib.ExitStack() as scopes:
                readers = {
                    t: scopes.enter_context(self._placement.tiers[t].reading()) for t in set(where)
                }
                sources: list[BlockArray | None] = [
                    readers[t](key) for key, t in zip(checked, where, strict=True)
                ]
                corrupt = [key for key, src in zip(checked, sources, strict=True) if src is None]
                if not corrupt:
                    source_at = [
                        self._placement.tiers[t].position(key)
                        for key, t in zip(checked, where, strict=True)
                    ]
                    copy_blocks(targets, sources, target_at, source_at)
            if corrupt:
                self._placement.drop_corrupt(corrupt)
                raise BlockNotFound(corrupt)
            self._placement.stats.hits += len(checked)
            self._placement.stats.bytes_out += len(checked) * self.block_bytes
            protect = set(checked)
            # Promotion is best effort: a disk that refuses a demoted block ends it (what
            # moved stays consistent, see DiskTier.batch); the hit stands.
            with contextlib.suppress(StoreError), self._placement.batch():
                for key, dst in zip(checked, targets, strict=True):
                    self._placement.use(key, dst, protect)

    # -- pins and removal --------------------------------------------------------------

    def pin(self, keys: Sequence[bytes], *, ttl: float | None = None) -> Lease:
        """Pin present blocks for ``ttl`` seconds (default ``pin_ttl``; ``math.inf`` for ever).

        Returns a :class:`Lease`; ``with store.pin(keys): ...`` releases it on exit. Raises
        :class:`BlockNotFound` (pinning nothing) if a key is absent.
        """
        checked = check_keys(keys)
        lifetime = self.pin_ttl if ttl is None else ttl
        if not lifetime > 0:
            raise ValueError(f"ttl must be positive, got {lifetime}")
        with self._placement.lock:
            self._placement.check_open()
            missing = [key for key in checked if self._placement.locate(key) is None]
            if missing:
                raise BlockNotFound(missing)
            lease_id, deadline = self._placement.pins.add(checked, lifetime)
            return Lease(
                self._placement.release,
                self._placement.pins.clock,
                lease_id,
                tuple(checked),
                deadline,
            )

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release one pin on each key (the one that expires first); unpinned keys are fine."""
        checked = check_keys(keys)
        with self._placement.lock:
            self._placement.pins.release_one(checked)

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove blocks from every tier; return whether each key was present.

        Raises :class:`BlockPinned`, removing nothing, if any present key is pinned.
        """
        checked = check_keys(keys)
        with self._placement.lock:
            self._placement.check_open()
            pinned = [key for key in checked if self._placement.pins.is_pinned(key)]
            if pinned:
                raise BlockPinned(pinned)
            return self._delete(checked)

    def clear(self) -> int:
        """Remove every block that no lease pins, from every tier; return how many."""
        with self._placement.lock:
            self._placement.check_open()
            held: set[BlockKey] = set()
            for tier in self._placement.tiers:
                held.update(tier.keys())
            return sum(self._delete([k for k in held if not self._placement.pins.is_pinned(k)]))

    def _delete(self, keys: Sequence[BlockKey]) -> list[bool]:
        removed = []
        with self._placement.batch():
            for key in keys:
                holders = [tier for tier in self._placement.tiers if key in tier]
                for tier in holders:
                    tier.delete(key)
                removed.append(bool(holders))
        self._placement.stats.removed += sum(removed)
        return removed

    def verify(self, keys: Sequence[bytes]) -> list[bool]:
        """A reader found these blocks bad once they landed (``_checksums``): check every
        stored copy of each again and drop the bad ones (a pinned one stays until its
        readers are done). Per key, whether a stored copy was bad; ``False`` for a block
        that went bad on its way (or is gone)."""
        checked = check_keys(keys)
        with self._placement.lock:
            self._placement.check_open()
            with self._placement.batch():
                return self._placement.verify(checked)

    def check(self, *, repair: bool = False) -> CheckReport:
        """Verify every block of the persistent tier against its checksum."""
        with self._placement.lock:
            self._placement.check_open()
            if self._placement.persistent is None:
                return CheckReport()
            disk = self._placement.tiers[self._placement.persistent]
            assert isinstance(disk, DiskTier)
            return disk.check(repair=repair)

    def close(self) -> None:
        """Close every tier (the disk tier is synced). Idempotent. With a disk tier, the
        blocks held only in memory are first written to it (newest first, as many as its
        free room takes: it evicts nothing for them), so that a reopened store serves them:
        ``close()`` costs one disk write per memory-only block (see ``_spill``)."""
        with self._placement.lock:
            if self._placement.closed:
                return
            self._placement.closed = True
            try:
                if self._placement.persistent is not None:
                    spill(self._placement.tiers, self._placement.tiers[self._placement.persistent])
            finally:
                for tier in self._placement.tiers:
                    tier.close()

    # -- internals ---------------------------------------------------------------------
