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

What a subscriber may cost is bounded in bytes (``_event_bounds``): a message holds at most
:data:`~._event_bounds.MESSAGE_BATCH_BYTES`, a subscriber's queue at most ``hwm`` of them
(``SNDHWM``, from ``events_queue_bytes``) and its kernel buffer is fixed (``SNDBUF``). The
socket is ``ROUTER_MANDATORY``: a send to a full queue raises ``zmq.Again`` and the
subscriber is **dropped** (it hears nothing more, its connection is closed, and
``on_drop`` names it), and a send to a peer gone raises ``EHOSTUNREACH``. Connections are
capped as on every ZMQ port (``kvbridge.transfer.ConnectionGate``): at most
``MAX_STRANGERS`` that brought no valid ticket yet. Who holds how
many tickets and subscribers is the ledger's (``_event_ledger``): a subscriber counts
against its session and tenant until its connection is gone, which the publisher learns by
sending ``LAPSED`` every second to each one that hears nothing (subscribe again: a dropped
subscriber that reads again learns it so, or at its next renewal).

A subscriber that misses a sequence number reads a snapshot of the namespace's keys (the
``keys`` op) and applies the messages numbered after it. Changes are reported by the store
after each operation (``TieredStore.watch``) and handed to the publisher's thread, which
alone touches the socket, and sends each stream's waiting changes in as few messages as
fit; when more wait than it may hold, the excess is dropped and the stream's sequence
number skips one, so that every subscriber resynchronises.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq

from ..._bounded_log import BoundedLog
from ..._closing import Closing
from ...transfer import MAX_STRANGERS, Connection, ConnectionGate, trusted_connections
from .._stream import LAPSED, RENEW, SUBSCRIBER_ID_BYTES, TICKET_PREFIX, Noted, encode, pack
from ._event_bounds import (
    KERNEL_SNDBUF,
    KEYS_PER_MESSAGE,
    MESSAGE_BATCH_BYTES,
    SESSION_SUBSCRIBERS,
    SESSION_TICKETS,
    EventBounds,
)
from ._event_ledger import EventLedger, Holder, Quota

_log = logging.getLogger("kvbridge.server")

TICKET_TTL_S = 30.0
HEARTBEAT_S = 1.0
MAX_WAITING_KEYS = 1 << 18
"""Changes waiting for the publisher's thread at most (about 150 bytes each, a 32-byte key
with its tuple and list slot: 38 MiB); past it a stream skips a number."""
SUBSCRIPTION_TTL_S = 5.0
"""A subscription its subscriber has not renewed for this long ends (a renewal a second)."""


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

    def report(self, changes: list[Noted]) -> None:
        """The store's watcher (called under the store's lock: only queues)."""
        self._publisher.queue(self, changes)

    def ticket(self, holder: Holder, tenant: Quota) -> bytes:
        """A one-time subscription to this stream for ``holder`` (a session that opened
        it), within its session's and its tenant's caps (``TooManyRequests`` past one)."""
        return self._publisher.ticket(self, holder, tenant)

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
        bounds: EventBounds | None = None,
        on_drop: Callable[[bytes], None] | None = None,
    ) -> None:
        """``bounds``: what subscribers may hold (``_event_bounds``). ``on_drop``: called
        on the publisher's thread (the one that uses the socket) with the routing id of
        each subscriber dropped for a full queue, which otherwise keeps what its pipe holds
        until the peer leaves: the place to close that connection."""
        self.bounds = bounds or EventBounds()
        self._clock = clock
        self._on_drop = on_drop
        self.dropped = 0
        """Subscribers dropped for a full queue since the start."""
        self._drops = BoundedLog(_log)  # anyone with a ticket can be dropped, and again
        context: zmq.Context[Any] = zmq.Context.instance()
        self._socket: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, self.bounds.hwm)
        self._socket.setsockopt(zmq.SNDBUF, KERNEL_SNDBUF)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or gone peer raises
        self._socket.setsockopt(zmq.MAXMSGSIZE, 256)  # a ticket or a renewal, nothing more
        try:
            self._gate = ConnectionGate(
                self._socket,
                strangers=MAX_STRANGERS,
                trusted=trusted_connections(),
                name="events",
                refusals=self._drops,
            )
        except BaseException:
            self._socket.close()
            raise
        try:
            self.port = _bind(self._socket, host, port)
        except BaseException:
            self._gate.close()
            self._socket.close()
            raise
        self._connections: dict[bytes, Connection] = {}
        """Each subscriber's connection as the gate knew it, while it counts."""
        self._waiting: collections.deque[tuple[EventStream, list[Noted] | None]] = (
            collections.deque()
        )
        self._waiting_keys = 0
        self._lock = threading.Lock()  # the waiting count, the streams
        self._streams: list[EventStream] = []
        self._ledger: EventLedger[EventStream] = EventLedger(
            self.bounds.subscribers,
            Quota(SESSION_TICKETS, SESSION_SUBSCRIBERS),
            ticket_ttl=TICKET_TTL_S,
            ttl=SUBSCRIPTION_TTL_S,
        )
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

    def ticket(self, stream: EventStream, holder: Holder, tenant: Quota) -> bytes:
        """A ticket to ``stream`` (``_event_ledger``: refused past a cap, never given by
        pushing out another's)."""
        return self._ledger.issue(stream, holder, tenant, self._clock())

    def queue(self, stream: EventStream, changes: list[Noted] | None) -> None:
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
        self._gate.close()
        self._socket.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._gate.monitor, zmq.POLLIN)
        beat = self._clock() + HEARTBEAT_S
        while not self._stopped:
            timeout = max(0.0, beat - self._clock())
            ready = dict(poller.poll(int(timeout * 1000) + 1))
            try:
                if self._socket in ready:
                    self._subscriptions()
                self._gate.events()  # after the messages (who spoke is known); at least 1/s
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
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            fd = self._gate.heard(frames[-1])
            if len(frames) != 2 or len(frames[0]) != SUBSCRIBER_ID_BYTES:
                continue  # not [its 16-byte id, one frame]: an id ROUTER gave is guessable
            peer, body = frames[0].bytes, frames[1].bytes
            now = self._clock()
            if body == RENEW:
                if not self._ledger.renew(peer, now):
                    self._lapsed(peer)  # say so, or the subscriber waits out its silence
            elif body.startswith(TICKET_PREFIX):
                self._subscribe(peer, body[len(TICKET_PREFIX) :], now, fd)

    def _subscribe(self, peer: bytes, ticket: bytes, now: float, fd: int) -> None:
        stream = self._ledger.redeem(ticket, peer, now)
        if stream is None:
            return
        holder = self._ledger.holder(peer)
        owner = "" if holder is None else holder.tenant
        connection = self._gate.trust(fd, owner)  # a valid ticket: a stranger no more
        if connection is not None:
            self._connections[peer] = connection
        else:
            self._connections.pop(peer, None)
        if stream.closed:  # its namespace left meanwhile: it is told at the next heartbeat
            self._ledger.stop(peer)
            return
        self._send(stream, pack([], time.time()), to=[peer])  # where the stream is, at once

    def _send_waiting(self) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, collections.deque()
            self._waiting_keys = 0
        for stream, changes in _by_stream(waiting):
            if stream.closed:
                continue
            if changes is None:
                self._end(stream)
                continue
            for batch in batches(changes):
                self._send(stream, batch, advance=True)

    def _end(self, stream: EventStream) -> None:
        """The stream's last word, to its subscribers; then they hear nothing more."""
        stream.closed = True
        self._send(stream, pack([{"type": "AllBlocksCleared"}], time.time()), advance=True)
        with self._lock:
            self._streams.remove(stream)
        self._ledger.end(stream)

    def _heartbeats(self) -> None:
        with self._lock:
            streams = list(self._streams)
        for peer in self._ledger.sweep(self._clock()):
            self._lapsed(peer)  # gone, or told to subscribe again (once it reads)
        heartbeat = pack([], time.time())
        for stream in streams:
            self._send(stream, heartbeat)  # a number skipped shows here too

    def _send(
        self,
        stream: EventStream,
        batch: bytes,
        *,
        advance: bool = False,
        to: list[bytes] | None = None,
    ) -> None:
        """Number (``advance``) and send a message of ``stream`` to its subscribers (or
        ``to`` those). The batch is one buffer, which every subscriber's queue shares."""
        if advance or stream.skip:
            stream.seq += self._skipped(stream) + (1 if advance else 0)
        peers = to if to is not None else self._ledger.listening(stream)
        if not peers:
            return
        shared = zmq.Frame(batch, copy=True)  # one buffer for every queue (libzmq counts them)
        frames: list[bytes | zmq.Frame] = [stream.topic, stream.seq.to_bytes(8, "big"), shared]
        for peer in peers:
            try:
                self._socket.send_multipart([peer, *frames], zmq.NOBLOCK, copy=False)
            except zmq.Again:  # its queue holds its bound: it hears nothing more
                self._drop(peer)
            except zmq.ZMQError as exc:
                self._unroutable(peer, exc)

    def _drop(self, peer: bytes) -> None:
        """``peer``'s queue holds its bound: it hears nothing more, and its connection is
        closed (the queue goes with it; it counts until the next ``LAPSED`` finds it gone)."""
        self._ledger.stop(peer)
        self.dropped += 1
        message = "event subscriber %s dropped: its queue holds its %d messages"
        self._drops.refused("dropped", logging.INFO, message, peer.hex(), self.bounds.hwm)
        connection = self._connections.get(peer)
        if connection is not None:  # only that very connection, whatever its number is now
            self._gate.disconnect(connection)
        if self._on_drop is None:
            return
        try:
            self._on_drop(peer)
        except Exception:  # the hook's failure costs this peer's connection, not the streams
            _log.exception("on_drop failed for event subscriber %s", peer.hex())

    def _lapsed(self, peer: bytes) -> None:
        """Tell ``peer`` it hears nothing (subscribe again); learn whether it is gone."""
        try:
            self._socket.send_multipart([peer, LAPSED], zmq.NOBLOCK)
        except zmq.Again:
            pass  # its queue is still full: it counts on
        except zmq.ZMQError as exc:
            self._unroutable(peer, exc)

    def _unroutable(self, peer: bytes, exc: zmq.ZMQError) -> None:
        if exc.errno != zmq.EHOSTUNREACH:
            raise exc
        self._ledger.gone(peer)  # its connection is gone, and with it what it held
        self._connections.pop(peer, None)

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


def batches(changes: list[Noted]) -> Iterator[bytes]:
    """``changes`` as message batches in order, each of at most ``MESSAGE_BATCH_BYTES``:
    :data:`KEYS_PER_MESSAGE` keys at a time, a batch too large cut in two."""
    parts = [changes[i : i + KEYS_PER_MESSAGE] for i in range(0, len(changes), KEYS_PER_MESSAGE)]
    parts.reverse()  # a stack: the first part on top
    while parts:
        part = parts.pop()
        batch = pack(encode(part), time.time())
        if len(batch) <= MESSAGE_BATCH_BYTES or len(part) == 1:  # one key: about 140 bytes
            yield batch
        else:
            half = len(part) // 2
            parts += [part[half:], part[:half]]


def _by_stream(
    waiting: Iterable[tuple[EventStream, list[Noted] | None]],
) -> list[tuple[EventStream, list[Noted] | None]]:
    """What waits, each stream's changes joined in their order (fewer, fuller messages),
    a stream's end after them."""
    joined: dict[EventStream, list[Noted]] = {}
    ends: list[EventStream] = []
    for stream, changes in waiting:
        if changes is None:
            ends.append(stream)
        elif stream not in ends:  # nothing follows a stream's end
            joined.setdefault(stream, []).extend(changes)
    out: list[tuple[EventStream, list[Noted] | None]] = list(joined.items())
    return out + [(stream, None) for stream in ends]


def _bind(socket: zmq.Socket[bytes], host: str, port: int) -> int:
    bracketed = f"[{host}]" if ":" in host else host
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
    if port:
        socket.bind(f"tcp://{bracketed}:{port}")
        return port
    return int(socket.bind_to_random_port(f"tcp://{bracketed}"))
