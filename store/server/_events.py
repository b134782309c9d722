"""The namespaces' event streams: what enters and leaves each namespace, for the engines'
mirrors and for KV-aware routers (``docs/EVENTS.md``).

One ZMQ ROUTER socket (``kvbridge serve --events-port``) carries every stream, to each
subscriber on its own: a message is three frames, as vLLM's KV event publisher sends
them: the stream's topic (16 random bytes, new for each namespace the server opens), the
sequence number (8 bytes, big-endian; per stream, from 1) and a msgpack ``KVEventBatch``
(``[ts, [event, ...], None]``, each event a map tagged ``"type"``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). A heartbeat (no events, the last sequence number
again) goes out every second: a subscriber that missed the last messages sees the gap
without waiting for the next change.

Who may listen: a subscriber (a DEALER whose routing id is 16 random bytes it chose)
sends a **ticket** the control plane gave a session that opened the namespace (the
``events`` op, signed like every request): good once, for 30 s, it subscribes that
connection to that namespace's stream, and the subscriber renews it every second (a
subscription not renewed for :data:`SUBSCRIPTION_TTL_S` ends; a renewal that comes after
that is answered ``LAPSED``, and the subscriber subscribes again). Nothing else a peer
sends does anything. A publisher that chose whom to send each message to (rather than a PUB
socket that filters by prefix) is what keeps a subscription to every topic, or a forged
one, from hearing anything: an XPUB in manual mode was tried first, and a peer sending
messages that are not subscriptions made libzmq apply a victim's subscription to it.

A subscriber that misses a sequence number (the socket drops what a slow subscriber
cannot take: ``SNDHWM``) reads a snapshot of the namespace's keys (the ``keys`` op) and
applies the messages numbered after it. Changes are reported by the store after each
operation (``TieredStore.watch``) and handed to the publisher's thread, which alone touches
the socket; when more wait than it may hold, the excess is dropped and the stream's
sequence number skips one, so that every subscriber resynchronises.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..._closing import Closing
from .._stream import (
    LAPSED,
    MAX_KEYS_PER_MESSAGE,
    RENEW,
    SUBSCRIBER_ID_BYTES,
    TICKET_PREFIX,
    encode,
    pack,
)
from ..local._changes import Change

_log = logging.getLogger("kvbridge.server")

TICKET_TTL_S = 30.0
HEARTBEAT_S = 1.0
MAX_WAITING_KEYS = 1 << 20
"""Changes waiting for the publisher's thread at most; past it a stream skips a number."""
MAX_TICKETS = 4096
MAX_SUBSCRIBERS = 4096
SUBSCRIPTION_TTL_S = 5.0
"""A subscription its subscriber has not renewed for this long ends (a renewal a second)."""
SNDHWM = 1000
"""Messages queued per subscriber before the socket drops (the subscriber resyncs)."""


class EventStream:
    """One namespace's stream: its topic and the last sequence number sent."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.topic = secrets.token_bytes(16)
        self.seq = 0
        """The last sequence number assigned (read by the ``keys`` op: a snapshot holds
        every change numbered up to it)."""
        self.skip = False
        """Changes were dropped: the next message skips a number."""
        self.closed = False
        self._publisher = publisher

    def report(self, changes: list[Change]) -> None:
        """The store's watcher (called under the store's lock: only queues)."""
        self._publisher.queue(self, changes)

    def ticket(self) -> bytes:
        """A one-time subscription to this stream (for a session that opened it)."""
        return self._publisher.ticket(self)

    def close(self) -> None:
        """The namespace left the server: subscribers hear ``AllBlocksCleared``."""
        self._publisher.queue(self, None)


class EventPublisher(Closing):
    """The ROUTER socket and the thread that alone uses it (see the module's docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        hwm: int = SNDHWM,
    ) -> None:
        """``hwm``: messages queued per subscriber (beyond its connection's buffers) before
        the socket drops the subscriber's messages."""
        self._clock = clock
        context: zmq.Context[Any] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 256)  # a ticket or a renewal, nothing more
        try:
            self.port = _bind(self._socket, host, port)
        except BaseException:
            self._socket.close()
            raise
        self._waiting: collections.deque[tuple[EventStream, list[Change] | None]] = (
            collections.deque()
        )
        self._waiting_keys = 0
        self._lock = threading.Lock()  # the waiting count, the tickets, the streams
        self._tickets: dict[bytes, tuple[EventStream, float]] = {}
        self._streams: list[EventStream] = []
        self._subscribers: dict[bytes, tuple[EventStream, float]] = {}
        """Each subscriber's routing id: its stream and when its subscription ends (only
        the publisher's thread touches it)."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kvbridge-events", daemon=True)
        self._thread.start()

    def stream(self) -> EventStream:
        stream = EventStream(self)
        with self._lock:
            self._streams.append(stream)
        return stream

    def ticket(self, stream: EventStream) -> bytes:
        ticket = secrets.token_bytes(16)
        now = self._clock()
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                self._expire(now)
            if len(self._tickets) >= MAX_TICKETS:  # all fresh: the oldest goes
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket] = (stream, now + TICKET_TTL_S)
        return ticket

    def queue(self, stream: EventStream, changes: list[Change] | None) -> None:
        with self._lock:
            if changes is not None and self._waiting_keys + len(changes) > MAX_WAITING_KEYS:
                stream.skip = True  # subscribers resync: nothing is lost to them
                return
            self._waiting_keys += 0 if changes is None else len(changes)
            self._waiting.append((stream, changes))
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread is awake
            os.write(self._wake_w, b"!")

    def close(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"!")
        self._thread.join()
        self._socket.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        beat = self._clock() + HEARTBEAT_S
        while not self._stopped:
            timeout = max(0.0, beat - self._clock())
            ready = dict(poller.poll(int(timeout * 1000) + 1))
            try:
                if self._socket in ready:
                    self._subscriptions()
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                self._send_waiting()
                if self._clock() >= beat:
                    self._heartbeats()
                    beat = self._clock() + HEARTBEAT_S
            except Exception:  # a bug must not end the stream of every namespace
                _log.exception("event publisher failed")
                self._skip_all()  # what it was sending may be lost: every subscriber resyncs
        try:
            self._send_waiting()  # the last words of the streams that closed with the server
        except Exception:
            _log.exception("event publisher failed as it stopped")

    def _subscriptions(self) -> None:
        """Subscribe a peer that brings a valid ticket, renew one that says so; ignore
        anything else (see the module's docstring)."""
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2 or len(frames[0]) != SUBSCRIBER_ID_BYTES:
                continue  # not [its 16-byte id, one frame]: an id ROUTER gave is guessable
            peer, body = frames
            now = self._clock()
            if body == RENEW:
                held = self._subscribers.get(peer)
                if held is not None:
                    self._subscribers[peer] = (held[0], now + SUBSCRIPTION_TTL_S)
                else:  # it lapsed: say so, or the subscriber waits out its silence bound
                    with contextlib.suppress(zmq.Again):
                        self._socket.send_multipart([peer, LAPSED], zmq.NOBLOCK)
            elif body.startswith(TICKET_PREFIX):
                self._subscribe(peer, body[len(TICKET_PREFIX) :], now)

    def _subscribe(self, peer: bytes, ticket: bytes, now: float) -> None:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is None or entry[1] < now or entry[0].closed:
            return
        if peer not in self._subscribers and len(self._subscribers) >= MAX_SUBSCRIBERS:
            del self._subscribers[next(iter(self._subscribers))]  # the oldest goes
        stream = entry[0]
        self._subscribers[peer] = (stream, now + SUBSCRIPTION_TTL_S)
        self._send(stream, [], to=[peer])  # it hears where the stream is at once

    def _send_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, collections.deque()
            self._waiting_keys = 0
        for stream, changes in waiting:
            if stream.closed:
                continue
            if changes is None:
                stream.closed = True
                self._send(stream, [{"type": "AllBlocksCleared"}], advance=True)
                with self._lock:
                    self._streams.remove(stream)
                for peer in self._listening(stream):
                    del self._subscribers[peer]
                continue
            for start in range(0, len(changes), MAX_KEYS_PER_MESSAGE):
                part = changes[start : start + MAX_KEYS_PER_MESSAGE]
                self._send(stream, encode(part), advance=True)

    def _heartbeats(self) -> None:
        now = self._clock()
        with self._lock:
            streams = list(self._streams)
            self._expire(now)
        for peer in [p for p, (_, until) in self._subscribers.items() if until < now]:
            del self._subscribers[peer]
        for stream in streams:
            self._send(stream, [])  # a number skipped shows here too

    def _send(
        self,
        stream: EventStream,
        events: list[dict[str, object]],
        *,
        advance: bool = False,
        to: list[bytes] | None = None,
    ) -> None:
        """Number (``advance``) and send a message of ``stream`` to its subscribers (or
        ``to`` those)."""
        if advance or stream.skip:
            stream.seq += self._skipped(stream) + (1 if advance else 0)
        peers = to if to is not None else self._listening(stream)
        if not peers:
            return
        frames = [stream.topic, stream.seq.to_bytes(8, "big"), pack(events, time.time())]
        for peer in peers:
            # ROUTER drops what a peer's queue cannot take, or a peer gone: it resyncs
            with contextlib.suppress(zmq.Again):
                self._socket.send_multipart([peer, *frames], zmq.NOBLOCK)

    def _listening(self, stream: EventStream) -> list[bytes]:
        return [peer for peer, (heard, _) in self._subscribers.items() if heard is stream]

    def _skip_all(self) -> None:
        with self._lock:
            for stream in self._streams:
                stream.skip = True

    def _skipped(self, stream: EventStream) -> int:
        """1 when changes of ``stream`` were dropped since its last message (the next
        number is skipped: subscribers see the gap and resync), else 0."""
        with self._lock:  # queue() sets it under the same lock: no drop goes unseen
            skipped, stream.skip = stream.skip, False
        return int(skipped)

    def _expire(self, now: float) -> None:
        for ticket in [t for t, (_, until) in self._tickets.items() if until < now]:
            del self._tickets[ticket]


def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> int:
    bracketed = f"[{host}]" if ":" in host else host
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    if port:
        socket.bind(f"tcp://{bracketed}:{port}")
        return port
    return int(socket.bind_to_random_port(f"tcp://{bracketed}"))
