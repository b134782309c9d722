"""Event queues as an attacker fills them, against a real ``kvbridge serve --events-port``
(docs/EVENTS.md, "Bounds"): subscribers by the dozen that renew every second and never
read, on a namespace that churns, must not grow the server past what the docs say; a
session, then a tenant, asking for tickets without end is refused past its cap with
``TooManyRequests`` (a code on the wire); another tenant's pending ticket and live
subscription go on as if nothing happened."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from attack import unread_subscriber
from helpers import keys, payloads, until
from serve import ServeProcess

from kvbridge.store import (
    BlockKey,
    EventSubscriber,
    Message,
    StoreClient,
    Subscription,
    TooManyRequests,
)

BB = 4096
SLOTS = 4096
"""One namespace of 4,096 blocks of 4 KiB: a round of the churn (fill it, clear it) sends
every subscriber about 160 KiB of messages."""

# What docs/EVENTS.md says, in its own numbers (the contract this file holds the server to).
SUBSCRIBER_BYTES = (2 << 20) + (64 << 10)
"""A subscriber's queue (``events_queue_bytes``, 2 MiB) and its connection (64 KiB)."""
SESSION_TICKETS = 8
SESSION_SUBSCRIBERS = 16
HEAP_MARGIN = 16 << 20
"""What the server may grow by besides the queues: the churn's requests and replies,
allocator arenas kept after a peak (the same churn with no subscriber grew it by 0.9 MiB
here; with the 24 subscribers, 5.7 MiB in all, sharing each message's buffer)."""

UNREAD = 24
ROUNDS = 28
"""24 unread subscribers and 28 rounds: 24 x 28 x 160 KiB = 105 MiB of messages, twice
the 24 subscribers' bound (50 MiB): queues that do not stop at their bound pass it (and
the margin) by round 16."""
FLOOD = 4200
"""Tickets a flooding session asks for at most: past the server's 4,096 (where the oldest
ticket of anyone used to be pushed out)."""


def _renew(sockets: list[zmq.Socket[bytes]]) -> None:
    """Each attacker renews (the subscription would lapse after 5 s otherwise)."""
    for socket in sockets:
        with contextlib.suppress(zmq.Again):
            socket.send(b"kvbridge-renew", zmq.NOBLOCK)


def _flood(client: StoreClient, most: int = FLOOD) -> list[Subscription]:
    """Tickets until the server refuses one (at most ``most``)."""
    taken: list[Subscription] = []
    with contextlib.suppress(TooManyRequests):
        while len(taken) < most:
            taken.append(client.subscription())
    return taken


def _fill_and_clear(client: StoreClient, round_: int) -> None:
    ks = keys(round_ * SLOTS, (round_ + 1) * SLOTS)
    client.put(ks, _BLOCKS)
    client.clear()


_BLOCKS = payloads(keys(0, SLOTS), BB)  # any bytes: the keys are what the stream carries


def _serve(*args: str, namespaces: int = 1) -> ServeProcess:
    """A server of ``namespaces`` namespaces of :data:`SLOTS` blocks, with events."""
    capacity = ("--host-capacity", str(namespaces * SLOTS * BB))
    return ServeProcess(
        "--events-port",
        "0",
        *capacity,
        "--max-namespaces",
        str(namespaces),
        "--handoff-ttl",
        "0",
        *args,
    )


@pytest.fixture
def server() -> Iterator[ServeProcess]:
    served = _serve()
    yield served
    served.kill()


def _client(
    server: ServeProcess, namespace: str = "churn", tenant: str = "", secret: str | None = None
) -> StoreClient:
    return StoreClient(
        server.address,
        block_bytes=BB,
        namespace=namespace,
        timeout=10,
        tenant=tenant,
        secret=secret,
    )


@pytest.mark.slow
def test_unread_subscribers_hold_no_more_than_their_bound(server: ServeProcess) -> None:
    """24 subscribers (3 sessions of 8 tickets) renew every second and never read while
    the namespace is filled and cleared 28 times. At every round the server's resident
    memory stays within what the docs give them (24 x 2.06 MiB) plus the heap's margin:
    each is dropped once its queue holds its bound."""
    with _client(server) as writer:
        for r in range(3):  # the slab, the index and the heap at their working size
            _fill_and_clear(writer, r)
        baseline = server.rss()
        sessions = [_client(server) for _ in range(UNREAD // SESSION_TICKETS)]
        attackers: list[zmq.Socket[bytes]] = []
        try:
            for session in sessions:
                attackers += [unread_subscriber(s) for s in _flood(session, SESSION_TICKETS)]
            assert len(attackers) == UNREAD
            until(lambda: all(s.poll(0) for s in attackers), "each heard its first heartbeat")
            bound = UNREAD * SUBSCRIBER_BYTES + HEAP_MARGIN
            for r in range(ROUNDS):
                _renew(attackers)
                _fill_and_clear(writer, 10 + r)
                grown = server.rss() - baseline
                assert grown <= bound, f"round {r}: grew {grown >> 20} MiB, bound {bound >> 20}"
        finally:
            for socket in attackers:
                socket.close()
            for session in sessions:
                session.close()


def test_a_ticket_flood_from_one_session_is_refused_past_its_cap(server: ServeProcess) -> None:
    """One session asks for tickets without end: it gets 8, then ``TooManyRequests``, and
    the refusal changes nothing (asked again, refused again; the 8 still subscribe). Its
    subscribers count too: with 16 it gets no ticket more; once their connections are gone
    it gets tickets again."""
    with _client(server) as flooder:
        first = _flood(flooder)
        assert len(first) == SESSION_TICKETS
        with pytest.raises(TooManyRequests):
            flooder.subscription()
        subscribers = [unread_subscriber(s) for s in first]
        until(lambda: all(s.poll(0) for s in subscribers), "the 8 tickets subscribed")
        second = _flood(flooder)
        assert len(second) == SESSION_SUBSCRIBERS - SESSION_TICKETS
        subscribers += [unread_subscriber(s) for s in second]
        until(lambda: all(s.poll(0) for s in subscribers), "16 subscribers")
        assert _flood(flooder) == []  # 16 subscribers: no ticket more, however many it asks
        for socket in subscribers:
            socket.close()
        until(lambda: len(_flood(flooder, 1)) == 1, "the connections went: tickets again")


TENANTS = """
[[tenant]]
name = "alice"
secret = "alice's secret"

[[tenant]]
name = "mallory"
secret = "mallory's secret"
max_tickets = 10
max_subscribers = 12
"""


@pytest.fixture
def tenants_server(tmp_path: Path) -> Iterator[ServeProcess]:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    served = _serve("--tenants", str(tmp_path / "tenants.toml"), namespaces=2)
    yield served
    served.kill()


class _Listener:
    """Alice's subscriber, read as it should be: every message's number, and whether one
    was ever missing (a message with changes numbered past the next, or a heartbeat
    ahead of the last one heard)."""

    def __init__(self, stream: EventSubscriber) -> None:
        self.stream = stream
        self.last: int | None = None
        self.gaps: list[tuple[int, int]] = []
        self.heard: set[bytes] = set()

    def hear(self) -> bool:
        message = self.stream.receive(0.05)
        if message is not None:
            self._check(message)
        return message is not None

    def heard_all(self, ks: list[BlockKey]) -> bool:
        self.hear()
        return set(ks) <= self.heard

    def _check(self, message: Message) -> None:
        if self.last is not None:
            expected = self.last + 1 if message.changes else self.last
            if message.seq != expected:
                self.gaps.append((self.last, message.seq))
        self.last = message.seq
        self.heard |= {bytes(key) for key, stored in message.changes if stored}


@pytest.mark.slow
def test_a_ticket_flood_from_one_tenant_leaves_another_tenants_stream_alone(
    tenants_server: ServeProcess,
) -> None:
    """Alice follows her namespace and holds a ticket she has not used yet. Mallory floods:
    3 sessions ask for tickets without end. Alice's pending ticket still subscribes, and
    mallory got her tenant's 10 tickets. Mallory then subscribes every ticket from
    connections that never read while her namespace churns, and asks again: 2 more (12
    subscribers), never one past. Alice's subscriber heard every message of her namespace
    meanwhile, numbered without a gap."""
    alice_key = ("alice", "alice's secret")
    mallory_key = ("mallory", "mallory's secret")
    with (
        _client(tenants_server, "alice/m", *alice_key) as alice,
        EventSubscriber(alice.subscription()) as stream,
        _client(tenants_server, "mallory/m", *mallory_key) as mallory_writer,
    ):
        listener = _Listener(stream)
        until(listener.hear, "alice is subscribed")
        pending = alice.subscription()
        mallories = [_client(tenants_server, "mallory/m", *mallory_key) for _ in range(3)]
        attackers: list[zmq.Socket[bytes]] = []
        try:
            tickets = [t for m in mallories for t in _flood(m)]
            with EventSubscriber(pending) as late:
                until(lambda: late.receive(0.05) is not None, "alice's pending ticket", 5)
            assert len(tickets) == 10
            attackers += [unread_subscriber(t) for t in tickets]
            until(lambda: all(s.poll(0) for s in attackers), "mallory's subscribers")
            more = [t for m in mallories for t in _flood(m)]
            assert len(more) == 2
            attackers += [unread_subscriber(t) for t in more]
            for r in range(12):  # both namespaces change; alice reads, mallory does not
                _renew(attackers)
                _fill_and_clear(mallory_writer, r)
                ks = keys(1_000_000 + r * 10, 1_000_000 + r * 10 + 10)
                alice.put(ks, _BLOCKS[:10])
                until(functools.partial(listener.heard_all, ks), "alice hears her put")
            assert listener.gaps == []
        finally:
            for socket in attackers:
                socket.close()
            for m in mallories:
                m.close()
