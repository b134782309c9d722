"""Who may hold a connection to a ZMQ ROUTER socket, and how many may.

libzmq accepts every TCP connection to a bound socket and keeps it until the peer leaves:
it caps nothing, and it offers no call to close one peer's connection. Anyone who can reach
a control or events port could therefore hold every descriptor of the process (about
1,100 silent connections took a server started under the usual limit of 1,024, and a real
client then timed out). :class:`ConnectionGate` keeps two tables of the socket's
connections, by descriptor:

- **strangers**: accepted, not (yet) trusted. At most ``strangers`` of them; past that
  the oldest that never sent a message is closed, or, when every one spoke, the one
  heard from the longest ago (an honest peer speaks within a round trip of connecting, so
  connections that sit silent go first, whatever their number);
- **trusted**: connections on which the socket's owner saw proof of a secret (a completed
  handshake, a signed request, a valid ticket: :meth:`trust`). At most ``trusted``; past
  that the quietest trusted connection is closed (a live ZMQ peer reconnects).

What it learns comes from the socket's monitor (``ACCEPTED``, ``DISCONNECTED``, ``CLOSED``,
each with the descriptor) and from each message's source descriptor (``zmq.SRCFD``). A
connection is closed by ``shutdown(2)`` on its descriptor: libzmq then sees the end of the
stream, closes the descriptor itself and says so on the monitor. Make the gate before the
socket binds: it sets the listen backlog (:data:`BACKLOG`). Only a descriptor the
monitor reported as accepted, and whose two addresses are still the ones it had then, is
ever shut down: a descriptor number libzmq closed and the process reused (for a data
stream, a file) is never touched. The gate belongs to the thread that owns the socket: it
is not thread-safe, and :attr:`monitor` goes into that thread's poller.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._bounded_log import BoundedLog

BACKLOG = 1024
"""Connections the kernel queues for libzmq to accept (its default is 100): a burst of
strangers must not leave a real peer's connect to wait out a SYN retransmit (1 s)."""

GRACE_S = 0.25
"""A connection this young that has not spoken yet may be on its way (its first message is
a round trip behind its accept): it is closed for being silent only past the hard cap."""
HARD_FACTOR = 4
"""Strangers at most, counting the young silent ones: this many times the cap."""

_WATCHED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED

_Ends = tuple[Any, Any]
"""A connection's local and peer address, as they were when it was accepted."""


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
    ) -> None:
        if strangers < 1 or trusted < 1:
            raise ValueError("a gate admits at least one connection of each kind")
        self._max_strangers = strangers
        self._max_trusted = trusted
        self._name = name
        self._refusals = refusals
        self._silent: OrderedDict[int, tuple[_Ends, float]] = OrderedDict()
        """Descriptor -> addresses and time accepted of strangers that sent nothing yet,
        oldest first."""
        self._spoken: OrderedDict[int, _Ends] = OrderedDict()
        """Strangers that sent a message, heard from the longest ago first."""
        self._trusted: OrderedDict[int, _Ends] = OrderedDict()
        self._early: dict[int, bool] = {}
        """Descriptors heard from (True: trusted) before the monitor's ACCEPTED was read."""
        self._socket = sock
        self.monitor = _monitor(sock)
        sock.setsockopt(zmq.BACKLOG, BACKLOG)  # for the binds that follow: make it first

    def counts(self) -> tuple[int, int]:
        """Connections held now: (strangers, trusted)."""
        return len(self._silent) + len(self._spoken), len(self._trusted)

    def events(self) -> None:
        """Apply what the monitor reported, then close the connections past the caps. Call
        it when :attr:`monitor` is readable and at least once a second (a young silent
        connection spared for its grace is closed once it is old); read the socket's
        messages first, so that a peer that spoke is not taken for a silent one."""
        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            for table in (self._silent, self._spoken, self._trusted):
                table.pop(fd, None)  # gone, or a number libzmq closed and reused
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
        self._early.clear()
        self._enforce()

    def heard(self, message: zmq.Frame) -> int:
        """A message came: its connection is the one heard from last. Returns the
        connection's descriptor (-1 when unknown)."""
        fd = _source(message)
        silent = self._silent.pop(fd, None)
        if silent is not None:
            self._spoken[fd] = silent[0]
        elif fd in self._spoken:
            self._spoken.move_to_end(fd)
        elif fd in self._trusted:
            self._trusted.move_to_end(fd)
        else:
            self._early.setdefault(fd, False)
        return fd

    def trust(self, fd: int) -> None:
        """The connection of descriptor ``fd`` proved a secret: it leaves the strangers."""
        silent = self._silent.pop(fd, None)
        ends = self._spoken.pop(fd, None) or (None if silent is None else silent[0])
        if ends is not None:
            self._trusted[fd] = ends
            self._enforce()
        elif fd in self._trusted:
            self._trusted.move_to_end(fd)
        else:
            self._early[fd] = True

    def disconnect(self, fd: int) -> None:
        """Close the connection of descriptor ``fd`` (a peer its owner gave up on: an
        events subscriber that stopped reading), if the gate holds it."""
        silent = self._silent.pop(fd, None)
        ends = self._trusted.pop(fd, None) or self._spoken.pop(fd, None)
        ends = ends or (None if silent is None else silent[0])
        if ends is not None and _ends(fd) == ends:
            _shutdown(fd)

    def close(self) -> None:
        """Stop monitoring (the owner closes the socket itself)."""
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self.monitor.close(linger=0)

    def _accepted(self, fd: int) -> None:
        ends = _ends(fd)
        if ends is None:
            return  # gone already: its DISCONNECTED follows
        early = self._early.get(fd)
        if early is None:
            self._silent[fd] = (ends, time.monotonic())
        else:
            (self._trusted if early else self._spoken)[fd] = ends

    def _enforce(self) -> None:
        """Close the connections past the caps (see :meth:`_quietest_stranger`), and the
        trusted ones heard from the longest ago past their own cap."""
        while (held := len(self._silent) + len(self._spoken)) > self._max_strangers:
            quietest = self._quietest_stranger(held)
            if quietest is None:
                break  # only young silent ones, within the hard cap: they may speak yet
            self._close(*quietest, "strangers", self._max_strangers)
        while len(self._trusted) > self._max_trusted:
            self._close(*self._trusted.popitem(last=False), "trusted", self._max_trusted)

    def _quietest_stranger(self, held: int) -> tuple[int, _Ends] | None:
        """The stranger to close first: the oldest silent one, unless it is younger than
        :data:`GRACE_S` (then only past :data:`HARD_FACTOR` times the cap); else, only
        while more than the cap spoke, the one heard from the longest ago (a peer that
        spoke is never closed to make room for silent ones)."""
        if self._silent:
            fd, (ends, accepted) = next(iter(self._silent.items()))
            young = accepted > time.monotonic() - GRACE_S
            if not young or held > self._max_strangers * HARD_FACTOR:
                del self._silent[fd]
                return fd, ends
        if len(self._spoken) > self._max_strangers:
            return self._spoken.popitem(last=False)
        return None

    def _close(self, fd: int, ends: _Ends, kind: str, cap: int) -> None:
        if _ends(fd) == ends:  # still the connection the monitor reported
            _shutdown(fd)
        self._refusals.refused(
            f"{self._name}_{kind}",
            logging.WARNING,
            "%s: more than %d %s connections: the quietest closed",
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
