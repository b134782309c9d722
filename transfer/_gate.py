"""Who may hold a connection to a ZMQ ROUTER socket, and how many may.

libzmq accepts every TCP connection to a bound socket and keeps it until the peer leaves:
it caps nothing, and it offers no call to close one peer's connection. Anyone who can reach
a control or events port could therefore hold every descriptor of the process (about
1,100 silent connections took a server started under the usual limit of 1,024, and a real
client then timed out). :class:`ConnectionGate` keeps two tables of the socket's
connections, by descriptor:

- **strangers**: accepted, not (yet) trusted, in the order they came. Past ``strangers``
  of them the oldest that never sent a message is closed, once it is older than
  :data:`GRACE_S` (an honest peer speaks within a round trip of connecting); past
  :data:`HARD_FACTOR` times that, the oldest stranger, however young and whether it spoke
  or not. Strangers that talk (a ``hello`` needs no secret) are closed only then:
  closing a talker makes it reconnect and talk again, which costs more than holding it;
- **trusted**: connections on which the socket's owner saw proof of a secret (a completed
  handshake, a signed request, a valid ticket: :meth:`trust`), each with its owner (a
  principal, a tenant). At most ``trusted``; past that the quietest connection of the owner
  that holds the most is closed (a live ZMQ peer reconnects): one tenant's connections
  never push out another's while it holds more.

What it learns comes from the socket's monitor (``ACCEPTED``, ``DISCONNECTED``, ``CLOSED``,
each with the descriptor), read before each message is credited (so a descriptor number
libzmq closed and gave a new connection is never taken for the old one), and from each
message's source descriptor (``zmq.SRCFD``). A connection is closed by ``shutdown(2)`` on
its descriptor: libzmq then sees the end of the stream, closes the descriptor itself and
says so on the monitor. Only a descriptor the monitor reported as accepted, and whose two
addresses are still the ones it had then, is ever shut down, and a :class:`Connection` its
owner kept names both: a number reused (for a data stream, a file, another peer) is never
touched. Make the gate before the socket binds: it sets the listen backlog
(:data:`BACKLOG`) and the messages a connection may queue (:data:`RCVHWM`). The gate
belongs to the thread that owns the socket: it is not thread-safe, and :attr:`monitor`
goes into that thread's poller.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._bounded_log import BoundedLog

BACKLOG = 1024
"""Connections the kernel queues for libzmq to accept (its default is 100): a burst of
strangers must not leave a real peer's connect to wait out a SYN retransmit (1 s)."""
RCVHWM = 64
"""Messages queued per connection before libzmq stops reading it (its default is 1,000):
a peer that sends faster than the socket's thread reads (or one closed with messages still
queued) holds at most this many (a client sends a request and waits for its answer)."""

GRACE_S = 0.25
"""A stranger this young may be an honest peer on its way through its handshake: it is
closed for the cap only past the hard cap."""
HARD_FACTOR = 4
"""Strangers at most, counting the young ones: this many times the cap."""

_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED

_Ends = tuple[Any, Any]
"""A connection's local and peer address, as they were when it was accepted."""


@dataclass(frozen=True)
class Connection:
    """One connection as the gate knew it: its descriptor and its two addresses (what its
    owner keeps to name it later, :meth:`ConnectionGate.disconnect`)."""

    fd: int
    ends: _Ends


@dataclass
class _Stranger:
    ends: _Ends
    accepted: float
    said: int = 0
    """Messages heard from it."""

    @property
    def spoke(self) -> bool:
        return self.said > 0


@dataclass(frozen=True)
class _Trusted:
    ends: _Ends
    owner: str


class ConnectionGate:
    """Caps the connections of one ROUTER socket (see the module's docstring)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        strangers: int,
        trusted: int,
        name: str,
        refusals: BoundedLog,
        on_gone: Callable[[int], None] | None = None,
    ) -> None:
        """``on_gone(fd)``: a connection the monitor reported closed (its descriptor)."""
        if strangers < 1 or trusted < 1:
            raise ValueError("a gate admits at least one connection of each kind")
        self._max_strangers = strangers
        self._max_trusted = trusted
        self._name = name
        self._refusals = refusals
        self._strangers: OrderedDict[int, _Stranger] = OrderedDict()
        """By descriptor, in the order they were accepted."""
        self._trusted: OrderedDict[int, _Trusted] = OrderedDict()
        """By descriptor, heard from the longest ago first."""
        self._early: dict[int, bool] = {}
        """Descriptors heard from (True: trusted) before the monitor's ACCEPTED was read."""
        self._socket = sock
        self._on_gone = on_gone
        self.monitor = _monitor(sock)
        sock.setsockopt(zmq.BACKLOG, BACKLOG)  # for the binds that follow: make it first
        sock.setsockopt(zmq.RCVHWM, RCVHWM)

    def counts(self) -> tuple[int, int]:
        """Connections held now: (strangers, trusted)."""
        return len(self._strangers), len(self._trusted)

    def events(self) -> None:
        """Apply what the monitor reported, then close the connections past the caps. Call
        it when :attr:`monitor` is readable and at least once a second (a young stranger
        spared for its grace is closed once it is old); read the socket's messages first,
        so that a peer that spoke is not taken for a silent one."""
        self._apply()
        self._early.clear()
        self._enforce()

    def heard(self, message: zmq.Frame) -> int:
        """A message came: credit its connection (after the monitor's news, so that a
        descriptor is the connection it names now). Returns the descriptor (-1: unknown)."""
        self._apply()
        fd = _source(message)
        stranger = self._strangers.get(fd)
        if stranger is not None:
            stranger.said += 1
        elif fd in self._trusted:
            self._trusted.move_to_end(fd)
        else:
            self._early.setdefault(fd, False)
        return fd

    def trust(self, fd: int, owner: str = "") -> Connection | None:
        """The connection of descriptor ``fd`` proved ``owner``'s secret: it leaves the
        strangers. Returns it (``None``: the gate does not hold it)."""
        stranger = self._strangers.pop(fd, None)
        held = self._trusted.pop(fd, None)
        ends = stranger.ends if stranger is not None else held.ends if held else None
        if ends is None:
            self._early[fd] = True
            return None
        self._trusted[fd] = _Trusted(ends, owner)
        self._enforce()
        return Connection(fd, ends)

    def held(self, fd: int) -> Connection | None:
        """The live connection on descriptor ``fd`` now (its addresses), ``None`` if none
        is: a connection its peer closed (libzmq reports it before it closes the
        descriptor) is not live."""
        ends = _ends(fd)
        return None if ends is None or not _established(fd) else Connection(fd, ends)

    def disconnect(self, connection: Connection) -> None:
        """Close ``connection`` (a peer its owner gave up on: an events subscriber that
        stopped reading), if it is still the one the gate holds under its descriptor."""
        self._apply()
        fd = connection.fd
        held = self._trusted.get(fd) or self._strangers.get(fd)
        if held is not None and held.ends == connection.ends:
            self._trusted.pop(fd, None)
            self._strangers.pop(fd, None)
            if _ends(fd) == connection.ends:
                _shutdown(fd)

    def close(self) -> None:
        """Stop monitoring (the owner closes the socket itself)."""
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self.monitor.close(linger=0)

    def _apply(self) -> None:
        """What the monitor reported so far, in its order."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            self._strangers.pop(fd, None)  # gone, or a number libzmq closed and reused
            self._trusted.pop(fd, None)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            elif self._on_gone is not None:
                self._on_gone(fd)

    def _accepted(self, fd: int) -> None:
        ends = _ends(fd)
        if ends is None:
            return  # gone already: its DISCONNECTED follows
        early = self._early.pop(fd, None)
        if early:
            self._trusted[fd] = _Trusted(ends, "")
        else:
            self._strangers[fd] = _Stranger(ends, time.monotonic(), said=int(early is False))

    def _enforce(self) -> None:
        """Close the connections past the caps (see the module's docstring)."""
        while len(self._strangers) > self._max_strangers:
            fd = self._stranger_to_close()
            if fd is None:
                break  # only young ones, within the hard cap: they may be on their way
            self._close(fd, self._strangers.pop(fd).ends, "strangers", self._max_strangers)
        while len(self._trusted) > self._max_trusted:
            most = Counter(held.owner for held in self._trusted.values()).most_common(1)[0][0]
            fd = next(fd for fd, held in self._trusted.items() if held.owner == most)
            self._close(fd, self._trusted.pop(fd).ends, "trusted", self._max_trusted)

    def _stranger_to_close(self) -> int | None:
        """The oldest silent stranger past its grace; past the hard cap, the oldest
        stranger, however young and whether it spoke or not (an honest peer is the newest
        one). Strangers that spoke are closed only then: closing one that talks makes it
        reconnect and talk again."""
        old = time.monotonic() - GRACE_S
        for fd, stranger in self._strangers.items():
            if stranger.accepted > old:
                break  # in the order they came: every later one is younger
            if not stranger.spoke:
                return fd
        if len(self._strangers) > self._max_strangers * HARD_FACTOR:
            return next(iter(self._strangers))
        return None

    def _close(self, fd: int, ends: _Ends, kind: str, cap: int) -> None:
        if _ends(fd) == ends:  # still the connection the monitor reported
            _shutdown(fd)
        self._refusals.refused(
            f"{self._name}_{kind}",
            logging.WARNING,
            "%s: more than %d %s connections: one closed",
            self._name,
            cap,
            "unproven" if kind == "strangers" else "trusted",
        )


def _monitor(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """``sock``'s monitor, read through a PAIR whose queue is unbounded: under a flood of
    connections, an ACCEPTED dropped at a full queue would be a stranger never capped."""
    address = f"inproc://kvbridge-gate-{secrets.token_hex(8)}"
    sock.monitor(address, _WATCHED)
    monitor: zmq.Socket[Any] = sock.context.socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.connect(address)
    return monitor


def _source(message: zmq.Frame) -> int:
    try:
        return int(message.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _ends(fd: int) -> _Ends | None:
    """The local and peer address of descriptor ``fd``'s socket, or ``None`` (not a
    connected socket any more). The descriptor is borrowed, never closed."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()


_TCP_ESTABLISHED = 1
"""``tcpi_state`` of a connection both ends still hold (Linux ``TCP_ESTABLISHED``)."""


def _established(fd: int) -> bool:
    """Whether descriptor ``fd``'s TCP connection is established (not closed by its peer);
    true where the platform does not say (no ``TCP_INFO``, or it fails)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None:
        return True
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket any more
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, option, 1)[0] == _TCP_ESTABLISHED
    except OSError:
        return True
    finally:
        sock.detach()


def _shutdown(fd: int) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.detach()
