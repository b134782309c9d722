"""The cache server's namespaces: one tiered store each, the sessions that opened it, and the
guard that decides which remote op may touch its memory.

A namespace (model, layout, tenant) is opened by name; the server answers with a handle.
Each namespace has a lock of its own (:attr:`Namespace.lock`): every request and every
remote frame of the namespace takes it, and only it (with, for a moment, the server's
lease counts: ``_lease_counts``), so that no namespace ever waits for another's.
Handles are never reused, and a handle works only for a session that opened it: knowing
(or guessing) a number gives no access to another tenant's blocks. A namespace that no live
session has open and that holds no lease can be reclaimed (closed; a disk tier keeps its
blocks for the next open) when a new namespace needs its place.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...transfer import Admission, Caller, Region
from .._lineage import LineageBook
from .._stream import Noted
from ..local._changes import Change
from ..local._store import TieredStore
from ._events import EventPublisher, EventStream
from ._lease_counts import LeaseCounts
from ._ledger import Leases
from ._served import Served

REQUEST_SHARE = 4
"""One request stages or pins at most 1/4 of a namespace's memory slots, so that a single
request never takes the room every other client needs."""

SESSION_SHARE = 2
"""One session holds at most 1/2 of a namespace's memory slots (staged and pinned at once)."""


@dataclass
class Namespace:
    handle: int
    name: bytes
    store: TieredStore
    counts: LeaseCounts
    """The server's open leases of every namespace (a session's and a tenant's bounds)."""
    owner: str = ""
    """The tenant that created it (its quota counts it; see ``_namespace_table``)."""
    region: Region | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Taken by every request and every remote frame of this namespace (the guard, on
    serving threads), and by nothing of another namespace: below it everything here is
    not thread-safe."""
    leases: Leases = field(init=False)
    """Its one lease ledger: staged puts, read leases, puts in progress, handoff holds."""
    openers: dict[int, str] = field(default_factory=dict)
    """Sessions that opened the namespace and have not ended, each with its principal."""
    last_used: float = field(default_factory=time.monotonic)
    stream: EventStream | None = None
    """Its event stream, from the first session that asked for it (``_events``)."""
    block_tokens: int = 0
    """Tokens per block, stated by its creator: the lineage it keeps (``_lineage``)."""
    write_only_alarm: float = 0.0
    """Seconds of stored growth without a delivered block that raise its alarm (0: never)."""
    lineage: LineageBook = field(init=False)
    served: Served = field(init=False)
    """What it was asked, advertised and delivered, and its write-only alarm (``_served``)."""

    def __post_init__(self) -> None:
        self.lineage = LineageBook(self.blocks if self.block_tokens else 0)
        self.served = Served(self.label, self.write_only_alarm, self.store.clock)
        self.leases = Leases(self.store, self.counts, blocks=self.blocks, lineage=self.lineage)

    def events(self, publisher: EventPublisher) -> EventStream:
        """Its event stream, started the first time a session asks (a namespace nobody
        listens to pays nothing for it)."""
        if self.stream is None:
            self.stream = publisher.stream()
            self.store.watch(self._report)
        return self.stream

    def _report(self, changes: list[Change]) -> None:
        """The store's changes to its stream, each stored block with its lineage (under the
        store's lock: a lookup each)."""
        assert self.stream is not None
        book = self.lineage
        noted: list[Noted] = [
            (key, tier, None if tier is None else book.get(key)) for key, tier in changes
        ]
        self.stream.report(noted)

    def close(self) -> None:
        """It leaves the server: its stream ends, its store closes (the disk kept)."""
        if self.stream is not None:
            self.store.watch(None)
            self.stream.close()
        self.store.close()

    @property
    def label(self) -> str:
        text = self.name.decode("utf-8", "replace")
        return f"{text}/{self.store.block_bytes}"

    @property
    def clock(self) -> Callable[[], float]:
        """The clock of the namespace's leases (the store's: ``CacheServer(clock=...)``)."""
        return self.store.clock

    @property
    def anonymous(self) -> str:
        """The label shown to sessions that did not open it: a digest, not the name."""
        digest = hashlib.sha256(self.name).hexdigest()[:12]
        return f"sha256:{digest}/{self.store.block_bytes}"

    @property
    def slots(self) -> int:
        return self.store.tiers[0].capacity

    @property
    def blocks(self) -> int:
        """Blocks the namespace holds in all (a write-through disk tier holds a copy of
        every block, so it alone bounds them)."""
        tiers = self.store.tiers
        if self.store.write_through:
            return max(tier.capacity for tier in tiers)
        return sum(tier.capacity for tier in tiers)

    @property
    def request_blocks(self) -> int:
        """Most blocks one stage or pin request (and one remote frame) may cover."""
        return max(1, self.slots // REQUEST_SHARE)

    @property
    def session_blocks(self) -> int:
        """Most slots one session may hold at once."""
        return max(self.request_blocks, self.slots // SESSION_SHARE)

    def end_session(self, session: int) -> None:
        """The session ended: it no longer has the namespace open, and its leases end."""
        self.openers.pop(session, None)
        self.leases.end_session(session)

    def open_for(self, principal: str) -> bool:
        """Whether a live session of ``principal`` has the namespace open."""
        return principal in list(self.openers.values())  # a copy: opens add without the lock

    @property
    def idle(self) -> bool:
        """No live session has it open and nothing is leased: it may be reclaimed."""
        return not self.openers and not len(self.leases)

    def guard(
        self, caller: Caller, access: str, offsets: np.ndarray, lengths: np.ndarray
    ) -> Admission:
        """A remote write lands only in slots staged for the writing session, a remote read
        only from slots pinned for the reading session, each under a live lease; what an
        admitted op touches is held until its bytes have moved."""
        block = np.uint64(self.store.block_bytes)
        first = (offsets // block).astype(np.int64)
        last = ((offsets + lengths - np.uint64(1)) // block).astype(np.int64)
        refused = Admission(np.zeros(len(offsets), dtype=bool))
        if int((last - first + 1).sum()) > len(offsets) + self.request_blocks:
            return refused  # more than any request covers (ops cut in slices count once each)
        with self.lock:
            if caller.session not in self.openers:
                return refused
            allowed, leases = self.leases.admit(caller.session, access, first, last)
        if not leases:
            return Admission(allowed)
        return Admission(allowed, functools.partial(self._done, leases))

    def _done(self, leases: list[int]) -> None:
        """An admitted transfer's bytes moved (or failed): its leases count it no more."""
        with self.lock:
            self.leases.done(leases)
