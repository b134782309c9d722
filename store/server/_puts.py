"""A cache server's puts of several requests in progress: the blocks each one must keep.

A client's put larger than one request (``request_blocks``) stages, writes and commits a
request at a time, and each staging makes room in the namespace. Without a record of the
whole put, one request could evict the blocks an earlier request of the same put stored, or
that the put found stored already: the put would report blocks stored that are gone, and a
chain with a hole never hits past it (``match_prefix`` counts from the first block). A local
``TieredStore.put`` cannot do that: it places a whole put under one lock, evicting none of
its own blocks.

So a put of several requests first asks ``room`` with all its keys and its ``put`` id: the
server answers how many are new and how many new blocks fit beside the put's stored ones
(the client refuses the put whole, ``StoreFull``, when they do not), and records the keys
here. Each staging of the put then protects them from eviction until its commit. A record
ends with the put's ``last`` staging, at its deadline (the lease TTL), or with its session.
The server calls this under the namespace's lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._keys import BlockKey
from .._wire import TooManyRequests

MAX_PUTS_PER_SESSION = 4
"""Puts one session keeps records of in a namespace (a client runs one put at a time per
calling thread); a fifth drops the oldest record, whose put then protects nothing."""


@dataclass
class _Put:
    keys: set[BlockKey]
    deadline: float
    principal: str


class PutsInProgress:
    """One namespace's records of puts in progress, by session and put id. A record
    changes only what its own put's stagings may evict, never anyone else's, so the bound
    is on memory alone: a principal's records (a tenant's, every session together) name at
    most twice the namespace's blocks, ``limit`` (a put that fits names at most that many:
    its stored blocks and as many new ones)."""

    def __init__(self, limit: int, clock: Callable[[], float]) -> None:
        self._limit = limit
        self._clock = clock
        self._by_session: dict[int, OrderedDict[int, _Put]] = {}
        self._by_principal: Counter[str] = Counter()

    def begin(
        self,
        session: int,
        put: int,
        keys: Iterable[bytes],
        ttl: float,
        *,
        principal: str = "",
    ) -> None:
        """Record ``keys`` as blocks of the session's put ``put`` (added to those of earlier
        ``room`` requests of the same put). :class:`TooManyRequests`, recording nothing,
        when ``principal``'s records would name more than twice the namespace's blocks."""
        self.sweep()
        puts = self._by_session.get(session, OrderedDict())
        record = puts.get(put)
        adding = {BlockKey(key) for key in keys} - (record.keys if record is not None else set())
        most = 2 * self._limit
        if self._by_principal[principal] + len(adding) > most:
            raise TooManyRequests(
                f"this tenant's puts in progress keep {self._by_principal[principal]} blocks "
                f"of a namespace of {self._limit} (at most {most}): try again when they are "
                "done"
            )
        self._by_session[session] = puts
        if record is None:
            if len(puts) >= MAX_PUTS_PER_SESSION:
                self._forget(puts.popitem(last=False)[1])
            record = puts[put] = _Put(set(), 0.0, principal)
        record.keys |= adding
        record.deadline = self._clock() + ttl
        self._by_principal[principal] += len(adding)

    def keys_of(self, session: int, put: int, ttl: float) -> set[BlockKey]:
        """The keys of the session's put ``put`` (none for a put without a live record);
        its record lives ``ttl`` more seconds (a staging of the put: it is still going)."""
        puts = self._by_session.get(session)
        record = None if puts is None else puts.get(put)
        if record is None or record.deadline <= self._clock():
            return set()
        record.deadline = self._clock() + ttl
        return record.keys

    def end(self, session: int, put: int) -> None:
        puts = self._by_session.get(session)
        if puts is not None and put in puts:
            self._forget(puts.pop(put))
            if not puts:
                del self._by_session[session]

    def end_session(self, session: int) -> None:
        for record in self._by_session.pop(session, {}).values():
            self._forget(record)

    def sweep(self) -> None:
        """Drop the records past their deadline."""
        now = self._clock()
        for session, puts in list(self._by_session.items()):
            for put, record in list(puts.items()):
                if record.deadline <= now:
                    self._forget(puts.pop(put))
            if not puts:
                del self._by_session[session]

    def __len__(self) -> int:
        return sum(len(puts) for puts in self._by_session.values())

    def _forget(self, record: _Put) -> None:
        self._by_principal[record.principal] -= len(record.keys)
        if self._by_principal[record.principal] <= 0:
            del self._by_principal[record.principal]
