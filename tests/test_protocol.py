"""The sans-IO stream protocol: round trips, illegal transitions, and fuzzing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.transfer import LocalProtocolError, RemoteProtocolError
from kvbridge.transfer._events import Ack, Data, Error, Hello, Notify, Ping, Pong, Read, Write
from kvbridge.transfer._protocol import (
    DESCRIPTOR,
    HEADER,
    MAX_OPS_PER_FRAME,
    PING_IDS,
    VERSION,
    Connection,
    ErrorCode,
    Frame,
    Role,
)

TOKEN = bytes(range(64))  # a HELLO body: session id, nonce, MAC


def ops(*lengths: int) -> np.ndarray:
    out = np.zeros(len(lengths), DESCRIPTOR)
    out["region"] = 1
    out["key"] = 42
    out["offset"] = np.cumsum((0, *lengths[:-1]))
    out["length"] = lengths
    return out


def deliver(receiver: Connection, data: bytes) -> list[object]:
    """Feed ``data`` the way a transport does; payload bytes are returned as events too."""
    events: list[object] = []
    view = memoryview(data)
    while view:
        wanted = receiver.wanted()
        if wanted == 0:
            raise AssertionError("payload pending")
        if len(view) < wanted:
            break
        event = receiver.feed(view[:wanted])
        view = view[wanted:]
        if isinstance(event, (Write, Data)):
            events.append(event)
            events.append(bytes(view[: event.payload_bytes]))
            view = view[event.payload_bytes :]
            receiver.payload_received()
        elif event is not None:
            events.append(event)
    return events


def pair() -> tuple[Connection, Connection]:
    initiator, responder = Connection(Role.INITIATOR), Connection(Role.RESPONDER)
    assert deliver(responder, initiator.hello(TOKEN, 3)) == [Hello(TOKEN, 3)]
    assert deliver(initiator, responder.ack(0)) == [Ack(0)]
    return initiator, responder


def test_write_ack_read_data_notify_error_round_trips() -> None:
    initiator, responder = pair()
    write_ops = ops(3, 5)
    frame = initiator.write(7, write_ops) + b"abc" + b"defgh"
    events = deliver(responder, frame)
    assert isinstance(events[0], Write) and events[0].request_id == 7
    assert events[0].payload_bytes == 8 and events[1] == b"abcdefgh"
    np.testing.assert_array_equal(events[0].ops, write_ops)
    assert deliver(initiator, responder.ack(7)) == [Ack(7)]

    read = deliver(responder, initiator.read(8, ops(4)))
    assert isinstance(read[0], Read) and read[0].request_id == 8
    assert deliver(initiator, responder.data(8, 1, 4) + b"wxyz") == [Data(8, 4), b"wxyz"]

    assert deliver(responder, initiator.notify(9, b"req-1")) == [Notify(9, b"req-1")]
    assert deliver(initiator, responder.ack(9)) == [Ack(9)]

    deliver(responder, initiator.read(10, ops(4)))
    assert deliver(
        initiator, responder.error(10, ErrorCode.ACCESS_DENIED, "no such region", 0)
    ) == [Error(10, 0, ErrorCode.ACCESS_DENIED, "no such region")]


def _fails(receiver: Connection, data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        deliver(receiver, data)
    assert receiver.failure is not None
    with pytest.raises(RemoteProtocolError, match="failed earlier"):  # sticky
        receiver.wanted()


def test_responder_needs_hello_first_and_only_once() -> None:
    _fails(Connection(Role.RESPONDER), Connection(Role.INITIATOR).notify(1, b""), "before HELLO")
    _, responder = pair()
    _fails(responder, Connection(Role.INITIATOR).hello(TOKEN, 0), "HELLO twice")


def test_roles_may_only_receive_what_the_other_side_sends() -> None:
    initiator, _ = pair()
    _fails(initiator, Connection(Role.INITIATOR).notify(5, b"x"), "may not send NOTIFY")


def test_answers_must_match_outstanding_requests() -> None:
    initiator, responder = pair()
    _fails(initiator, responder.ack(99), "unknown request 99")
    initiator, responder = pair()
    initiator.read(5, ops(4))
    _fails(initiator, responder.data(5, 1, 5) + b"12345", "expected 1 / 4")
    initiator, responder = pair()
    initiator.write(6, ops(4))
    _fails(initiator, responder.data(6, 1, 4) + b"1234", "unknown read request")


def test_frame_limits() -> None:
    _, responder = pair()
    header = HEADER.pack(b"KV", VERSION, 2, MAX_OPS_PER_FRAME + 1, 1, 10)  # WRITE with too many ops
    _fails(responder, header, "ops")
    _, responder = pair()
    header = HEADER.pack(b"KV", VERSION, 7, 0, 1, 1 << 20)  # NOTIFY with a 1 MiB body
    _fails(responder, header, "exceeds")
    _, responder = pair()
    body = ops(4).tobytes()
    _fails(responder, HEADER.pack(b"KV", VERSION, 2, 1, 1, len(body) + 9) + body, "payload")
    _, responder = pair()
    _fails(responder, HEADER.pack(b"XX", 1, 2, 1, 1, 0), "magic")
    _, responder = pair()
    _fails(responder, HEADER.pack(b"KV", 9, 2, 1, 1, 0), "version")


def test_the_greeting_names_the_keepalive_and_a_ping_is_answered_once() -> None:
    initiator, responder = Connection(Role.INITIATOR), Connection(Role.RESPONDER)
    deliver(responder, initiator.hello(TOKEN, 0))
    assert deliver(initiator, responder.welcome(2.5)) == [Ack(0)]
    assert initiator.keepalive == 2.5
    (ping,) = deliver(responder, initiator.ping())
    assert isinstance(ping, Ping) and ping.request_id >= PING_IDS
    assert deliver(initiator, responder.pong(ping.request_id)) == [Pong(ping.request_id)]
    _fails(initiator, responder.pong(ping.request_id), "unknown request")  # answered already


def test_keepalive_frames_follow_the_rules() -> None:
    initiator, responder = pair()
    ping = deliver(responder, initiator.ping())[0]
    assert isinstance(ping, Ping)
    _fails(initiator, responder.error(ping.request_id, ErrorCode.REFUSED, "no"), "answers a PING")
    initiator, responder = pair()
    deliver(responder, initiator.ping())
    _fails(initiator, HEADER.pack(b"KV", VERSION, Frame.PONG, 0, PING_IDS, 3), "with a body")
    initiator = Connection(Role.INITIATOR)
    initiator.hello(TOKEN, 0)
    _fails(initiator, HEADER.pack(b"KV", VERSION, Frame.ACK, 10, 0, 0), "below 50")
    initiator, responder = pair()
    initiator.write(3, ops(1))
    _fails(initiator, HEADER.pack(b"KV", VERSION, Frame.ACK, 5000, 3, 0), "ACK with a count")
    with pytest.raises(LocalProtocolError):
        responder.welcome(0.001)
    with pytest.raises(LocalProtocolError, match="may not send PING"):
        responder.ping()


def test_local_misuse_is_a_local_error() -> None:
    initiator, responder = pair()
    with pytest.raises(LocalProtocolError):
        initiator.write(1, ops(0))  # empty op
    with pytest.raises(LocalProtocolError):
        initiator.write(1, np.zeros(MAX_OPS_PER_FRAME + 1, DESCRIPTOR))
    initiator.write(2, ops(1))
    with pytest.raises(LocalProtocolError, match="already outstanding"):
        initiator.write(2, ops(1))
    with pytest.raises(LocalProtocolError, match="may not send"):
        responder.write(3, ops(1))
    with pytest.raises(LocalProtocolError):
        initiator.notify(4, bytes(1 << 17))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600), st.sampled_from([Role.INITIATOR, Role.RESPONDER]))
def test_any_bytes_give_events_or_a_protocol_error(data: bytes, role: Role) -> None:
    receiver = Connection(role)
    if role is Role.INITIATOR:  # give answers something to match, as a live stream would
        receiver.read(1, ops(8))
        receiver.write(2, ops(8))
    try:
        events = deliver(receiver, data)
    except RemoteProtocolError:
        return
    for event in events:
        assert isinstance(event, (Hello, Write, Read, Notify, Ack, Data, Error, Ping, Pong, bytes))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=20))
def test_write_frames_of_any_shape_round_trip(lengths: list[int]) -> None:
    initiator, responder = pair()
    payload = bytes(range(256)) * (sum(lengths) // 256 + 1)
    frame = initiator.write(11, ops(*lengths)) + payload[: sum(lengths)]
    events = deliver(responder, frame)
    assert isinstance(events[0], Write) and events[1] == payload[: sum(lengths)]
