"""``ConnectionGate`` on a real ROUTER socket, driven the way its owner drives it (messages
first, then the monitor's events): silent strangers are closed first, a peer that spoke is
never closed to make room for silent ones, a young silent connection has its grace, the
hard cap holds even then, trusted connections leave the strangers' cap, and a descriptor
the gate does not hold is never touched."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from helpers import until
from strangers import GREETING

from kvbridge._bounded_log import BoundedLog
from kvbridge.transfer import Connection, ConnectionGate
from kvbridge.transfer._gate import HARD_FACTOR

CAP = 8


class _Owner:
    """A ROUTER socket and its gate, pumped by hand as the control thread pumps them."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        log = BoundedLog(logging.getLogger("test.gate"))
        self.gate = ConnectionGate(self.socket, strangers=CAP, trusted=2, name="t", refusals=log)
        self.port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.heard: dict[bytes, int] = {}

    def pump(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.heard[frames[-1].bytes] = self.gate.heard(frames[-1])
        self.gate.events()

    def close(self) -> None:
        self.gate.close()
        self.socket.close()


@pytest.fixture
def owner() -> Iterator[_Owner]:
    context: zmq.Context[Any] = zmq.Context()
    made = _Owner(context)
    yield made
    made.close()
    context.term()


def _silent(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(GREETING)
        socks.append(sock)
    return socks


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        while data := sock.recv(4096):
            del data  # the server's greeting
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _dealer(context: zmq.Context[Any], port: int, say: bytes) -> zmq.Socket[Any]:
    dealer: zmq.Socket[Any] = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RECONNECT_IVL, -1)  # a closed connection stays closed
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(say)
    return dealer


def _pumped(owner: _Owner, check: Any) -> bool:
    owner.pump()
    return bool(check())


def test_old_silent_strangers_go_first_and_a_newcomer_that_speaks_stays(owner: _Owner) -> None:
    silent = _silent(owner.port, 3 * CAP)
    until(lambda: _pumped(owner, lambda: owner.gate.counts()[0] >= 2 * CAP), "accepted")
    context: zmq.Context[Any] = zmq.Context.instance()
    dealer = _dealer(context, owner.port, b"hello")  # the newest: an honest peer on its way
    until(
        lambda: _pumped(owner, lambda: sum(map(_closed, silent)) >= 2 * CAP + 1),
        "the silent ones past the cap closed once their grace ended",
    )
    assert owner.gate.counts()[0] <= CAP
    closed = [_closed(s) for s in silent]
    assert closed == [True] * (2 * CAP + 1) + [False] * (CAP - 1)  # the oldest silent ones
    dealer.send(b"still here")
    until(lambda: _pumped(owner, lambda: b"still here" in owner.heard), "the peer still heard")
    for sock in silent:
        sock.close()
    dealer.close()


def test_a_talker_is_held_and_silent_strangers_go_before_it(owner: _Owner) -> None:
    """Talking needs no secret (a ``hello``), and a talker closed reconnects and talks
    again: within the hard cap a stranger that spoke is held, and the silent ones past
    their grace go first, oldest first."""
    context: zmq.Context[Any] = zmq.Context.instance()
    talker = _dealer(context, owner.port, b"hello")
    until(lambda: _pumped(owner, lambda: b"hello" in owner.heard), "the talker spoke")
    silent = _silent(owner.port, CAP + 1)  # two too many with the talker
    until(lambda: _pumped(owner, lambda: sum(map(_closed, silent)) >= 2), "two closed")
    assert [_closed(s) for s in silent] == [True, True] + [False] * (CAP - 1)
    talker.send(b"talking")
    until(lambda: _pumped(owner, lambda: b"talking" in owner.heard), "the talker held")
    for sock in silent:
        sock.close()
    talker.close()


def test_the_hard_cap_holds_during_the_grace(owner: _Owner) -> None:
    silent = _silent(owner.port, 2 * HARD_FACTOR * CAP)
    until(
        lambda: _pumped(owner, lambda: sum(map(_closed, silent)) >= HARD_FACTOR * CAP),
        "the oldest past the hard cap closed at once",
    )
    assert owner.gate.counts()[0] <= HARD_FACTOR * CAP
    for sock in silent:
        sock.close()


def test_trusted_connections_leave_the_strangers_cap(owner: _Owner) -> None:
    context: zmq.Context[Any] = zmq.Context.instance()
    dealer = _dealer(context, owner.port, b"proof")
    until(lambda: _pumped(owner, lambda: b"proof" in owner.heard), "the peer spoke")
    owner.gate.trust(owner.heard[b"proof"])
    assert owner.gate.counts() == (0, 1)
    silent = _silent(owner.port, 3 * CAP)
    until(
        lambda: _pumped(owner, lambda: sum(map(_closed, silent)) >= 2 * CAP),
        "strangers capped",
    )
    assert owner.gate.counts() == (CAP, 1)
    dealer.send(b"again")
    until(lambda: _pumped(owner, lambda: b"again" in owner.heard), "the trusted peer heard")
    for sock in silent:
        sock.close()
    dealer.close()


def test_a_descriptor_the_gate_does_not_hold_is_never_touched(owner: _Owner) -> None:
    left, right = socket.socketpair()
    owner.gate.disconnect(Connection(left.fileno(), (left.getsockname(), left.getpeername())))
    left.sendall(b"x")
    assert right.recv(1) == b"x"
    left.close()
    right.close()


def test_past_the_trusted_cap_the_owner_holding_the_most_loses_one(owner: _Owner) -> None:
    """The trusted cap (2 here) never pushes out one owner's connection while another
    owner holds more: a tenant with many connections loses its own quietest."""
    context: zmq.Context[Any] = zmq.Context.instance()
    beta = _dealer(context, owner.port, b"beta")
    until(lambda: _pumped(owner, lambda: b"beta" in owner.heard), "beta spoke")
    owner.gate.trust(owner.heard[b"beta"], "beta")
    alphas = [_alpha(owner, context, f"alpha-{i}".encode()) for i in range(3)]
    assert owner.gate.counts() == (0, 2)
    beta.send(b"beta again")
    until(lambda: _pumped(owner, lambda: b"beta again" in owner.heard), "beta still heard")
    for dealer in (beta, *alphas):
        dealer.close()


def _alpha(owner: _Owner, context: zmq.Context[Any], said: bytes) -> zmq.Socket[Any]:
    """A connection of owner ``alpha`` that spoke and proved itself."""
    dealer = _dealer(context, owner.port, said)
    until(lambda: _pumped(owner, lambda: said in owner.heard), "alpha spoke")
    owner.gate.trust(owner.heard[said], "alpha")
    return dealer
