"""The two ends of a data stream: what each side does with the protocol's events.

Transports only provide a :class:`~kvbridge.transfer._pipes.Pipe`; everything here is the
same for TCP, memory and (later) UCX pipes.

Initiator end (:class:`InitiatorStream`): a sender thread sends queued frames (header plus
memoryviews of the source region, untouched), and a PING when the stream has been idle for
the keepalive interval the responder asked for; a receiver thread takes ACK, DATA (read
payloads land with one scatter ``recvmsg_into`` into the destination views), ERROR and PONG.

Responder end (:func:`serve`): one thread reads frames, checks every op against the
region table before moving a byte, receives payloads straight into the target region,
and answers ACK, DATA, ERROR or PONG. A stream silent past the keepalive's limit is closed
by the engine's watchdog (see ``_protocol``, Keepalive).

What a region holds ends only once the pipe has let go of its bytes: a receive into it has
returned or raised (no byte can land any more), a send from it has been flushed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._bounded_log import BoundedLog
from . import _seams
from ._errors import (
    AccessDenied,
    AuthenticationError,
    PeerClosed,
    RemoteProtocolError,
    TransferError,
)
from ._events import Ack, Data, Error, Event, Hello, Notify, Ping, Pong, Read, Write
from ._frame_clock import FrameClock
from ._pipes import Pipe
from ._protocol import KEEPALIVE_MISSES, Connection, ErrorCode, Role
from ._regions import RegionTable, Use
from ._sessions import Caller, SessionTable

_log = logging.getLogger("kvbridge.transfer")

INLINE_SEND_BYTES = 256 << 10
"""Frames up to this size are sent from the submitting thread when the stream is idle: one
thread hand-off less (latency), while 256 KiB still takes only ~0.1 ms on loopback."""


def next_event(conn: Connection, pipe: Pipe) -> Event:
    """Read framing bytes until the connection yields an event."""
    while True:
        event = conn.feed(pipe.recv_exact(conn.wanted()))
        if event is not None:
            return event


@dataclass
class Pending:
    """An outstanding request of an initiator: what to do with its answer."""

    on_done: Callable[[], None]
    on_error: Callable[[TransferError], None]
    views: list[memoryview] = field(default_factory=list)  # where DATA lands (reads)
    describe: Callable[[int | None], int | None] = lambda index: index
    landed: Callable[[int], None] | None = None  # told as DATA fills views (digests)


_Outgoing = tuple[list[bytes | memoryview], Callable[[int], None] | None]
"""A frame to send, and what its pipe calls as it sends it (``Pipe.send``'s ``ready``)."""


@dataclass(frozen=True)
class _Ping:
    """A PING on its way: when it went out, and whether its answer was due at once (nothing
    else was outstanding, so a responder alive answers it within a round trip)."""

    sent: float
    judged: bool

    def overdue(self, keepalive: float) -> bool:
        late = time.monotonic() - self.sent >= KEEPALIVE_MISSES * keepalive
        return self.judged and late


class InitiatorStream:
    """The sending end of one stream to a peer; owns its two threads."""

    def __init__(self, pipe: Pipe, index: int, on_broken: Callable[[str], None]) -> None:
        self.pipe = pipe
        self.index = index
        self.conn = Connection(Role.INITIATOR)
        self._on_broken = on_broken
        self._queue: deque[_Outgoing] = deque()
        self._cond = threading.Condition()
        self._sending = False  # a frame is on its way out (frames never interleave)
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._keepalive = 0.0  # as the responder asked in its greeting
        self._sent = 0  # frames sent so far (one look per keepalive interval)
        self._sent_seen = 0
        self._ping: _Ping | None = None  # the PING not answered yet
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"kvbridge-send-{index}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"kvbridge-recv-{index}", daemon=True),
        ]

    def handshake(self, token: bytes, timeout: float) -> None:
        """Present the session token; raise if the responder refuses it."""
        self.pipe.set_timeout(timeout)
        try:
            self.pipe.send([self.conn.hello(token, self.index)])
            event = next_event(self.conn, self.pipe)
        except (OSError, EOFError) as exc:
            raise PeerClosed(f"stream {self.index}: handshake failed: {exc}") from exc
        if isinstance(event, Error):
            raise AuthenticationError(
                f"stream {self.index} refused: {event.message}", code=event.code
            )
        if not isinstance(event, Ack):
            raise RemoteProtocolError(f"stream {self.index}: unexpected {event!r}")
        self._keepalive = self.conn.keepalive
        self.pipe.set_timeout(None)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(
        self,
        request_id: int,
        frame: list[bytes | memoryview],
        pending: Pending,
        nbytes: int,
        ready: Callable[[int], None] | None = None,
    ) -> None:
        """Send one frame (its header already registered with ``conn``); ``ready``: what
        the pipe calls as it sends (``Pipe.send``: a write's digests).

        A small frame on an idle stream is sent at once from the calling thread, saving a
        thread hand-off (latency); anything else is queued for the stream's sender thread,
        so that the caller can go on queueing while the streams send in parallel.
        """
        with self._lock:
            if self._closed:
                self.conn.forget(request_id)
                raise PeerClosed(f"stream {self.index} is closed")
            self._pending[request_id] = pending
        with self._cond:
            inline = nbytes <= INLINE_SEND_BYTES and not self._queue and not self._sending
            if inline:
                self._sending = True
            else:
                self._queue.append((frame, ready))
                self._cond.notify()
        if inline:
            self._send((frame, ready))

    def close(self, reason: str = "closed") -> None:
        """Stop both threads, join them, and fail what is pending."""
        self.shut(reason)
        self.fail_pending(reason)

    def shut(self, reason: str) -> None:
        """Stop both threads and join them (from a stream's own thread, that one is not
        joined); what is pending stays pending: see :meth:`fail_pending`."""
        with self._lock:
            already = self._closed
            self._closed = True
        with self._cond:
            self._cond.notify_all()
        if not already:
            self.conn.fail(reason)
            self.pipe.close()
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                work = self._cond.wait_for(self._ready, self._keepalive or None)
                if self._closed:
                    return
                frame = self._queue.popleft() if work else self._idle_frame()
                if frame is not None:
                    self._sending = True
            if frame is None:
                ping = self._ping  # the receiver thread clears it when the PONG comes
                if ping is not None and ping.overdue(self._keepalive):
                    self._broken(f"stream {self.index}: the peer answers no keepalive")
                    return
            elif not self._send(frame):
                return

    def _ready(self) -> bool:
        return bool(self._queue and not self._sending) or self._closed

    def _idle_frame(self) -> _Outgoing | None:
        """After a keepalive interval without new work (under ``_cond``): a PING if nothing
        went out since the last look and no PING is unanswered, else nothing."""
        sent, self._sent_seen = self._sent_seen != self._sent, self._sent
        if sent or self._sending or self._ping is not None:
            return None
        with self._lock:
            judged = not self._pending
        self._ping = _Ping(time.monotonic(), judged)
        return [self.conn.ping()], None

    def _send(self, outgoing: _Outgoing) -> bool:
        """Send one frame while holding the ``_sending`` flag; False if the stream broke."""
        try:
            self.pipe.send(*outgoing)
        except Exception as exc:  # a bug in a hook (digests) too: never a silent dead thread
            if not isinstance(exc, (OSError, EOFError)):
                _log.exception("stream %d: the sender failed", self.index)
            self._broken(f"stream {self.index}: send failed: {exc}")
            return False
        finally:
            with self._cond:
                self._sending = False
                self._sent += 1
                if self._queue:
                    self._cond.notify()
        return True

    def _recv_loop(self) -> None:
        receiving: tuple[int, Pending] | None = None  # taken, its payload still coming
        try:
            while True:
                event = next_event(self.conn, self.pipe)
                if isinstance(event, Pong):
                    self._ping = None
                    continue
                pending = self._take(event)
                if isinstance(event, Data):
                    receiving = (event.request_id, pending)
                    landed = _landing(pending)
                    self.pipe.recv_into_views(pending.views, landed)
                    if landed is not None:
                        landed(len(pending.views))
                    receiving = None
                    self.conn.payload_received()
                    pending.on_done()
                elif isinstance(event, Ack):
                    pending.on_done()
                elif isinstance(event, Error):
                    pending.on_error(
                        TransferError(
                            f"refused by the peer: {event.message}",
                            op_index=pending.describe(event.op_index),
                            code=event.code,
                        )
                    )
        except Exception as exc:  # a bug in a hook (digests) too: never a silent dead thread
            if not isinstance(exc, (OSError, EOFError, TransferError)):
                _log.exception("stream %d: the receiver failed", self.index)
            reason = f"stream {self.index}: {exc or type(exc).__name__}"
            if isinstance(exc, RemoteProtocolError):
                reason = f"stream {self.index}: the peer broke the protocol: {exc}"
            if receiving is not None:
                # Pending again, so that it fails with the rest: only once every stream
                # of the peer is closed, never while another still moves its batch's bytes.
                with self._lock:
                    self._pending[receiving[0]] = receiving[1]
            self._broken(reason)

    def _take(self, event: Event) -> Pending:
        request_id = getattr(event, "request_id", None)
        with self._lock:
            pending = self._pending.pop(request_id, None) if request_id is not None else None
        if pending is None:
            raise RemoteProtocolError(f"answer to unknown request {request_id}")
        return pending

    def _broken(self, reason: str) -> None:
        with self._lock:
            if self._closed:
                return
        self._on_broken(reason)

    def fail_pending(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for item in pending.values():
            item.on_error(PeerClosed(reason))


class NotifyRefused(Exception):
    """Raised by a notification handler to fail the writer's batch: ``code`` (from
    ``APP_CODES`` up, the application's own) reaches the writer as ``TransferError.code``."""

    def __init__(self, message: str, code: int = ErrorCode.REFUSED) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ServeHooks:
    """What a served stream needs from its engine."""

    sessions: SessionTable
    on_notify: Callable[[Caller, bytes], None]
    on_bytes: Callable[[int, int], None]
    handshake_timeout: float
    frame_timeout: float
    """A frame's descriptors and payload (and a read's answer) must move within this once
    its header is in: a peer that trickles bytes cannot hold what the frame touches."""
    watch: Callable[[float, Callable[[], bool], Callable[[], None]], None]
    """``watch_until(due, is_done, on_expiry)``: the engine's watchdog (``due`` a ``clock``
    time), which closes a stream whose frame is still unfinished at its deadline (a peer
    that went silent mid-frame)."""
    greeted: Callable[[Pipe], None]
    """The stream proved its session (it no longer counts as a stranger's connection)."""
    refusals: BoundedLog
    """Counts refused streams and logs them at a bounded rate (anyone may knock)."""
    keepalive: float = 0.0
    """The keepalive interval asked of the initiator in the greeting (s; 0: none): the stream
    is closed once it sent nothing for ``KEEPALIVE_MISSES`` intervals."""
    clock: Callable[[], float] = time.monotonic
    """The engine's clock, which frame deadlines and the keepalive's silence are read on."""


@dataclass(frozen=True)
class _Served:
    """One served stream, once its peer is known."""

    conn: Connection
    pipe: Pipe
    regions: RegionTable
    caller: Caller
    hooks: ServeHooks


def serve(pipe: Pipe, regions: RegionTable, hooks: ServeHooks) -> None:
    """Serve one stream as the responder until it closes or breaks the protocol."""
    conn = Connection(Role.RESPONDER)
    caller: Caller | None = None
    try:
        caller = _greet(conn, pipe, hooks)
        if caller is None:
            return
        hooks.greeted(pipe)
        served = _Served(conn, pipe, regions, caller, hooks)
        silence = hooks.keepalive * KEEPALIVE_MISSES or None
        frame = FrameClock(pipe, hooks.watch, silence, hooks.clock)
        try:
            _serve_frames(served, frame)
        finally:
            frame.stop()
    except (OSError, EOFError, RemoteProtocolError):
        return  # the initiator went away, stalled or misbehaved: only this stream ends
    finally:
        pipe.close()
        if caller is not None:
            hooks.sessions.stream_closed(caller)


def _serve_frames(served: _Served, frame: FrameClock) -> None:
    conn, pipe = served.conn, served.pipe
    while True:
        frame.end()  # between frames the peer may be silent up to the keepalive's limit
        event = _next_frame(conn, pipe, served.hooks.frame_timeout, frame)
        if isinstance(event, Write):
            _receive_write(served, event)
        elif isinstance(event, Read):
            _send_read(served, event)
        elif isinstance(event, Notify):
            _notify(served, event)
        elif isinstance(event, Ping):
            pipe.send([conn.pong(event.request_id)])


def _greet(conn: Connection, pipe: Pipe, hooks: ServeHooks) -> Caller | None:
    """Take the HELLO, all of it within the handshake timeout; ``None`` if refused."""
    pipe.set_timeout(hooks.handshake_timeout)
    pipe.set_deadline(time.monotonic() + hooks.handshake_timeout)
    hello = next_event(conn, pipe)
    assert isinstance(hello, Hello)  # the protocol allows nothing else first
    try:
        caller = hooks.sessions.admit_stream(hello.token, hello.stream)
    except AuthenticationError as exc:
        hooks.refusals.refused("stream", logging.WARNING, "stream refused: %s", exc)
        pipe.send([conn.error(0, ErrorCode.AUTHENTICATION, str(exc))])
        return None
    try:
        pipe.send([conn.welcome(hooks.keepalive)])
        pipe.set_timeout(None)
    except BaseException:
        hooks.sessions.stream_closed(caller)
        raise
    return caller


def _next_frame(conn: Connection, pipe: Pipe, timeout: float, frame: FrameClock) -> Event:
    """Wait for a header as long as it takes; the rest of the frame has ``timeout``."""
    event = conn.feed(pipe.recv_exact(conn.wanted()))
    if event is not None:
        return event
    frame.start(timeout)
    return next_event(conn, pipe)


def _notify(served: _Served, event: Notify) -> None:
    conn, pipe = served.conn, served.pipe
    try:
        served.hooks.on_notify(served.caller, event.message)
    except NotifyRefused as exc:  # the receiver's handler said no: tell the writer
        pipe.send([conn.error(event.request_id, exc.code, str(exc))])
    except Exception as exc:
        _log.exception("notification handler failed")
        pipe.send([conn.error(event.request_id, ErrorCode.INTERNAL, f"internal error: {exc}")])
    else:
        pipe.send([conn.ack(event.request_id)])


def _landing(pending: Pending) -> Callable[[int], None] | None:
    """What to tell as a read's views fill: a test's fault first (``testing.py``: the bytes
    as a faulty NIC lands them), then the batch's digests."""
    seam, landed = _seams.received, pending.landed
    if seam is None:
        return landed
    views, done = pending.views, 0

    def arrived(count: int) -> None:
        nonlocal done
        if count > done:
            seam(views[done:count])
            done = count
        if landed is not None:
            landed(count)

    return arrived


def _receive_write(served: _Served, event: Write) -> None:
    resolved = _resolve(served, event, "w")
    if resolved is None:
        return
    views, use = resolved
    try:
        served.pipe.recv_into_views(views)
        if _seams.received is not None:  # a test's fault (testing.py)
            _seams.received(views)
    finally:
        served.regions.finish(use)  # the guard's holds end only once no byte can still land
    served.conn.payload_received()
    served.hooks.on_bytes(event.payload_bytes, 0)
    served.pipe.send([served.conn.ack(event.request_id)])


def _send_read(served: _Served, event: Read) -> None:
    resolved = _resolve(served, event, "r")
    if resolved is None:
        return
    views, use = resolved
    total = sum(v.nbytes for v in views)
    try:
        served.pipe.send([served.conn.data(event.request_id, len(event.ops), total), *views])
        served.pipe.flush()  # the transport no longer reads the views
    finally:
        served.regions.finish(use)
    served.hooks.on_bytes(0, total)


def _resolve(served: _Served, event: Write | Read, access: str) -> tuple[list[Any], Use] | None:
    """The views a remote op addresses, with what it holds; ``None`` once a refusal was
    sent (a refused write's payload is read and dropped first: the stream stays in step)."""
    conn, pipe = served.conn, served.pipe
    try:
        return served.regions.resolve(
            event.ops,
            access,
            served.caller,
            device_ok=pipe.device_memory,
            merge=pipe.byte_stream,
        )
    except AccessDenied as exc:
        if isinstance(event, Write):
            pipe.discard(event.ops["length"].tolist())
            conn.payload_received()
        pipe.send([conn.error(event.request_id, ErrorCode.ACCESS_DENIED, str(exc), exc.op_index)])
        return None
