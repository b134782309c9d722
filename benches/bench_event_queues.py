"""What unread event subscribers cost a real ``kvbridge serve --events-port`` (issue 32;
``docs/EVENTS.md``, "Bounds"), against the bound the docs give them, in the same run.

64 subscribers renew every second and never read (each holds one message and the smallest
receive buffer on its side, so what it is sent waits on the server), while one namespace
of 4,096 blocks of 4 KiB is filled and cleared round after round (about 160 KiB of
messages per round for each subscriber). The figure is the server's resident memory
(``VmRSS``) at its peak over the rounds, less what it held before the subscribers came:

- at once: the 64 subscribe together (their queues share every message's buffer);
- staggered: one more subscribes each round, so each queue stops on other messages (the
  case the bound is written for: queues that hold different messages);
- baseline: the same rounds with no subscriber (what the churn itself costs the heap).

The bound is 64 x ``EventBounds().subscriber_bytes`` (2,073 KiB each).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from conftest import _EXTRA_LINES

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from attack import unread_subscriber
from helpers import keys, payloads, until
from serve import ServeProcess

from kvbridge.store import StoreClient

BB = 4096
SLOTS = 4096
SUBSCRIBERS = 64
PER_SESSION = 8
"""Tickets each of the attacker's sessions takes (a session's cap)."""
ROUNDS = 80
DOCUMENTED_SUBSCRIBER_BYTES = 2_122_752
"""``EventBounds().subscriber_bytes``: 49 messages of 41 KiB and a 64 KiB connection."""
_BLOCKS = payloads(keys(0, SLOTS), BB)


class _Attacker:
    """Sessions that take tickets and subscribers that never read, renewed every second."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._sessions: list[StoreClient] = []
        self.sockets: list[zmq.Socket[bytes]] = []
        self._renewed = 0.0

    def subscribe(self, n: int) -> None:
        for _ in range(n):
            if len(self.sockets) % PER_SESSION == 0:
                self._sessions.append(_client(self._address))
            self.sockets.append(unread_subscriber(self._sessions[-1].subscription()))
        until(lambda: all(s.poll(0) for s in self.sockets[-n:]), "subscribed")

    def renew(self) -> None:
        if time.monotonic() - self._renewed < 1.0:
            return
        self._renewed = time.monotonic()
        for socket in self.sockets:
            with contextlib.suppress(zmq.Again):
                socket.send(b"kvbridge-renew", zmq.NOBLOCK)

    def close(self) -> None:
        for socket in self.sockets:
            socket.close()
        for session in self._sessions:
            session.close()


def _client(address: str) -> StoreClient:
    return StoreClient(address, block_bytes=BB, namespace="churn", timeout=30)


def _peak_growth(arrive: Callable[[int, _Attacker], None]) -> int:
    """A fresh server, warmed up; ``arrive(round, attacker)`` before each round of the
    churn; the peak of its resident memory over the rounds, less its start."""
    server = ServeProcess(
        *("--events-port", "0", "--host-capacity", str(SLOTS * BB), "--max-namespaces", "1"),
        *("--handoff-ttl", "0"),
    )
    attacker = _Attacker(server.address)
    try:
        with _client(server.address) as writer:
            for r in range(3):
                _fill_and_clear(writer, r)
            start = peak = server.rss()
            for r in range(ROUNDS):
                arrive(r, attacker)
                attacker.renew()
                _fill_and_clear(writer, 10 + r)
                peak = max(peak, server.rss())
        return peak - start
    finally:
        attacker.close()
        server.kill()


def _fill_and_clear(client: StoreClient, round_: int) -> None:
    client.put(keys(round_ * SLOTS, (round_ + 1) * SLOTS), _BLOCKS)
    client.clear()


def _at_once(r: int, attacker: _Attacker) -> None:
    if r == 0:
        attacker.subscribe(SUBSCRIBERS)


def _staggered(r: int, attacker: _Attacker) -> None:
    if r < SUBSCRIBERS:
        attacker.subscribe(1)


def _nobody(r: int, attacker: _Attacker) -> None:
    pass


def test_unread_subscribers_against_the_documented_bound() -> None:
    bound = SUBSCRIBERS * DOCUMENTED_SUBSCRIBER_BYTES
    baseline = _peak_growth(_nobody)
    rows = [
        f"event queues: {SUBSCRIBERS} unread subscribers, {ROUNDS} rounds of fill + clear "
        f"(4,096 keys); server RSS growth at its peak, bound {bound / 2**20:.1f} MiB",
        f"  baseline, no subscriber: {baseline / 2**20:6.1f} MiB",
    ]
    for name, arrive in (("at once", _at_once), ("staggered, one a round", _staggered)):
        grown = _peak_growth(arrive)
        rows.append(
            f"  {name:<24} {grown / 2**20:6.1f} MiB  ({grown / bound:.2f} of the bound; "
            f"{(grown - baseline) / SUBSCRIBERS / 1024:.0f} KiB a subscriber over the baseline)"
        )
    for row in rows:
        _EXTRA_LINES.append(row)
        print(row)
