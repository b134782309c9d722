"""One namespace's leases: a single ledger, one record per lease, every transition one
method.

A cache server lends a namespace's top-tier slots to its sessions under leases:

- a **staged** lease (``stage`` .. ``commit`` / ``abort``): free slots for the session to
  write the blocks it puts; the commit makes them visible all at once;
- a **read** lease (``pin`` .. ``release``): blocks pinned in memory for the session to read.

The ledger is the only record of a lease: its session and tenant (written once, here), its
keys and slots, its deadline, and the remote transfers on it still in flight. The store
under it (:class:`~kvbridge.store.local.RemoteAccess`) knows slots and pins, never
sessions: the ledger stages and pins there with no deadline and ends what it took itself.
A read pins its blocks once, for the lease; a frame adds no pin of its own.

===========  ==========================================  ===========  ==========================
state        method (event)                              next         rule
===========  ==========================================  ===========  ==========================
—            :meth:`stage`, :meth:`pin`                  OPEN         the server counted the
                                                                      lease for its session and
                                                                      tenant first
OPEN         :meth:`admit` (a remote frame)              OPEN, +1     its session only, before
                                                         in flight    the deadline: a write into
                                                                      staged slots, a read from
                                                                      pinned ones
OPEN         :meth:`done` (the frame's bytes moved)      OPEN, -1
OPEN         :meth:`commit`                              gone         its session, before the
                                                                      deadline, nothing in flight
OPEN         :meth:`abort`, :meth:`release`,             DRAINING,    gone at once when nothing
             :meth:`sweep` (deadline),                   or gone      is in flight
             :meth:`end_session`
DRAINING     :meth:`done` (its last frame)               gone         only now do its slots go
                                                                      back (staged) or its pins
                                                                      end (read)
===========  ==========================================  ===========  ==========================

A lease that leaves OPEN admits no frame from then on, and gives its count back to the
server's bounds (``LeaseCounts``); its slots count as its session's until it is gone, so a
late byte never lands in, or leaves from, a slot that someone else holds.

Beside the leases the ledger keeps two records that are not slot leases: the blocks a put
of several requests keeps from its own later stagings (``_puts``), and the blocks a commit
holds for their first read (``_handoff``). Not thread-safe: the server calls it under the
namespace's lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .._errors import LeaseExpired
from .._keys import BlockKey
from .._lease import Lease
from .._lineage import Lineage, LineageBook
from .._wire import BadRequest
from ..local._placement import Prefetched
from ..local._remote import RemoteAccess
from ..local._store import TieredStore
from ._handoff import HandoffHolds
from ._lease_counts import LeaseCounts
from ._puts import PutsInProgress

Kind = Literal["stage", "pin"]


@dataclass
class _Record:
    """One lease: everything about it, in one place."""

    id: int
    kind: Kind
    session: int
    principal: str
    keys: tuple[BlockKey, ...]
    """Staged: the new blocks, one per slot; read: the blocks pinned, one per slot."""
    slots: tuple[int, ...]
    deadline: float
    store_id: int = 0
    """Staged: the store's staging (:meth:`RemoteAccess.commit`, ``abort``)."""
    pin: Lease | None = None
    """Read: the store's pin (released when the lease is gone)."""
    in_flight: int = 0
    open: bool = True
    """OPEN; false once DRAINING."""
    lineage: tuple[Lineage | None, ...] = ()
    """Staged: each new block's lineage, kept at commit (empty: none sent)."""


@dataclass
class _Index:
    """Which slots admit which session's frames: derived from the open records."""

    staged: np.ndarray
    """Per slot: the open staged lease that holds it (0: none)."""
    read: dict[int, dict[int, dict[int, BlockKey]]] = field(default_factory=dict)
    """session -> slot -> {open read lease: the block pinned there}."""


class Leases:
    """One namespace's lease ledger over its store; see the module's state table."""

    def __init__(
        self,
        store: TieredStore,
        counts: LeaseCounts,
        *,
        blocks: int,
        lineage: LineageBook | None = None,
    ) -> None:
        self._store = store
        self._lineage = lineage if lineage is not None else LineageBook(0)
        self._remote = RemoteAccess(store)
        self._counts = counts
        self._clock = store.clock
        slots = store.tiers[0].capacity
        self._records: dict[int, _Record] = {}
        self._ids = itertools.count(1)
        self._due: list[tuple[float, int]] = []
        """Deadlines of open leases, a heap; an entry for a lease no longer open is stale."""
        self._index = _Index(np.zeros(slots, dtype=np.int64))
        self.held: Counter[int] = Counter()
        """Slots held per session: its open and draining leases."""
        self.held_by: Counter[str] = Counter()
        """Slots held per principal (a tenant: every session of it together)."""
        self.holds = HandoffHolds(store, slots // 2)
        self.puts = PutsInProgress(blocks, store.clock)

    def __len__(self) -> int:
        """Leases not gone yet (open or draining)."""
        return len(self._records)

    def in_flight(self, lease_id: int) -> int:
        """Remote frames admitted on the lease whose bytes have not moved yet."""
        record = self._records.get(lease_id)
        return 0 if record is None else record.in_flight

    def tenant_held(self, principal: str) -> int:
        """Slots ``principal`` holds here: its leases and its commits' handoff holds."""
        return self.held_by[principal] + self.holds.of(principal)

    # -- staged puts -------------------------------------------------------------------

    def room_for(
        self, session: int, principal: str, keys: Sequence[bytes], put: int | None, ttl: float
    ) -> tuple[int, int]:
        """How many of ``keys`` are new and how many new blocks fit beside the stored ones;
        with ``put`` (a put of several requests) and when they fit, its later stagings
        keep these blocks from eviction (``_puts``)."""
        new, room = self._remote.room_for(keys)
        if put is not None and new <= room:
            self.puts.begin(session, put, keys, ttl, principal=principal)
        return new, room

    def protect(self, session: int, put: int | None, last: bool, ttl: float) -> set[BlockKey]:
        """The blocks a staging of ``put`` must not evict: the rest of its put. Its last
        staging ends the put's record (they stay kept until that staging's commit)."""
        if put is None:
            return set()
        keys = self.puts.keys_of(session, put, ttl)
        if last:
            self.puts.end(session, put)
        return keys

    def stage(
        self,
        session: int,
        principal: str,
        keys: Sequence[bytes],
        ttl: float,
        *,
        protect: set[BlockKey],
        lineage: Sequence[Lineage | None] = (),
    ) -> tuple[int, list[int | None]]:
        """— -> OPEN: free slots for the new ones of ``keys``, for ``session`` to write
        until ``ttl`` seconds from now. Per key the slot to write (``None``: stored already
        or repeated); lease 0 when nothing is new. ``lineage`` (one per key, or none): what
        each new block was hashed from, kept when it is committed."""
        store_id, slots = self._remote.stage(keys, ttl=math.inf, protect=protect)
        if not store_id:
            return 0, slots
        taken = [(key, slot) for key, slot in zip(keys, slots, strict=True) if slot is not None]
        record = self._open(
            "stage",
            session=session,
            principal=principal,
            keys=tuple(BlockKey(key) for key, _ in taken),
            slots=tuple(slot for _, slot in taken),
            ttl=ttl,
        )
        record.store_id = store_id
        if lineage:  # the new blocks' own, in the record's order
            new = zip(lineage, slots, strict=True)
            record.lineage = tuple(entry for entry, slot in new if slot is not None)
        self._index.staged[list(record.slots)] = record.id
        return record.id, slots

    def commit(
        self,
        session: int,
        lease_id: int,
        *,
        handoff_ttl: float,
        share: float,
        checksums: Sequence[int] = (),
    ) -> int:
        """OPEN -> gone: the session's staged blocks become visible (all or none: the
        store's rule); they are then held for their first read. :class:`LeaseExpired` when
        the lease is not the session's open staged one or its deadline passed (it ends),
        :class:`BadRequest` while frames into it are in flight, or for ``checksums`` (one
        per staged block, or none) of another count (it stays open)."""
        record = self._own(session, lease_id, "stage")
        if record.in_flight:
            raise BadRequest(f"lease {lease_id}: a commit while writes into it are in flight")
        if checksums and len(checksums) != len(record.keys):
            raise BadRequest(f"{len(checksums)} checksums for {len(record.keys)} staged blocks")
        if record.deadline <= self._clock():
            self._end(record)
            raise LeaseExpired(f"staged put {lease_id} expired before its commit")
        self._close(record)
        self._forget(record)
        if record.lineage:  # before the blocks are visible: their first event carries it
            self._lineage.keep(record.keys, record.lineage)
        stored = self._remote.commit(record.store_id, checksums)  # its slots: the store's now
        self.holds.hand_off(record.keys, handoff_ttl, record.principal, share)
        return stored

    def abort(self, session: int, lease_id: int) -> None:
        """OPEN -> DRAINING or gone: the session gives its staged slots back (another's
        lease, or one already ended, is left alone)."""
        record = self._records.get(lease_id)
        if (
            record is not None
            and record.open
            and (record.session, record.kind)
            == (
                session,
                "stage",
            )
        ):
            self._end(record)

    # -- read leases -------------------------------------------------------------------

    def prefetch(self, keys: Sequence[bytes]) -> Prefetched:
        """The disk reads a :meth:`pin` of ``keys`` needs, done ahead (and without the
        namespace's lock: this reads the store only)."""
        return self._remote.prefetch(keys)

    def pin(
        self,
        session: int,
        principal: str,
        keys: Sequence[bytes],
        ttl: float,
        early: Prefetched | None = None,
    ) -> tuple[int, list[int]]:
        """— -> OPEN: the blocks pinned in memory for ``session`` to read until ``ttl``
        seconds from now, and each key's slot. Their handoff holds have done their job."""
        pin, slots = self._remote.pin_resident(keys, ttl=math.inf, early=early)
        record = self._open(
            "pin", session=session, principal=principal, keys=pin.keys, slots=tuple(slots), ttl=ttl
        )
        record.pin = pin
        readable = self._index.read.setdefault(session, {})
        for key, slot in zip(record.keys, record.slots, strict=True):
            readable.setdefault(slot, {})[record.id] = key
        self.holds.take(keys)
        return record.id, slots

    def checksums(self, keys: Sequence[bytes]) -> list[int]:
        """The checksums of blocks a lease of the caller's pins (see ``pin``)."""
        return self._remote.checksums([BlockKey(key) for key in keys])

    def release(self, session: int, lease_id: int) -> None:
        """OPEN -> DRAINING or gone: the session is done reading. :class:`LeaseExpired`
        when it is not the session's open read lease, or its deadline had passed (it ends
        all the same)."""
        record = self._own(session, lease_id, "pin")
        expired = record.deadline <= self._clock()
        self._end(record)
        if expired:
            raise LeaseExpired(f"read lease {lease_id} expired before its release")

    # -- remote frames -----------------------------------------------------------------

    def admit(
        self, session: int, access: str, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """OPEN -> OPEN, +1 in flight: per slot range ``first..last`` (inclusive), whether
        ``session`` may write it (``access`` "w": slots of its open staged leases) or read
        it ("r": slots of its open read leases), each before its deadline. When every range
        may, the leases touched are returned, each with one more frame in flight, for
        :meth:`done`; otherwise nothing is counted."""
        if access == "w":
            allowed, touched = self._writable(session, first, last)
        else:
            allowed, touched = self._readable(session, first, last)
        if not len(first) or not allowed.all():
            return allowed, []
        for lease_id in touched:
            self._records[lease_id].in_flight += 1
        return allowed, touched

    def done(self, leases: Sequence[int]) -> None:
        """-1 in flight on each lease; DRAINING -> gone with its last frame."""
        for lease_id in leases:
            record = self._records[lease_id]
            record.in_flight -= 1
            if not record.open and not record.in_flight:
                self._gone(record)

    def _writable(
        self, session: int, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        staged = self._index.staged
        inside = (first >= 0) & (first <= last) & (last < len(staged))
        lo, hi = np.where(inside, first, 0), np.where(inside, last, 0)
        spans = lo != hi
        at_lo = staged[lo]
        if spans.any():  # ranges over several slots: rare
            parts = [staged[a : b + 1] for a, b in zip(lo[spans], hi[spans], strict=True)]
            candidates = np.unique(np.concatenate([at_lo, *parts]))
        else:
            candidates = np.unique(at_lo)
        now = self._clock()
        mine = [
            int(i)
            for i in candidates
            if i
            and self._records[int(i)].session == session
            and self._records[int(i)].deadline > now
        ]
        allowed: np.ndarray = inside & np.isin(at_lo, mine) & np.isin(staged[hi], mine)
        for i in np.flatnonzero(allowed & spans):
            allowed[i] = bool(np.isin(staged[lo[i] : hi[i] + 1], mine).all())
        return allowed, mine if allowed.all() else []  # all allowed: every lease is mine

    def _readable(
        self, session: int, first: np.ndarray, last: np.ndarray
    ) -> tuple[np.ndarray, list[int]]:
        """Each distinct range looked up once: a frame of a KV cache's pages names each
        block's slot once per page."""
        allowed = np.zeros(len(first), dtype=bool)
        mine = self._index.read.get(session)
        if mine is None or not len(first):
            return allowed, []
        ranges, inverse = _distinct_ranges(first, last)
        ok = np.zeros(len(ranges), dtype=bool)
        touched: set[int] = set()
        now = self._clock()
        for i, (lo, hi) in enumerate(ranges.tolist()):
            if not 0 <= lo <= hi:
                continue
            live = [self._live(mine.get(slot), now) for slot in range(lo, hi + 1)]
            if all(lease_id is not None for lease_id in live):
                ok[i] = True
                touched.update(lease_id for lease_id in live if lease_id is not None)
        allowed[:] = ok[inverse.reshape(-1)]
        return allowed, sorted(touched)

    def _live(self, by_lease: dict[int, BlockKey] | None, now: float) -> int | None:
        for lease_id in by_lease or ():
            if self._records[lease_id].deadline > now:
                return lease_id
        return None

    # -- lifetimes ---------------------------------------------------------------------

    def sweep(self) -> None:
        """OPEN -> DRAINING or gone for every lease past its deadline, and the records of
        puts past theirs."""
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            _, lease_id = heapq.heappop(self._due)
            record = self._records.get(lease_id)
            if record is not None and record.open:
                self._end(record)
        if len(self._due) > 2 * len(self._records) + 64:  # mostly leases ended early
            self._due = [(r.deadline, r.id) for r in self._records.values() if r.open]
            heapq.heapify(self._due)
        self.puts.sweep()

    def end_session(self, session: int) -> None:
        """OPEN -> DRAINING or gone for every lease of ``session``; its puts' records end."""
        self.puts.end_session(session)
        for record in [r for r in self._records.values() if r.session == session and r.open]:
            self._end(record)

    # -- the transitions' steps --------------------------------------------------------

    def _open(
        self,
        kind: Kind,
        *,
        session: int,
        principal: str,
        keys: tuple[BlockKey, ...],
        slots: tuple[int, ...],
        ttl: float,
    ) -> _Record:
        deadline = self._clock() + ttl
        record = _Record(next(self._ids), kind, session, principal, keys, slots, deadline)
        self._records[record.id] = record
        heapq.heappush(self._due, (deadline, record.id))
        self.held[session] += len(slots)
        self.held_by[principal] += len(slots)
        return record

    def _own(self, session: int, lease_id: int, kind: Kind) -> _Record:
        record = self._records.get(lease_id)
        if record is None or not record.open or record.session != session or record.kind != kind:
            raise LeaseExpired(f"lease {lease_id} is unknown, finished or expired")
        return record

    def _close(self, record: _Record) -> None:
        """Leave OPEN: no frame is admitted from now on; its count goes back."""
        record.open = False
        self._counts.give(record.session, record.principal)
        if record.kind == "stage":
            self._index.staged[list(record.slots)] = 0
            return
        readable = self._index.read.get(record.session, {})
        for slot in record.slots:
            by_lease = readable.get(slot)
            if by_lease is not None:
                by_lease.pop(record.id, None)
                if not by_lease:
                    del readable[slot]
        if not readable:
            self._index.read.pop(record.session, None)

    def _end(self, record: _Record) -> None:
        """OPEN -> DRAINING, or gone when nothing is in flight."""
        self._close(record)
        if not record.in_flight:
            self._gone(record)

    def _gone(self, record: _Record) -> None:
        """The lease is over: what it took in the store goes back."""
        self._forget(record)
        if record.pin is not None:
            record.pin.release()
        elif record.kind == "stage":
            self._remote.abort(record.store_id)

    def _forget(self, record: _Record) -> None:
        del self._records[record.id]
        _take(self.held, record.session, len(record.slots))
        _take(self.held_by, record.principal, len(record.slots))


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
