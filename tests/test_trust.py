"""The cache server's trust boundary, attacked as a hostile client or a fault would.

Each test runs a real ``kvbridge serve`` process (unless it needs to reach inside a server),
over TCP and over UCX, and drives it the way an attacker would: with stolen or replayed
session material, frames sent by hand, late bytes, guessed handles and slots. What must
hold: no reader ever gets bytes that are not the ones committed under the key, no session
touches another's slots or another namespace's blocks, and a fault stays with the request
that met it.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from attack import (
    RawStream,
    abort,
    control_request,
    credentials,
    descriptors,
    raw,
    slot_ops,
    stage,
    write_ops,
)
from helpers import keys, payloads, until
from serve import (
    BLOCK,
    SLOTS,
    TRANSPORTS,
    ServeProcess,
    client_of,
    namespaces,
    small_config,
    small_server,
    two_sided,
)

from kvbridge.store import CacheServer, LeaseExpired, StoreClient, StoreFull
from kvbridge.transfer import LocalProtocolError, TransferError
from kvbridge.transfer._events import Ack, Data, Error
from kvbridge.transfer._protocol import ErrorCode

BB = BLOCK


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(transport: str) -> Iterator[ServeProcess]:
    s = small_server(transport)
    yield s
    s.kill()


# -- wrong bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["abort", "session"])
def test_a_late_write_never_lands_in_a_slot_handed_to_someone_else(
    transport: str, ending: str
) -> None:
    """A write admitted while its lease was open whose bytes arrive after the lease ended
    (aborted; or the writer's session ended while a stream of it still sends): the slots
    stay out of use until the bytes are in, so the victim's blocks never get them. (In this
    process: the test waits for the server to have admitted the write.)"""
    two_sided(transport)
    with (
        CacheServer(small_config(transport)) as server,
        client_of(server, transports=transport) as attacker,
        client_of(server, transports=transport) as victim,
    ):
        lease, slots = stage(attacker, keys(0, 2))
        stream = RawStream(attacker)
        stream.start_write(slot_ops(attacker, slots))
        stream.send(b"\xaa" * BB)  # half of the payload: the first op's
        (ns,) = [n for n in namespaces(server) if n.handle == raw(attacker).ns]
        until(lambda: ns.leases.in_flight(lease) > 0, "the server admitted the write")
        if ending == "abort":
            raw(attacker).op("abort", lease=lease)
        else:  # the session says goodbye mid-write: its leases end with it
            session = credentials(attacker.peer)
            assert control_request(server.address, session.sign("bye", b""))["ok"]
        whole = keys(100, 100 + SLOTS)  # as many blocks as the namespace has slots
        with pytest.raises(StoreFull):  # two of them are still being written
            victim.put(whole, payloads(whole, BB))
        theirs = whole[: SLOTS - 2]  # every other slot
        victim.put(theirs, payloads(theirs, BB))
        stream.send(b"\xaa" * BB)  # the late bytes
        assert isinstance(stream.event(), Ack)  # they landed, in the ended lease's slots
        assert victim.match_prefix(theirs) == SLOTS - 2
        out = np.zeros((len(theirs), BB), np.uint8)
        victim.get(theirs, out)
        np.testing.assert_array_equal(out, payloads(theirs, BB))
        more = keys(200, 202)  # and now the two slots are free again
        victim.put(more, payloads(more, BB))
        assert victim.match_prefix(more) == 2
        stream.close()


@pytest.mark.slow
def test_a_session_cannot_write_another_sessions_staged_slots(
    server: ServeProcess, transport: str
) -> None:
    two_sided(transport)
    with (
        client_of(server, transports=transport) as attacker,
        client_of(server, transports=transport) as victim,
    ):
        ks = keys(0, 2)
        lease, slots = stage(victim, ks)
        own, _ = stage(attacker, keys(10, 11))  # the attacker holds a lease of its own too
        assert own
        stream = RawStream(attacker)
        stream.start_write(slot_ops(attacker, slots))
        for _ in slots:  # op by op (over UCX each op is a message)
            stream.send(b"\xbb" * BB)
        answer = stream.event()
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        with pytest.raises(TransferError) as refused:  # and through the engine's own path
            attacker.peer.write(_engine_ops(attacker, slots)).wait(10)
        assert refused.value.code == ErrorCode.ACCESS_DENIED
        with pytest.raises(LeaseExpired):  # nor commit the victim's lease
            raw(attacker).op("commit", lease=lease)
        raw(attacker).op("abort", lease=lease)  # a no-op for it
        own_stream = RawStream(victim)  # the lease is still the victim's: it writes, commits
        own_stream.start_write(slot_ops(victim, slots))
        for block in payloads(ks, BB):
            own_stream.send(block.tobytes())
        assert isinstance(own_stream.event(), Ack)
        assert raw(victim).op("commit", lease=lease)["stored"] == 2
        own_stream.close()
        out = np.zeros((2, BB), np.uint8)
        victim.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        stream.close()


PAGES = 16
"""Pages per block in the page-shaped frames below (more than a frame's scalar fast path)."""


def _page_ops(client: StoreClient, slots: list[int]) -> np.ndarray:
    """Descriptors of every page of the blocks at ``slots``, in order: a run of ops that
    continue one another across a block's slot (and across neighbouring slots)."""
    page = BB // PAGES
    spans = [(slot * BB + i * page, page) for slot in slots for i in range(PAGES)]
    region = raw(client).region
    return descriptors(region, client.peer.refresh()[region].key, spans)


def _send_pages(stream: RawStream, data: bytes) -> None:
    stream.send_payload(data, [BB // PAGES] * (len(data) * PAGES // BB))


@pytest.mark.slow
def test_a_run_of_pages_into_a_neighbours_slot_is_refused_whole(
    server: ServeProcess, transport: str
) -> None:
    """Pages of one's own staged slot followed by pages of the next slot, staged by another
    session: bytes that continue one another in the region, but the frame is refused whole
    and nothing lands in either slot."""
    two_sided(transport)
    with (
        client_of(server, transports=transport) as attacker,
        client_of(server, transports=transport) as victim,
    ):
        own_lease, own = stage(attacker, keys(0, 1))
        victim_lease, theirs = stage(victim, keys(10, 12))
        neighbour = [s for s in theirs if abs(s - own[0]) == 1]
        assert neighbour, "the two stagings got slots that are not neighbours"
        run = sorted([own[0], neighbour[0]])
        stream = RawStream(attacker)
        stream.start_write(_page_ops(attacker, run))
        _send_pages(stream, b"\xbb" * (2 * BB))
        answer = stream.event()
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        own_stream = RawStream(victim)
        own_stream.start_write(_page_ops(victim, sorted(theirs)))
        _send_pages(own_stream, payloads(keys(10, 12), BB)[np.argsort(theirs)].tobytes())
        assert isinstance(own_stream.event(), Ack)
        assert raw(victim).op("commit", lease=victim_lease)["stored"] == 2
        out = np.zeros((2, BB), np.uint8)
        victim.get(keys(10, 12), out)
        np.testing.assert_array_equal(out, payloads(keys(10, 12), BB))
        abort(attacker, own_lease)
        stream.close()
        own_stream.close()


@pytest.mark.slow
def test_a_read_of_pages_is_refused_whole_for_one_page_not_pinned(
    server: ServeProcess, transport: str
) -> None:
    """A frame naming each pinned slot once per page, and one page of a slot the session
    did not pin: refused whole. The pinned pages alone read back exactly."""
    two_sided(transport)
    with client_of(server, transports=transport) as reader:
        ks = keys(0, 3)
        reader.put(ks, payloads(ks, BB))
        pinned = raw(reader).op("pin", keys=ks[:2])
        slots = [int(s) for s in pinned["slots"]]
        other = raw(reader).op("pin", keys=ks[2:])  # the third block's slot, then let go
        raw(reader).op("release", lease=other["lease"])
        stream = RawStream(reader)
        ops = _page_ops(reader, [*slots, int(other["slots"][0])])
        answer, _ = stream.read(np.concatenate([ops[: 2 * PAGES], ops[-1:]]))
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        answer, payload = stream.read(ops[: 2 * PAGES])
        assert isinstance(answer, Data)
        assert payload == payloads(ks[:2], BB).tobytes()
        raw(reader).op("release", lease=pinned["lease"])
        stream.close()


def _engine_ops(client: StoreClient, slots: list[int]) -> np.ndarray:
    source = client.engine.register(np.full(len(slots) * BB, 0xCC, np.uint8), access="none")
    return write_ops(client, source, slots)


# -- reads ------------------------------------------------------------------------------


@pytest.mark.slow
def test_reads_only_from_slots_pinned_for_the_reading_session(
    server: ServeProcess, transport: str
) -> None:
    """Another namespace's region (keys from the metadata every session gets), one's own
    namespace unpinned, another session's pins: all refused. One's own pin: read."""
    two_sided(transport)
    with (
        client_of(server, "tenant-a", transport) as a,
        client_of(server, "tenant-b", transport) as b,
    ):
        ks = keys(0, 2)
        a.put(ks, payloads(ks, BB))
        pinned = raw(a).op("pin", keys=ks)
        slots = [int(s) for s in pinned["slots"]]
        thief = RawStream(b)
        answer, _ = thief.read(slot_ops(b, slots, region=raw(a).region))  # tenant-a's memory
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        with client_of(
            server, "tenant-a", transport
        ) as neighbour:  # same namespace, its own session
            stream = RawStream(neighbour)
            answer, _ = stream.read(slot_ops(neighbour, slots))  # pinned by a, not by it
            assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
            stream.close()
        own = RawStream(a)
        answer, payload = own.read(slot_ops(a, slots))
        assert isinstance(answer, Data)
        assert payload == payloads(ks, BB).tobytes()
        raw(a).op("release", lease=pinned["lease"])
        answer, _ = own.read(slot_ops(a, slots))  # released: no more reads
        assert isinstance(answer, Error)
        thief.close()
        own.close()


@pytest.mark.slow
def test_a_namespace_handle_works_only_for_a_session_that_opened_it(
    server: ServeProcess, transport: str
) -> None:
    with (
        client_of(server, "tenant-a", transport) as a,
        client_of(server, "tenant-b", transport) as b,
    ):
        a.put(keys(0, 1), payloads(keys(0, 1), BB))
        for op in ("match", "contains", "remove"):
            with pytest.raises(LookupError, match="open it first"):
                raw(b).call({"op": op, "ns": raw(a).ns, "keys": keys(0, 1)})
        assert a.contains(keys(0, 1)) == [True]
        stats = b.server_stats()["namespaces"]
        assert "tenant-a" not in str(stats) and any("tenant-b" in n["name"] for n in stats)


# -- sessions ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_session_id_seen_on_the_wire_is_worth_nothing(
    server: ServeProcess, transport: str
) -> None:
    """The session id travels in clear; requests are signed with a key that never does.
    Forged, replayed and after-disconnect requests are all refused with a code."""
    victim = client_of(server, transports=transport)
    session = credentials(victim.peer)
    body = b"\x81\xa2op\xa5stats"  # {"op": "stats"}
    forged = {"op": "call", "session": session.id, "seq": 10**6, "body": body, "mac": bytes(32)}
    answer = control_request(server.address, forged)
    assert answer["ok"] is False and answer["code"] == 2  # ControlCode.AUTHENTICATION
    captured = session.sign("call", body)  # a real request, as sniffed
    assert control_request(server.address, captured)["ok"] is True
    replayed = control_request(server.address, captured)
    assert replayed["ok"] is False and "replayed" in replayed["error"]
    later = session.sign("call", body)  # signed while the session lives
    victim.close()  # the client goes: its session ends with its streams

    def ended() -> bool:  # asked with requests signed after the close
        return not control_request(server.address, session.sign("call", body))["ok"]

    until(ended, "the session ended with the client's streams")
    gone = control_request(server.address, later)
    assert gone["ok"] is False and "unknown or ended session" in gone["error"]


@pytest.mark.slow
def test_the_clients_own_engine_exposes_nothing(server: ServeProcess, transport: str) -> None:
    """A StoreClient's engine only dials: it has no control socket, no data listener, no
    metadata a local process could connect with (``test_dial_only.py`` counts the sockets),
    so a buffer the client registered is out of any other process's reach. (It used to
    listen, and refused a write that knew the region's key: there is nothing to refuse
    now.)"""
    with client_of(server, transports=transport) as client:
        buffer = np.zeros(BB, np.uint8)
        client.register(buffer)
        with pytest.raises(LocalProtocolError, match="only dials"):
            client.engine.metadata()
        with pytest.raises(LocalProtocolError, match="only dials"):
            _ = client.engine.address
        assert not buffer.any()


@pytest.mark.slow
def test_thousands_of_handshakes_and_a_hello_flood_log_nobody_out(
    server: ServeProcess, transport: str
) -> None:
    """A monitor polling (each poll a new session it abandons), plus unanswered hellos by
    the thousand: a long-lived client keeps its session, and new clients still get in."""
    import zmq  # noqa: PLC0415

    from kvbridge.transfer._control import CONTROL_VERSION  # noqa: PLC0415
    from kvbridge.transfer._control_client import ControlClient  # noqa: PLC0415

    with client_of(server, transports=transport) as client:
        ks = keys(0, 2)
        client.put(ks, payloads(ks, BB))
        context = zmq.Context()
        flood = context.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(f"tcp://{server.address}")
        for i in range(5000):
            hello = {
                "op": "hello",
                "v": CONTROL_VERSION,
                "name": "x",
                "nonce": i.to_bytes(16, "big"),
            }
            flood.send_multipart([b"", msgpack.packb(hello)])
        poller = ControlClient(context, f"tcp://{server.address}", 10.0)
        for _ in range(4200):  # more than the session table holds
            poller.handshake("monitor", None)
        poller.close()
        flood.close()
        context.term()
        out = np.zeros((2, BB), np.uint8)
        client.get(ks, out)  # still the same session: no "unknown session"
        np.testing.assert_array_equal(out, payloads(ks, BB))
        with client_of(server, transports=transport) as newcomer:
            assert newcomer.match_prefix(ks) == 2


# -- garbage on the control port, from a socket and signed as a client ------------------


@pytest.mark.slow
def test_fuzzed_control_port_while_a_client_keeps_working(
    server: ServeProcess, transport: str
) -> None:
    rng = np.random.default_rng(1)
    context = zmq.Context()
    fuzzer = context.socket(zmq.DEALER)
    fuzzer.setsockopt(zmq.LINGER, 0)
    fuzzer.connect(f"tcp://{server.address}")
    ks = keys(500, 504)
    try:
        with StoreClient(
            server.address, block_bytes=BB, namespace="m", transports=transport
        ) as client:
            session = credentials(client.peer)  # junk signed as the client: it reaches the handler
            for round_ in range(300):
                kind = round_ % 3
                if kind == 0:
                    body = rng.bytes(int(rng.integers(0, 200)))
                elif kind == 1:
                    junk = msgpack.packb(_random_message(rng), use_bin_type=True)
                    body = msgpack.packb(session.sign("call", junk), use_bin_type=True)
                else:
                    body = msgpack.packb(_random_message(rng), use_bin_type=True)
                fuzzer.send_multipart([b"", body])
                if round_ % 50 == 0:
                    client.put(ks, payloads(ks, BB))
                    out = np.zeros((4, BB), np.uint8)
                    client.get(ks, out)
                    np.testing.assert_array_equal(out, payloads(ks, BB))
            answered = 0
            while fuzzer.poll(2000):
                fuzzer.recv_multipart()
                answered += 1
            assert answered == 300  # every junk message got an (error) answer
            assert client.match_prefix(ks) == 4
    finally:
        fuzzer.close()
        context.term()
    assert server.proc.poll() is None


def _random_message(rng: np.random.Generator) -> object:
    ops = ["open", "stage", "commit", "pin", "release", "match", "remove", "stats", "abort", 7]
    values: list[object] = [
        None,
        -1,
        2**64 - 1 if rng.random() < 0.1 else int(rng.integers(-5, 5)),
        rng.bytes(int(rng.integers(0, 40))),
        "x" * int(rng.integers(0, 5)),
        [rng.bytes(32)] * int(rng.integers(0, 3)),
        [1, 2],
        {"a": 1},
        1.5,
    ]
    message: dict[str, object] = {"op": ops[int(rng.integers(0, len(ops)))]}
    for name in ("ns", "keys", "lease", "namespace", "block_bytes"):
        if rng.random() < 0.7:
            message[name] = values[int(rng.integers(0, len(values)))]
    return message
