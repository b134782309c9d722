"""The data-stream wire protocol, sans IO: framing, limits and legal transitions.

Everything that decides what is legal on a data stream lives in this file; transports only
move bytes (h11's rule). A :class:`Connection` is fed exactly the framing bytes it asks for
(``wanted()`` then ``feed()``) and returns events; payload bytes never pass through it: after
a :class:`Write` or :class:`Data` event the transport moves ``payload_bytes`` bytes straight
between the socket and their destination (``recv_into``) and calls ``payload_received()``.

Frame = 24-byte header + body::

    header  magic "KV" | version u8 | type u8 | count u32 | request_id u64 | body_len u64

    HELLO   initiator -> responder, first frame of a stream; count = stream index,
            body = session id, nonce and their MAC under the session key (64 bytes)
    WRITE   initiator -> responder; count = n ops, body = n descriptors + their payloads
    READ    initiator -> responder; count = n ops, body = n descriptors
    NOTIFY  initiator -> responder; body = message (after every byte of a batch landed)
    PING    initiator -> responder; empty, request_id from PING_IDS up (see Keepalive)
    ACK     responder -> initiator; empty (HELLO, WRITE and NOTIFY are acknowledged); the
            HELLO's ACK carries the keepalive interval in ms in count (0: none)
    DATA    responder -> initiator; count = n, body = the payloads of READ request_id
    ERROR   responder -> initiator; count = failing op index (NO_OP if none),
            body = code u32 (:class:`ErrorCode`, or an application's own from 1000) + message
    PONG    responder -> initiator; empty, answers the PING of request_id

    descriptor (32 bytes): region u32 | flags u32 (0) | key u64 | offset u64 | length u64

All integers are little-endian. A frame breaking a rule is a :class:`RemoteProtocolError`
and the connection stays failed (sticky) with the reason.

Keepalive. A peer that dies or freezes without closing its streams must not hold what its
session holds for good, on any transport: TCP reports a killed process at once, but not a
host that vanished or a frozen process, and UCX over shared memory reports neither. So the
protocol carries its own: the responder names an interval in its answer to HELLO; an
initiator whose stream sent nothing for that long sends a PING, which the responder answers
with a PONG; a responder that hears nothing at all for :data:`KEEPALIVE_MISSES` intervals
closes the stream (its session then ends as after a TCP close), and an initiator whose PING,
sent while nothing else was outstanding, has no answer after as long closes the stream too.
The initiator pings because only it starts exchanges: a responder's one serving thread stays
the only writer of its stream and no timer thread ever writes to a pipe; the responder needs
only a deadline, which its engine's watchdog already keeps for frames. A busy stream never
pings (any frame proves its sender alive), so the data path pays one integer increment per
frame on the initiator and one clock read per frame on the responder.
"""

from __future__ import annotations

import enum
import struct
import threading
from dataclasses import dataclass

import numpy as np

from ._errors import LocalProtocolError, RemoteProtocolError
from ._events import Ack, Data, Error, Event, Hello, Notify, Ping, Pong, Read, Write

MAGIC = b"KV"
VERSION = 3
HEADER = struct.Struct("<2sBBIQQ")
HELLO_BYTES = 64
"""A HELLO body: session id (16), nonce (16), HMAC-SHA256 (32); see ``_sessions``."""
_CODE = struct.Struct("<I")
NO_OP = 0xFFFFFFFF
"""ERROR's op index when the error concerns no single op."""

DESCRIPTOR = np.dtype(
    [("region", "<u4"), ("flags", "<u4"), ("key", "<u8"), ("offset", "<u8"), ("length", "<u8")]
)

SMALL_OPS = 8
"""Batches and frames of up to this many ops take the small path: planned (``_small``),
checked (``_regions``) and parsed here with plain integers, where numpy's calls would cost
more than the work (a connector's single-block ops)."""

MAX_OPS_PER_FRAME = 1024
"""Linux's IOV_MAX: one sendmsg/recvmsg_into call can then carry every payload of a frame."""

MAX_PAYLOAD_BYTES = 1 << 30
"""No frame carries more than 1 GiB; senders cut frames far smaller (settings.frame_bytes)."""

MAX_CONTROL_BYTES = 64 << 10
"""HELLO, ERROR and NOTIFY bodies are small messages."""

KEEPALIVE_MISSES = 3
"""A responder closes a stream that sent nothing for this many keepalive intervals. An idle
initiator pings within two intervals of its last frame (it looks once per interval); the
third is slack for a peer's scheduling (a busy host, a long-held GIL)."""

MIN_KEEPALIVE_MS = 50
"""The shortest keepalive interval a responder may ask for: shorter would have initiators
ping as fast as they can."""

PING_IDS = 1 << 63
"""PING request ids count up from here, apart from the ids of an initiator's requests."""


class ErrorCode(enum.IntEnum):
    """Why a responder answered ERROR: an op was refused (unknown region, wrong key or mode,
    bytes outside, the region's guard; nothing written), the HELLO proved no live session,
    the notification handler refused the batch without a code of its own, or the responder
    failed inside."""

    ACCESS_DENIED = 1
    AUTHENTICATION = 2
    REFUSED = 3
    INTERNAL = 4


APP_CODES = 1000
"""Codes from here up are an application's own (a notification handler's refusals)."""


class Frame(enum.IntEnum):
    HELLO = 1
    WRITE = 2
    READ = 3
    DATA = 4
    ACK = 5
    ERROR = 6
    NOTIFY = 7
    PING = 8
    PONG = 9


class Role(enum.Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


SENDS: dict[Role, frozenset[Frame]] = {
    Role.INITIATOR: frozenset({Frame.HELLO, Frame.WRITE, Frame.READ, Frame.NOTIFY, Frame.PING}),
    Role.RESPONDER: frozenset({Frame.ACK, Frame.DATA, Frame.ERROR, Frame.PONG}),
}
"""Which frames each role may send; each role receives exactly what the other sends."""

ACKED_BY: dict[Frame, Frame] = {
    Frame.HELLO: Frame.ACK,
    Frame.WRITE: Frame.ACK,
    Frame.NOTIFY: Frame.ACK,
    Frame.READ: Frame.DATA,
    Frame.PING: Frame.PONG,
}
"""The successful answer to each request (any request but PING may be answered by ERROR)."""


class _State(enum.Enum):
    HEADER = "header"
    DESCRIPTORS = "descriptors"
    CONTROL = "control"
    PAYLOAD = "payload"
    FAILED = "failed"


@dataclass
class _Outstanding:
    kind: Frame
    count: int
    payload_bytes: int


class Connection:
    """One end of a data stream: parses what it receives, frames what it sends.

    Thread-safe in the one way transports need: one thread receives while others send.
    """

    def __init__(self, role: Role) -> None:
        self.role = role
        self._state = _State.HEADER
        self._failure: str | None = None
        self._header: tuple[Frame, int, int, int] | None = None  # type, count, request, body
        self._payload_left = 0
        self._greeted = role is Role.INITIATOR  # a responder must first see HELLO
        self._outstanding: dict[int, _Outstanding] = {}
        self._pings = PING_IDS
        self._keepalive = 0.0
        self._lock = threading.Lock()

    # -- receiving ---------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the connection failed, or ``None``."""
        return self._failure

    @property
    def keepalive(self) -> float:
        """Seconds after which an idle initiator must send a frame (a PING if nothing else),
        as the responder asked in its answer to HELLO; 0 for no keepalive."""
        return self._keepalive

    def wanted(self) -> int:
        """How many framing bytes ``feed`` needs next (0: move a payload first)."""
        if self._state is _State.HEADER:
            return HEADER.size
        if self._state is _State.FAILED:
            raise RemoteProtocolError(f"connection failed earlier: {self._failure}")
        if self._state is _State.PAYLOAD:
            return 0
        assert self._header is not None
        _, count, _, body = self._header
        return count * DESCRIPTOR.itemsize if self._state is _State.DESCRIPTORS else body

    def feed(self, data: bytes | bytearray | memoryview) -> Event | None:
        """Consume exactly ``wanted()`` bytes; return an event once a frame's framing is in."""
        if len(data) != self.wanted() or self._state is _State.PAYLOAD:
            raise LocalProtocolError(f"fed {len(data)} bytes, the parser wants {self.wanted()}")
        try:
            if self._state is _State.HEADER:
                return self._on_header(bytes(data))
            if self._state is _State.DESCRIPTORS:
                return self._on_descriptors(bytes(data))
            return self._on_control(bytes(data))
        except RemoteProtocolError as exc:
            self.fail(str(exc))
            raise

    def payload_received(self) -> None:
        """The transport has moved (or discarded) the payload of the last event."""
        if self._state is not _State.PAYLOAD:
            raise LocalProtocolError("no payload is expected")
        self._state = _State.HEADER

    def fail(self, reason: str) -> None:
        """Mark the connection failed for good (first reason wins)."""
        if self._failure is None:
            self._failure = reason
        self._state = _State.FAILED

    def _on_header(self, data: bytes) -> Event | None:
        magic, version, kind, count, request_id, body = HEADER.unpack(data)
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad magic {magic!r}")
        if version != VERSION:
            raise RemoteProtocolError(f"unsupported protocol version {version}")
        try:
            frame = Frame(kind)
        except ValueError:
            raise RemoteProtocolError(f"unknown frame type {kind}") from None
        other = Role.RESPONDER if self.role is Role.INITIATOR else Role.INITIATOR
        if frame not in SENDS[other]:
            raise RemoteProtocolError(f"a {other.value} may not send {frame.name}")
        if not self._greeted and frame is not Frame.HELLO:
            raise RemoteProtocolError(f"{frame.name} before HELLO")
        if self._greeted and frame is Frame.HELLO and self.role is Role.RESPONDER:
            raise RemoteProtocolError("HELLO twice")
        if body > MAX_PAYLOAD_BYTES + MAX_OPS_PER_FRAME * DESCRIPTOR.itemsize:
            raise RemoteProtocolError(f"frame body of {body} bytes exceeds the limit")
        self._header = (frame, count, request_id, body)
        if frame in (Frame.WRITE, Frame.READ):
            if not 0 < count <= MAX_OPS_PER_FRAME:
                raise RemoteProtocolError(f"{frame.name} with {count} ops")
            if body < count * DESCRIPTOR.itemsize:
                raise RemoteProtocolError(f"{frame.name} body shorter than its descriptors")
            if frame is Frame.READ and body != count * DESCRIPTOR.itemsize:
                raise RemoteProtocolError("READ carries a payload")
            self._state = _State.DESCRIPTORS
            return None
        if frame is Frame.DATA:
            return self._on_data(request_id, count, body)
        if frame is Frame.ACK:
            return self._on_ack(request_id, count, body)
        if frame in (Frame.PING, Frame.PONG):
            return self._on_ping(frame, request_id, count, body)
        if body > MAX_CONTROL_BYTES:
            raise RemoteProtocolError(f"{frame.name} body of {body} bytes exceeds the limit")
        if frame is Frame.HELLO and body != HELLO_BYTES:
            raise RemoteProtocolError("HELLO without a session greeting")
        if frame is Frame.ERROR and body < _CODE.size:
            raise RemoteProtocolError("ERROR without a code")
        self._state = _State.CONTROL
        if body == 0:
            return self._on_control(b"")
        return None

    def _on_ack(self, request_id: int, count: int, body: int) -> Event:
        if body:
            raise RemoteProtocolError("ACK with a body")
        if self._settle(request_id, Frame.ACK) is not Frame.HELLO:
            if count:
                raise RemoteProtocolError("ACK with a count")
        elif count and count < MIN_KEEPALIVE_MS:
            raise RemoteProtocolError(f"keepalive of {count} ms is below {MIN_KEEPALIVE_MS}")
        else:
            self._keepalive = count / 1000
        return Ack(request_id)

    def _on_ping(self, frame: Frame, request_id: int, count: int, body: int) -> Event:
        if body or count:
            raise RemoteProtocolError(f"{frame.name} with a body")
        if frame is Frame.PING:
            return Ping(request_id)
        self._settle(request_id, Frame.PONG)
        return Pong(request_id)

    def _on_descriptors(self, data: bytes) -> Event:
        assert self._header is not None
        frame, count, request_id, body = self._header
        ops = np.frombuffer(data, dtype=DESCRIPTOR, count=count)
        payload = _payload(ops, RemoteProtocolError(f"{frame.name} with an empty or oversized op"))
        if frame is Frame.READ:
            if payload > MAX_PAYLOAD_BYTES:
                raise RemoteProtocolError(f"READ of {payload} bytes exceeds the limit")
            self._state = _State.HEADER
            return Read(request_id, ops)
        if payload != body - len(data):
            raise RemoteProtocolError(
                f"WRITE body has {body - len(data)} payload bytes, its ops say {payload}"
            )
        self._state = _State.PAYLOAD
        return Write(request_id, ops, payload)

    def _on_data(self, request_id: int, count: int, body: int) -> Event:
        with self._lock:
            pending = self._outstanding.get(request_id)
        if pending is None or pending.kind is not Frame.READ:
            raise RemoteProtocolError(f"DATA for unknown read request {request_id}")
        if count != pending.count or body != pending.payload_bytes:
            raise RemoteProtocolError(
                f"DATA for request {request_id} has {count} ops / {body} bytes, "
                f"expected {pending.count} / {pending.payload_bytes}"
            )
        self._settle(request_id, Frame.DATA)
        self._state = _State.PAYLOAD
        return Data(request_id, body)

    def _on_control(self, data: bytes) -> Event:
        assert self._header is not None
        frame, count, request_id, _ = self._header
        self._state = _State.HEADER
        if frame is Frame.HELLO:
            self._greeted = True
            return Hello(data, count)
        if frame is Frame.NOTIFY:
            return Notify(request_id, data)
        self._settle(request_id, Frame.ERROR)
        (code,) = _CODE.unpack_from(data)
        try:
            message = data[_CODE.size :].decode()
        except UnicodeDecodeError:
            raise RemoteProtocolError("ERROR message is not UTF-8") from None
        return Error(request_id, None if count == NO_OP else count, code, message)

    def _settle(self, request_id: int, answer: Frame) -> Frame:
        """Take the outstanding request ``answer`` answers; return its kind."""
        with self._lock:
            pending = self._outstanding.pop(request_id, None)
        if pending is None:
            raise RemoteProtocolError(f"{answer.name} for unknown request {request_id}")
        legal = ACKED_BY[pending.kind] is answer or (
            answer is Frame.ERROR and pending.kind is not Frame.PING
        )
        if not legal:
            raise RemoteProtocolError(f"{answer.name} answers a {pending.kind.name}")
        return pending.kind

    # -- sending -----------------------------------------------------------------------

    def hello(self, token: bytes, stream: int) -> bytes:
        """The first frame of an initiator's stream (answered by ACK of request 0)."""
        if len(token) != HELLO_BYTES:
            raise LocalProtocolError(f"a stream greeting is {HELLO_BYTES} bytes")
        self._expect(0, Frame.HELLO, 0, 0)
        return self._frame(Frame.HELLO, stream, 0, len(token)) + token

    def write(self, request_id: int, ops: np.ndarray) -> bytes:
        """Header and descriptors of a WRITE; the payloads follow untouched."""
        payload = self._check_ops(ops)
        self._expect(request_id, Frame.WRITE, len(ops), payload)
        return self._frame(Frame.WRITE, len(ops), request_id, ops.nbytes + payload) + ops.tobytes()

    def read(self, request_id: int, ops: np.ndarray) -> bytes:
        """A whole READ frame; the DATA answer carries the payloads in op order."""
        payload = self._check_ops(ops)
        self._expect(request_id, Frame.READ, len(ops), payload)
        return self._frame(Frame.READ, len(ops), request_id, ops.nbytes) + ops.tobytes()

    def notify(self, request_id: int, message: bytes) -> bytes:
        if len(message) > MAX_CONTROL_BYTES:
            raise LocalProtocolError(f"a notification is at most {MAX_CONTROL_BYTES} bytes")
        self._expect(request_id, Frame.NOTIFY, 0, 0)
        return self._frame(Frame.NOTIFY, 0, request_id, len(message)) + message

    def ack(self, request_id: int) -> bytes:
        return self._frame(Frame.ACK, 0, request_id, 0)

    def welcome(self, keepalive: float) -> bytes:
        """The answer to HELLO: an ACK that asks for a frame at least every ``keepalive``
        seconds (0: no keepalive)."""
        ms = round(keepalive * 1000)
        if ms and not MIN_KEEPALIVE_MS <= ms <= 0xFFFFFFFF:
            raise LocalProtocolError(f"a keepalive is 0 or {MIN_KEEPALIVE_MS} ms to 49 days")
        return self._frame(Frame.ACK, ms, 0, 0)

    def ping(self) -> bytes:
        """A PING, answered by a PONG of its request id (PINGs are answered in order)."""
        with self._lock:
            request_id = self._pings
            self._pings += 1
        frame = self._frame(Frame.PING, 0, request_id, 0)
        self._expect(request_id, Frame.PING, 0, 0)
        return frame

    def pong(self, request_id: int) -> bytes:
        return self._frame(Frame.PONG, 0, request_id, 0)

    def data(self, request_id: int, count: int, payload_bytes: int) -> bytes:
        """Header of a DATA frame; the payloads follow untouched."""
        return self._frame(Frame.DATA, count, request_id, payload_bytes)

    def error(self, request_id: int, code: int, message: str, op_index: int | None = None) -> bytes:
        body = _CODE.pack(code) + message.encode()[: MAX_CONTROL_BYTES - _CODE.size]
        index = NO_OP if op_index is None else op_index
        return self._frame(Frame.ERROR, index, request_id, len(body)) + body

    def forget(self, request_id: int) -> None:
        """Stop expecting an answer to ``request_id`` (it was never sent)."""
        with self._lock:
            self._outstanding.pop(request_id, None)

    def _frame(self, frame: Frame, count: int, request_id: int, body: int) -> bytes:
        if frame not in SENDS[self.role]:
            raise LocalProtocolError(f"a {self.role.value} may not send {frame.name}")
        return HEADER.pack(MAGIC, VERSION, frame, count, request_id, body)

    def _expect(self, request_id: int, kind: Frame, count: int, payload: int) -> None:
        with self._lock:
            if request_id in self._outstanding:
                raise LocalProtocolError(f"request {request_id} is already outstanding")
            self._outstanding[request_id] = _Outstanding(kind, count, payload)

    @staticmethod
    def _check_ops(ops: np.ndarray) -> int:
        if ops.dtype != DESCRIPTOR or ops.ndim != 1:
            raise LocalProtocolError("ops must be a 1-D array of DESCRIPTOR")
        if not 0 < len(ops) <= MAX_OPS_PER_FRAME:
            raise LocalProtocolError(f"a frame carries 1 to {MAX_OPS_PER_FRAME} ops")
        payload = _payload(ops, LocalProtocolError("an op of length 0 or over the frame limit"))
        if payload > MAX_PAYLOAD_BYTES:
            raise LocalProtocolError(f"a frame carries at most {MAX_PAYLOAD_BYTES} bytes")
        return payload


def _payload(ops: np.ndarray, error: Exception) -> int:
    """The payload bytes of a frame's ops; ``error`` if an op is empty or over the limit.
    A few ops are checked as plain integers (numpy calls cost more than the loop)."""
    if len(ops) <= SMALL_OPS:
        lengths = ops["length"].tolist()
        if not all(0 < n <= MAX_PAYLOAD_BYTES for n in lengths):
            raise error
        return sum(lengths)
    if (ops["length"] == 0).any() or (ops["length"] > MAX_PAYLOAD_BYTES).any():
        raise error
    return int(ops["length"].sum(dtype=np.uint64))
