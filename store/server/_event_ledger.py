"""Who holds the event streams' tickets and subscriptions, and how many each may hold
(``docs/EVENTS.md``, "Bounds").

A ticket is given to a session (the ``events`` op) and becomes a subscriber when a
connection brings it to the events port; both carry the session that took the ticket and
the session's tenant (:class:`Holder`). A ticket counts from the moment it is given: it
reserves the subscriber it may become, so the server never gives a ticket it could not
honour. A subscriber counts until its connection is gone, whether it is still subscribed
or not: a subscriber dropped for a full queue, or one that lapsed, keeps what its pipe
holds until the peer leaves (or the connection is closed: ``EventPublisher.on_drop``).

Caps, checked when a ticket is asked for (:meth:`EventLedger.issue`), each refused with
``TooManyRequests`` and nothing changed:

- a session holds at most :data:`~._event_bounds.SESSION_TICKETS` unused tickets, and its
  tickets and subscribers together reach at most ``SESSION_SUBSCRIBERS``;
- a tenant, every session of it together: ``max_tickets`` and ``max_subscribers``
  (``_tenants``; ``None``: the server's);
- the server: ``EventBounds.subscribers``, tickets and subscribers of everyone together.

A cap is never met by pushing someone out: past it, the one who asks is refused.

Thread safety: one lock. The control plane's threads issue tickets; the publisher's
thread does everything else.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .._wire import TooManyRequests

S = TypeVar("S", bound=Hashable)
"""A stream (``_events.EventStream``): the ledger only compares them."""


@dataclass(frozen=True)
class Holder:
    """Who took a ticket: a session, and the tenant it proved."""

    session: int
    tenant: str


@dataclass(frozen=True)
class Quota:
    """How many unused tickets, and subscribers with them, one holder may have
    (``None``: no cap of its own)."""

    tickets: int | None
    subscribers: int | None


@dataclass(frozen=True)
class _Ticket(Generic[S]):
    stream: S
    holder: Holder
    expires: float


@dataclass
class _Subscriber(Generic[S]):
    stream: S
    holder: Holder
    renew_by: float
    live: bool = True
    """Sent its stream's messages; ``False``: dropped (a full queue), lapsed (not
    renewed), or its stream ended; it counts until its connection is gone."""


class _Tally:
    """Counts of one kind (tickets, or subscribers) per session, per tenant and in all."""

    def __init__(self) -> None:
        self.sessions: Counter[int] = Counter()
        self.tenants: Counter[str] = Counter()
        self.total = 0

    def add(self, holder: Holder, n: int = 1) -> None:
        self.sessions[holder.session] += n
        self.tenants[holder.tenant] += n
        self.total += n
        if self.sessions[holder.session] == 0:
            del self.sessions[holder.session]
        if self.tenants[holder.tenant] == 0:
            del self.tenants[holder.tenant]


class EventLedger(Generic[S]):
    """Every ticket and subscriber, by ticket and by routing id (module docstring)."""

    def __init__(self, capacity: int, session: Quota, *, ticket_ttl: float, ttl: float) -> None:
        """``capacity``: tickets and subscribers of the server at once; ``session``: each
        session's quota; ``ticket_ttl``: how long a ticket is good; ``ttl``: how long a
        subscription lasts unrenewed."""
        self._capacity = capacity
        self._session = session
        self._ticket_ttl = ticket_ttl
        self._ttl = ttl
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Ticket[S]] = {}
        self._subscribers: dict[bytes, _Subscriber[S]] = {}
        self._ticket_counts = _Tally()
        self._subscriber_counts = _Tally()

    def issue(self, stream: S, holder: Holder, tenant: Quota, now: float) -> bytes:
        """A ticket to ``stream`` for ``holder``; ``TooManyRequests`` past a cap."""
        with self._lock:
            self._expire(now)
            self._check(holder, tenant)
            ticket = secrets.token_bytes(16)
            self._tickets[ticket] = _Ticket(stream, holder, now + self._ticket_ttl)
            self._ticket_counts.add(holder)
        return ticket

    def redeem(self, ticket: bytes, peer: bytes, now: float) -> S | None:
        """``peer`` brought ``ticket``: now a live subscriber of its stream (in place of
        what ``peer`` was before), or ``None`` for a ticket used, expired or made up."""
        with self._lock:
            entry = self._tickets.pop(ticket, None)
            if entry is None:
                return None
            self._ticket_counts.add(entry.holder, -1)
            if entry.expires < now:
                return None
            self._release(peer)
            self._subscribers[peer] = _Subscriber(entry.stream, entry.holder, now + self._ttl)
            self._subscriber_counts.add(entry.holder)
            return entry.stream

    def holder(self, peer: bytes) -> Holder | None:
        """Who took the ticket ``peer`` subscribed with (``None``: not a subscriber)."""
        with self._lock:
            held = self._subscribers.get(peer)
            return None if held is None else held.holder

    def renew(self, peer: bytes, now: float) -> bool:
        """Whether ``peer`` is a live subscriber (its subscription now lasts ``ttl``)."""
        with self._lock:
            held = self._subscribers.get(peer)
            if held is None or not held.live:
                return False
            held.renew_by = now + self._ttl
            return True

    def listening(self, stream: S) -> list[bytes]:
        """The live subscribers of ``stream``."""
        with self._lock:
            return [p for p, s in self._subscribers.items() if s.live and s.stream == stream]

    def stop(self, peer: bytes) -> None:
        """``peer`` hears nothing more (a full queue, its stream ended); it still counts."""
        with self._lock:
            held = self._subscribers.get(peer)
            if held is not None:
                held.live = False

    def end(self, stream: S) -> None:
        """``stream`` ended: its subscribers hear nothing more."""
        with self._lock:
            for held in self._subscribers.values():
                if held.stream == stream:
                    held.live = False

    def gone(self, peer: bytes) -> None:
        """``peer``'s connection is gone: it counts no more."""
        with self._lock:
            self._release(peer)

    def sweep(self, now: float) -> list[bytes]:
        """Expire tickets and lapse subscriptions not renewed in time; the subscribers that
        hear nothing and still count (whose connections may be gone: ask them)."""
        with self._lock:
            self._expire(now)
            for held in self._subscribers.values():
                if held.live and held.renew_by < now:
                    held.live = False
            return [p for p, s in self._subscribers.items() if not s.live]

    def counts(self, holder: Holder) -> tuple[int, int, int, int]:
        """Tickets and subscribers of ``holder``'s session, then of its tenant."""
        with self._lock:
            t, s = self._ticket_counts, self._subscriber_counts
            return (
                *(t.sessions[holder.session], s.sessions[holder.session]),
                *(t.tenants[holder.tenant], s.tenants[holder.tenant]),
            )

    def _check(self, holder: Holder, tenant: Quota) -> None:
        t, s = self._ticket_counts, self._subscriber_counts
        session = (t.sessions[holder.session], s.sessions[holder.session])
        _within(f"session {holder.session}", session, self._session)
        _within(
            f"tenant {holder.tenant or 'default'}",
            (t.tenants[holder.tenant], s.tenants[holder.tenant]),
            tenant,
        )
        if t.total + s.total >= self._capacity:
            raise TooManyRequests(
                f"the server holds {t.total} tickets and {s.total} subscribers of its "
                f"{self._capacity} (events_memory): try again later"
            )

    def _expire(self, now: float) -> None:
        for ticket in [t for t, entry in self._tickets.items() if entry.expires < now]:
            self._ticket_counts.add(self._tickets.pop(ticket).holder, -1)

    def _release(self, peer: bytes) -> None:
        held = self._subscribers.pop(peer, None)
        if held is not None:
            self._subscriber_counts.add(held.holder, -1)


def _within(who: str, held: tuple[int, int], quota: Quota) -> None:
    """Refuse a ticket past ``quota`` for one who holds ``held`` (tickets, subscribers)."""
    tickets, subscribers = held
    if quota.tickets is not None and tickets >= quota.tickets:
        raise TooManyRequests(
            f"{who} holds {tickets} unused event tickets (at most {quota.tickets}): "
            "subscribe with them first"
        )
    if quota.subscribers is not None and tickets + subscribers >= quota.subscribers:
        raise TooManyRequests(
            f"{who} holds {subscribers} event subscribers and {tickets} tickets (at most "
            f"{quota.subscribers} together): close some subscribers first"
        )
