"""The event streams' bounds in pieces (docs/EVENTS.md, "Bounds"): the ledger of tickets
and subscribers (a fake clock, no sockets), the byte arithmetic and the settings behind it,
how the publisher cuts changes into messages, and a publisher on loopback dropping a
subscriber that stopped reading (naming it to ``on_drop``) and letting its place go once
its connection is gone."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from helpers import FakeClock, keys, until

from kvbridge.store import (
    EVENT_TICKET_PREFIX,
    Lineage,
    Noted,
    ServerConfig,
    TooManyRequests,
    decode_events,
)
from kvbridge.store._stream import LAPSED, RENEW
from kvbridge.store.server import load_tenants
from kvbridge.store.server._event_bounds import (
    MESSAGE_BATCH_BYTES,
    MESSAGE_BYTES,
    EventBounds,
)
from kvbridge.store.server._event_ledger import EventLedger, Holder, Quota
from kvbridge.store.server._events import EventPublisher, EventStream, batches
from kvbridge.store.settings import ConfigError

SESSION = Quota(tickets=2, subscribers=3)
ALICE, ALICE_2, MALLORY = Holder(1, "alice"), Holder(2, "alice"), Holder(3, "mallory")
OPEN = Quota(None, None)


def _ledger(capacity: int = 100) -> tuple[EventLedger[str], FakeClock]:
    clock = FakeClock()
    return EventLedger(capacity, SESSION, ticket_ttl=30.0, ttl=5.0), clock


def _issue_all(ledger: EventLedger[str], holder: Holder, quota: Quota, now: float) -> list[bytes]:
    taken: list[bytes] = []
    try:
        while len(taken) < 1000:
            taken.append(ledger.issue("s", holder, quota, now))
    except TooManyRequests:
        return taken
    raise AssertionError("never refused")


# -- the ledger ----------------------------------------------------------------------------


def test_a_session_gets_its_tickets_then_a_refusal_that_changes_nothing() -> None:
    ledger, clock = _ledger()
    tickets = _issue_all(ledger, ALICE, OPEN, clock.now)
    assert len(tickets) == 2
    assert ledger.counts(ALICE) == (2, 0, 2, 0)
    with pytest.raises(TooManyRequests, match="session 1 holds 2 unused event tickets"):
        ledger.issue("s", ALICE, OPEN, clock.now)
    assert ledger.counts(ALICE) == (2, 0, 2, 0)
    assert ledger.redeem(tickets[0], b"p1", clock.now) == "s"  # the tickets still work
    assert ledger.counts(ALICE) == (1, 1, 1, 1)


def test_subscribers_count_with_tickets_until_their_connection_is_gone() -> None:
    ledger, clock = _ledger()
    for peer in (b"p1", b"p2", b"p3"):
        ledger.redeem(ledger.issue("s", ALICE, OPEN, clock.now), peer, clock.now)
    with pytest.raises(TooManyRequests, match="3 event subscribers and 0 tickets"):
        ledger.issue("s", ALICE, OPEN, clock.now)
    ledger.stop(b"p1")  # dropped for a full queue: it still holds what its pipe holds
    clock.advance(6.0)
    assert sorted(ledger.sweep(clock.now)) == [b"p1", b"p2", b"p3"]  # lapsed: still counted
    with pytest.raises(TooManyRequests):
        ledger.issue("s", ALICE, OPEN, clock.now)
    ledger.gone(b"p2")
    ledger.issue("s", ALICE, OPEN, clock.now)
    assert ledger.counts(ALICE) == (1, 2, 1, 2)


def test_a_tenants_sessions_share_its_quota_and_never_take_another_tenants() -> None:
    ledger, clock = _ledger(capacity=6)
    tenant = Quota(tickets=3, subscribers=4)
    first = _issue_all(ledger, ALICE, tenant, clock.now)
    second = _issue_all(ledger, ALICE_2, tenant, clock.now)
    assert (len(first), len(second)) == (2, 1)  # the session's 2, then the tenant's 3
    ledger.redeem(first[0], b"a1", clock.now)  # a ticket less, a subscriber more
    assert len(_issue_all(ledger, ALICE_2, tenant, clock.now)) == 1  # 3 tickets + 1: its 4
    mallory = _issue_all(ledger, MALLORY, OPEN, clock.now)
    assert len(mallory) == 2  # the server's 6: alice's 4 stay hers
    assert ledger.redeem(second[0], b"a2", clock.now) == "s"  # alice's pending ticket


def test_the_server_refuses_past_its_capacity_and_pushes_no_one_out() -> None:
    ledger, clock = _ledger(capacity=3)
    held = [ledger.issue("s", Holder(n, f"t{n}"), OPEN, clock.now) for n in range(3)]
    with pytest.raises(TooManyRequests, match="events_memory"):
        ledger.issue("s", Holder(9, "t9"), OPEN, clock.now)
    assert all(ledger.redeem(t, bytes([n]), clock.now) == "s" for n, t in enumerate(held))


def test_a_ticket_is_good_once_and_for_its_ttl() -> None:
    ledger, clock = _ledger()
    ticket = ledger.issue("s", ALICE, OPEN, clock.now)
    stale = ledger.issue("s", ALICE, OPEN, clock.now)
    assert ledger.redeem(ticket, b"p", clock.now) == "s"
    assert ledger.redeem(ticket, b"q", clock.now) is None
    assert ledger.redeem(b"\x00" * 16, b"q", clock.now) is None
    clock.advance(31.0)
    assert ledger.redeem(stale, b"q", clock.now) is None
    assert ledger.counts(ALICE) == (0, 1, 0, 1)


def test_renewals_keep_a_subscription_and_a_stopped_one_is_not_renewed() -> None:
    ledger, clock = _ledger()
    ledger.redeem(ledger.issue("s", ALICE, OPEN, clock.now), b"p", clock.now)
    for _ in range(10):
        clock.advance(1.0)
        assert ledger.renew(b"p", clock.now)
    assert ledger.sweep(clock.now) == [] and ledger.listening("s") == [b"p"]
    ledger.end("s")  # its stream ended
    assert not ledger.renew(b"p", clock.now) and ledger.listening("s") == []


# -- bytes ---------------------------------------------------------------------------------


def test_the_default_bounds_are_the_documented_ones() -> None:
    bounds = EventBounds()
    assert bounds.hwm == 48
    assert bounds.subscriber_bytes <= (2 << 20) + (64 << 10)
    assert bounds.subscribers == 126
    assert EventBounds(messages=1).hwm == 1  # events_hwm lowers it, never raises it


@pytest.mark.parametrize(
    ("settings", "setting"),
    [
        ({"events_queue_bytes": 2 * MESSAGE_BYTES - 1}, "events_queue_bytes"),
        ({"events_memory": 1 << 20}, "events_memory"),
    ],
)
def test_settings_that_hold_no_subscriber_are_refused(
    settings: dict[str, int], setting: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        ServerConfig(**settings)  # type: ignore[arg-type]
    assert refused.value.setting == setting


def test_a_tenants_file_says_how_many_tickets_and_subscribers(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[[tenant]]\nname = "a"\nsecret = "x"\nmax_tickets = 3\nmax_subscribers = 5\n'
        '[[tenant]]\nname = "b"\nsecret = "y"\n'
    )
    a, b = load_tenants(path, 4, server_subscribers=126)
    assert (a.max_tickets, a.max_subscribers) == (3, 5)
    assert (b.max_tickets, b.max_subscribers) == (63, 63)  # an equal part of the server's


# -- messages ------------------------------------------------------------------------------


def test_changes_are_cut_into_messages_within_the_byte_bound_in_order() -> None:
    ks = keys(0, 5000)
    alternating: list[Noted] = [(k, "host" if i % 2 else None, None) for i, k in enumerate(ks)]
    one_kind: list[Noted] = [(k, "host", None) for k in ks]
    tokens = [Lineage.of(None, range(i, i + 256)) for i in range(len(ks))]  # 1.3 KB each
    chains: list[Noted] = [(k, "host", t) for k, t in zip(ks, tokens, strict=True)]
    for changes in (alternating, one_kind, chains):
        out = list(batches(changes))
        assert all(len(b) <= MESSAGE_BATCH_BYTES for b in out)
        heard = [c for b in out for c in decode_events([b"t", bytes(8), b], b"t").changes]
        assert heard == [(k, tier is not None) for k, tier, _ in changes]
    assert len(list(batches(one_kind))) == 5  # 1,024 keys each
    assert len(list(batches(chains))) > 50  # cut by bytes: 256 token ids a key weigh


# -- a publisher on loopback ---------------------------------------------------------------


@pytest.fixture
def publisher() -> Iterator[tuple[EventPublisher, list[bytes]]]:
    dropped: list[bytes] = []
    bounds = EventBounds(queue_bytes=3 * MESSAGE_BYTES, messages=2)
    with EventPublisher("127.0.0.1", 0, bounds=bounds, on_drop=dropped.append) as pub:
        yield pub, dropped


def _unread(pub: EventPublisher, ticket: bytes) -> tuple[zmq.Socket[bytes], bytes]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    routing_id = b"\x01" + os.urandom(15)
    socket.setsockopt(zmq.ROUTING_ID, routing_id)
    socket.connect(f"tcp://127.0.0.1:{pub.port}")
    socket.send(EVENT_TICKET_PREFIX + ticket)
    return socket, routing_id


@pytest.mark.slow
def test_a_subscriber_that_stops_reading_is_dropped_named_and_let_go_once_gone(
    publisher: tuple[EventPublisher, list[bytes]],
) -> None:
    """The subscriber reads nothing while its stream sends 1,024 keys a message: once its
    queue is full it is dropped and ``on_drop`` gets its routing id. It still counts (its
    session's cap of 1 refuses a ticket) until its connection is gone; when it reads
    again, it is told ``LAPSED``."""
    pub, dropped = publisher
    stream = pub.stream()
    one = Quota(None, 1)
    socket, routing_id = _unread(pub, stream.ticket(ALICE, OPEN))
    until(lambda: socket.poll(0) != 0, "subscribed: the first heartbeat")
    n = iter(range(1_000_000))

    def churned() -> bool:
        i = next(n)
        stream.report([(k, "host", None) for k in keys(i * 1024, (i + 1) * 1024)])
        return bool(dropped)

    until(churned, "dropped for a full queue")
    assert dropped == [routing_id]
    with pytest.raises(TooManyRequests):
        stream.ticket(ALICE, one)
    while (frames := socket.recv_multipart()) != [LAPSED]:  # reads again: told so
        assert len(frames) == 3
        socket.send(RENEW)
    socket.close()
    until(lambda: _granted(stream, one), "its connection went: its place too", timeout=10)


def _granted(stream: EventStream, quota: Quota) -> bool:
    try:
        stream.ticket(ALICE, quota)
    except TooManyRequests:
        return False
    return True
