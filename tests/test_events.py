"""A real ``kvbridge serve --events-port``: who hears a namespace's stream, and a mirror that
ends with the server's key set (``contains`` over every key) whatever happens on the way:
evictions, removals, clears, the subscriber closed and started again, the server
restarted on its disk (new topics, numbers from 1), a frozen subscriber the server had to
drop messages for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from attack import raw
from helpers import FakeClock, keys, payloads, reap, spawn_python, until
from serve import ServeProcess

from kvbridge.store import (
    EVENT_TICKET_PREFIX,
    BadRequest,
    BlockKey,
    CacheServer,
    EventSubscriber,
    KeyMirror,
    Lineage,
    Message,
    ServerConfig,
    StoreClient,
    SubscriptionLost,
    UnknownNamespace,
)

BB = 4096
CAPACITY = 512 * BB
"""512 blocks: puts of a few hundred evict (the stream says so)."""
_SMALL = ("--host-capacity", str(4 * CAPACITY), "--handoff-ttl", "0")
"""Four namespaces of 512 blocks; no handoff holds (every stored block may be evicted)."""


@pytest.fixture
def server() -> Iterator[ServeProcess]:
    served = ServeProcess("--events-port", "0", *_SMALL)
    yield served
    served.kill()


def _client(server: ServeProcess, namespace: str = "events") -> StoreClient:
    return StoreClient(server.address, block_bytes=BB, namespace=namespace, timeout=10)


def _mirror(server: ServeProcess, namespace: str = "events") -> KeyMirror:
    return KeyMirror(lambda: _client(server, namespace))


def _truth(client: StoreClient, universe: list[bytes]) -> set[bytes]:
    return {k for k, there in zip(universe, client.contains(universe), strict=True) if there}


def _converged(mirror: KeyMirror, client: StoreClient, universe: list[bytes]) -> Callable[[], bool]:
    return lambda: mirror.keys() == _truth(client, universe)


def _churn(client: StoreClient, start: int, rounds: int) -> list[bytes]:
    """Puts that evict, removals and a clear; every key it touched."""
    touched: list[bytes] = []
    for r in range(rounds):
        ks = keys(start + r * 300, start + r * 300 + 300)
        client.put(ks, payloads(ks, BB))
        client.remove(ks[::7])
        touched += ks
        if r == rounds // 2:
            client.clear()
    return touched


@pytest.mark.slow
def test_a_mirror_ends_with_the_servers_keys(server: ServeProcess) -> None:
    with _client(server) as client, _mirror(server) as mirror:
        assert mirror.wait_ready(20)
        universe = _churn(client, 0, 6)
        until(_converged(mirror, client, universe), "the mirror holds the server's keys")
        assert (
            mirror.leading([BlockKey(k) for k in universe[-299:-293]]) == 6
        )  # blocks 1-6 of the last put (0, 7 went)


@pytest.mark.slow
def test_a_restarted_subscriber_starts_from_a_snapshot(server: ServeProcess) -> None:
    with _client(server) as client:
        universe = _churn(client, 0, 2)
        with _mirror(server) as mirror:
            until(_converged(mirror, client, universe), "the first mirror")
        universe += _churn(client, 10_000, 2)  # changes nobody hears
        with _mirror(server) as mirror:
            until(_converged(mirror, client, universe), "the second, from its snapshot")


@pytest.mark.slow
def test_a_mirror_follows_a_server_restarted_on_its_disk(tmp_path: Path) -> None:
    disk = ("--disk-path", str(tmp_path), "--disk-capacity", str(16 * CAPACITY))
    args = ("--events-port", "0", *_SMALL, *disk)
    first = ServeProcess(*args)
    port = first.address.rsplit(":", 1)[1]
    try:
        with _client(first) as client:
            universe = _churn(client, 0, 2)
        mirror = _mirror(first)
        until(lambda: mirror.ready, "in step with the first server")
        resyncs = mirror.resyncs
    finally:
        first.stop(signal.SIGTERM)
    second = ServeProcess("--port", port, *args)  # numbers start over, topics are new
    try:
        with _client(second) as client:
            universe += _churn(client, 20_000, 2)
            until(_converged(mirror, client, universe), "in step with the restarted server")
        assert mirror.resyncs > resyncs
    finally:
        mirror.close()
        second.kill()


_FROZEN_MIRROR = """
import sys
from kvbridge.store import KeyMirror, StoreClient
client = lambda: StoreClient(sys.argv[1], block_bytes=4096, namespace="events")  # noqa: E731
mirror = KeyMirror(client, silence=60)
mirror.wait_ready(20)
print("ready", flush=True)
for line in sys.stdin:  # each line: print what the mirror holds, and how often it resynced
    print(mirror.resyncs, ",".join(sorted(k.hex() for k in (mirror.keys() or ()))), flush=True)
"""


@pytest.mark.slow
def test_a_frozen_subscriber_the_server_dropped_messages_for_resyncs() -> None:
    """The subscriber's process is stopped (SIGSTOP) while a burst of changes goes out:
    its socket fills, the server's high-water mark (1 message here) drops what follows.
    Once it runs again it sees the gap, reads a snapshot and holds the server's keys. Its
    silence bound is 60 s, so only the gap, or the server saying its subscription lapsed
    (a burst longer than the 5 s it may go unrenewed), can have made it resync within
    the test's 60 s: before the lapse was answered, a slow burst cost a minute here."""
    served = ServeProcess("--events-port", "0", "--events-hwm", "1", *_SMALL)
    proc = spawn_python(_FROZEN_MIRROR, served.address)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        with _client(served) as client:
            universe: list[bytes] = []
            blocks = payloads(keys(0, 500), BB)  # any bytes: the keys are what is heard
            for r in range(200):  # 400 messages of 500 keys: past what the sockets hold
                ks = keys(100_000 + r * 500, 100_000 + r * 500 + 500)
                client.put(ks, blocks)
                client.clear()
                universe += ks
            client.put(universe[:300], blocks[:300])  # what the mirror must end with
            os.kill(proc.pid, signal.SIGCONT)
            want = ",".join(sorted(k.hex() for k in _truth(client, universe)))

            def holds() -> bool:
                proc.stdin.write("?\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                resyncs, _, held = proc.stdout.readline().strip().partition(" ")  # type: ignore[union-attr]
                return held == want and int(resyncs) > 1

            until(holds, "the unfrozen mirror resynced and holds the server's keys", timeout=60)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        reap(proc)
        served.kill()


@pytest.mark.slow
def test_a_subscription_that_lapsed_is_told_so_at_its_next_renewal() -> None:
    """A subscriber that renewed nothing for longer than the server's 5 s (frozen, paused)
    is dropped; its next renewal is answered ``LAPSED`` and it learns at once that it must
    subscribe again, instead of waiting out its silence bound. The server's clock is a
    fake one; a second subscriber, subscribed after the lapse, hears the heartbeat that
    follows the drop."""
    clock, mine = FakeClock(), FakeClock()
    config = ServerConfig(port=0, host_capacity=CAPACITY, events_port=0, handoff_ttl=0)
    with (
        CacheServer(config, clock=clock) as server,
        StoreClient(server.address, block_bytes=BB, namespace="lapse", timeout=10) as client,
        EventSubscriber(client.subscription(), mine) as lapsing,
    ):
        until(lambda: lapsing.receive(0.05) is not None, "subscribed: where the stream is")
        clock.advance(6.0)  # past the subscription's 5 s: it renewed nothing meanwhile
        with EventSubscriber(client.subscription(), FakeClock()) as witness:
            until(lambda: witness.receive(0.05) is not None, "the witness is subscribed")
            clock.advance(1.5)  # a heartbeat: it drops the lapsed subscriber, then goes out
            until(lambda: witness.receive(0.05) is not None, "the witness heard a heartbeat")
        lapsing.drain()
        mine.advance(1.0)  # its next receive renews
        with pytest.raises(SubscriptionLost, match="lapse"):
            until(lambda: lapsing.receive(0.05) is None and False, "the lapse was answered")


@pytest.mark.slow
def test_only_a_session_that_opened_the_namespace_hears_it(server: ServeProcess) -> None:
    """Nobody without a ticket hears a stream: a SUB to every topic, a DEALER that brings
    nothing, a made-up ticket, the ticket once it was used, a valid ticket from a peer
    whose routing id the server chose (guessable), and a peer that floods the socket
    with subscription-like messages while the owner subscribes (what broke an XPUB in
    manual mode: libzmq applied the owner's subscription to the flooder). A session asks
    for a ticket only of a namespace it opened."""
    with _client(server) as owner, _client(server, "other") as other:
        sub = owner.subscription()
        honest = EventSubscriber(sub)  # the ticket's first use: it subscribes this one
        heard: list[Message] = []
        until(lambda: _heard(honest, heard, changes=False), "the ticket's holder is subscribed")
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        everything = context.socket(zmq.SUB)
        everything.setsockopt(zmq.SUBSCRIBE, b"")
        everything.connect(sub.endpoint)
        attackers = [everything]
        for body in (None, EVENT_TICKET_PREFIX + b"\x00" * 16, sub.request):  # used: nothing
            attackers.append(_dealer(context, sub.endpoint, body, chosen_id=True))
        flooder = _dealer(context, sub.endpoint, None, chosen_id=True)
        attackers.append(flooder)
        for _ in range(200):
            flooder.send_multipart([b"\x02x"])
            flooder.send_multipart([b"\x01z"])
        assigned_id = _dealer(context, sub.endpoint, owner.subscription().request, chosen_id=False)
        attackers.append(assigned_id)
        with honest, _mirror(server) as mirror:  # the mirror subscribes beside the flood
            assert mirror.wait_ready(20)
            ks = keys(0, 50)
            owner.put(ks, payloads(ks, BB))
            until(lambda: mirror.leading(ks) == 50, "the owner's mirror heard the put")
            until(lambda: _heard(honest, heard), "the ticket's holder hears the put")
        for socket in attackers:
            assert socket.poll(300) == 0  # not a heartbeat, not a key
            socket.close()
        with pytest.raises(UnknownNamespace):
            raw(other).call({"op": "events", "ns": raw(owner).ns})  # not its namespace


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, body: bytes | None, *, chosen_id: bool
) -> zmq.Socket[bytes]:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if chosen_id:
        socket.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
    socket.connect(endpoint)
    if body is not None:
        socket.send(body)
    return socket


def _heard(stream: EventSubscriber, heard: list[Message], *, changes: bool = True) -> bool:
    message = stream.receive(0.1)
    if message is not None:
        heard.append(message)
    return any(m.changes for m in heard) if changes else bool(heard)


def test_a_server_without_an_events_port_says_so() -> None:
    served = ServeProcess(*_SMALL)
    try:
        with _client(served) as client, pytest.raises(BadRequest, match="events-port"):
            client.subscription()
    finally:
        served.kill()


@pytest.mark.slow
def test_kvbridge_events_prints_json_lines_and_one_line_errors(server: ServeProcess) -> None:
    """``kvbridge events``: a snapshot, then each message as a JSON line (keys in hex, a
    chain's token ids as they were saved); against a server without events, one line and
    exit status 1."""
    args = [sys.executable, "-m", "kvbridge", "events", server.address]
    args += ["--namespace", "events", "--block-bytes", str(BB), "--snapshot", "--count", "1"]
    saver = StoreClient(server.address, block_bytes=BB, namespace="events", block_tokens=2)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the snapshot: subscribed by now
        assert first["snapshot"]["keys"] == []
        ks = keys(0, 3)
        head = keys(9, 10)[0]  # the chain goes on from a block saved before
        lineage = [Lineage.of(up, [n, n]) for n, up in enumerate([head, *ks[:-1]])]
        saver.put(ks, payloads(ks, BB), lineage=lineage)
        line = json.loads(proc.stdout.readline())
        event = line["events"][0]
        assert event["type"] == "BlockStored" and event["block_hashes"] == [k.hex() for k in ks]
        assert (event["parent_block_hash"], event["token_ids"]) == (head.hex(), [0, 0, 1, 1, 2, 2])
        assert proc.wait(30) == 0
    finally:
        saver.close()
        reap(proc)
    plain = ServeProcess(*_SMALL)
    try:
        args[4] = plain.address
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    finally:
        plain.kill()
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "events-port" in done.stderr
