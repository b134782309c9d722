"""One subscription to a namespace's event stream (``docs/EVENTS.md``): the socket, the
ticket it brings, the renewals it owes, and a monitor that says when its connection
drops. :class:`~kvbridge.store.KeyMirror` and ``kvbridge events`` read a stream through it.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq

from ..._closing import Closing
from .._stream import (
    LAPSED,
    MAX_MESSAGE_BYTES,
    RENEW,
    RENEW_S,
    SUBSCRIBER_ID_BYTES,
    Message,
    Subscription,
    decode,
)

RCVHWM = 256
"""Messages the socket holds for its reader (at most 256 KiB each: 64 MiB)."""


class SubscriptionLost(ConnectionError):
    """The connection to the stream dropped (the server stopped, or dropped it), or the
    server let the subscription lapse: subscribe again."""


class EventSubscriber(Closing):
    """A DEALER with a routing id of 16 random bytes (the server serves no other: an id it
    would assign is guessable), which sends its ticket, renews it every second, and reads
    one stream's messages. :meth:`receive` raises :class:`SubscriptionLost` when the
    connection drops and :class:`~kvbridge.store.MalformedEvent` for what is not a message
    of the stream."""

    def __init__(self, sub: Subscription, clock: Callable[[], float] = time.monotonic) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        self._topic = sub.topic
        self._clock = clock
        self._socket: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVHWM, RCVHWM)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + 1024)
        self._socket.setsockopt(zmq.ROUTING_ID, _routing_id())
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._socket.connect(sub.endpoint)
        self._socket.send(sub.request, zmq.NOBLOCK)  # queued until the connection is up
        self._renewed = self._clock()

    def receive(self, seconds: float) -> Message | None:
        """The next message within ``seconds`` (``None``: none came)."""
        self._renew()
        ready = dict(self._poller.poll(int(max(0.0, seconds) * 1000) + 1))
        if self._monitor in ready:
            raise SubscriptionLost("the server closed the stream")
        if self._socket not in ready:
            return None
        frames = self._socket.recv_multipart(zmq.NOBLOCK)
        if frames == [LAPSED]:
            raise SubscriptionLost("the server let the subscription lapse (not renewed in time)")
        return decode(frames, self._topic)

    def pending(self) -> bool:
        return bool(self._socket.poll(0))

    def drain(self) -> None:
        """Drop every message waiting."""
        while self._socket.poll(0):
            self._socket.recv_multipart(zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()

    def _renew(self) -> None:
        now = self._clock()
        if now - self._renewed >= RENEW_S:
            self._renewed = now
            with contextlib.suppress(zmq.Again):  # down or full: the monitor will say
                self._socket.send(RENEW, zmq.NOBLOCK)


def _routing_id() -> bytes:
    """16 random bytes, not starting with a zero byte (libzmq keeps those for its own)."""
    while True:
        chosen = secrets.token_bytes(SUBSCRIBER_ID_BYTES)
        if chosen[0]:
            return chosen
