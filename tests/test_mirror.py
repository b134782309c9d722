"""KeyMirror against a publisher the test controls: numbers skipped (a publisher that
dropped messages), malformed and oversized messages, floods, silence. Whatever arrives,
the mirror ends in step with the snapshot's truth, or out of step (``leading`` is
``None``: the caller asks the server): never a key set the stream did not say."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from helpers import key, until

from kvbridge.store import (
    EVENT_TICKET_PREFIX,
    BlockKey,
    KeyMirror,
    KeySnapshot,
    Noted,
    Subscription,
)
from kvbridge.store import encode_events as encode
from kvbridge.store import pack_events as pack

TOPIC = b"t" * 16


class _Publisher:
    """A stream's server side: a ROUTER that sends to whoever brought a ticket, the
    namespace's true keys, the numbers."""

    def __init__(self) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.port: int = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.peers: set[bytes] = set()
        self.keys: set[bytes] = set()
        self.seq = 0
        self.lock = threading.Lock()
        self.snapshots = 0
        self.subscriptions = 0

    # the mirror's Source
    def subscription(self) -> Subscription:
        self.subscriptions += 1
        return Subscription(f"tcp://127.0.0.1:{self.port}", TOPIC, b"ticket")

    def snapshot(self) -> KeySnapshot:
        with self.lock:
            self.snapshots += 1
            return KeySnapshot(self.seq, [key for key in self.keys])  # type: ignore[misc]

    def close(self) -> None:
        pass

    # what the test does
    def change(self, stored: list[bytes], removed: list[bytes], *, send: bool = True) -> None:
        """Change the truth; publish it under the next number unless ``send`` is False
        (a message the publisher dropped)."""
        with self.lock:
            self.keys |= set(stored)
            self.keys -= set(removed)
            self.seq += 1
            changes: list[Noted] = [(BlockKey(k), "host", None) for k in stored]
            changes += [(BlockKey(k), None, None) for k in removed]
            if send:
                self.raw([TOPIC, self.seq.to_bytes(8, "big"), pack(encode(changes), 0.0)])

    def beat(self) -> None:
        self.raw([TOPIC, self.seq.to_bytes(8, "big"), pack([], 0.0)])

    def raw(self, frames: list[bytes]) -> None:
        while self.socket.poll(0):  # tickets (any, here) and renewals
            peer, body = self.socket.recv_multipart()
            if body.startswith(EVENT_TICKET_PREFIX):
                self.peers.add(peer)
        for peer in self.peers:
            self.socket.send_multipart([peer, *frames])


@pytest.fixture
def publisher() -> Iterator[_Publisher]:
    pub = _Publisher()
    yield pub
    pub.socket.close()


def _mirror(publisher: _Publisher, resync_every: float = 0.05) -> KeyMirror:
    mirror = KeyMirror(lambda: publisher, silence=2.0, resync_every=resync_every)
    until(lambda: _started(publisher, mirror), "the mirror subscribed and read a snapshot")
    return mirror


def _started(publisher: _Publisher, mirror: KeyMirror) -> bool:
    publisher.beat()  # sent only to those whose ticket arrived
    return mirror.ready


def _in_step(publisher: _Publisher, mirror: KeyMirror) -> bool:
    publisher.beat()
    return mirror.keys() == publisher.keys


def test_changes_in_order_are_applied(publisher: _Publisher) -> None:
    with _mirror(publisher) as mirror:
        publisher.change([key(i) for i in range(10)], [])
        publisher.change([key(10)], [key(0), key(1)])
        until(lambda: mirror.keys() == publisher.keys, "the mirror applied both")
        assert mirror.leading([key(2), key(3), key(0)]) == 2
        assert publisher.snapshots == 1


def test_a_dropped_message_is_noticed_and_resynced(publisher: _Publisher) -> None:
    with _mirror(publisher) as mirror:
        publisher.change([key(1)], [])
        publisher.change([key(2)], [], send=False)  # dropped: the mirror cannot know key 2
        publisher.change([key(3)], [])  # numbered one past what it expects
        until(lambda: _in_step(publisher, mirror), "the mirror resynced")
        assert publisher.snapshots >= 2 and key(2) in (mirror.keys() or set())


def test_a_dropped_last_message_is_noticed_by_the_heartbeat(publisher: _Publisher) -> None:
    with _mirror(publisher) as mirror:
        publisher.change([key(1)], [], send=False)
        until(lambda: _in_step(publisher, mirror), "the heartbeat showed the gap")


@pytest.mark.parametrize(
    "frames",
    [
        [TOPIC, b"\x00" * 8, b"\xc1"],  # not msgpack
        [TOPIC, b"\x00" * 8],  # two frames
        [TOPIC, b"\x00" * 3, pack([], 0.0)],  # a short number
        [TOPIC, (1 << 40).to_bytes(8, "big"), msgpack.packb({"a": 1})],  # not a batch
        [TOPIC, (1 << 40).to_bytes(8, "big"), msgpack.packb([0, [{"type": "Evil"}], None])],
        [
            TOPIC,
            (1 << 40).to_bytes(8, "big"),
            msgpack.packb([0, [{"type": "BlockStored", "block_hashes": [b"short"]}], None]),
        ],
        [
            TOPIC,
            (1 << 40).to_bytes(8, "big"),
            msgpack.packb([0, [{"type": "BlockStored", "block_hashes": [1, 2]}], None]),
        ],
        [TOPIC, (1 << 40).to_bytes(8, "big"), b"\xdd\xff\xff\xff\xff"],  # an array of 4G items
        [TOPIC, b"\x00" * 8, b"x" * (2 << 20)],  # past the size bound: the connection drops
    ],
    ids=[
        "garbage",
        "two-frames",
        "short-seq",
        "map",
        "unknown-type",
        "short-key",
        "int-keys",
        "huge-array",
        "oversized",
    ],
)
def test_malformed_messages_cost_a_resync_never_a_wrong_key(
    publisher: _Publisher, frames: list[bytes]
) -> None:
    with _mirror(publisher) as mirror:
        publisher.change([key(1)], [])
        publisher.raw(frames)
        publisher.change([key(2)], [key(1)])
        until(lambda: _in_step(publisher, mirror), "in step after the bad message")
        publisher.change([key(3)], [])
        until(lambda: _in_step(publisher, mirror), "and still following the stream")


@pytest.mark.slow
def test_a_flood_of_bad_messages_costs_at_most_a_snapshot_a_second(
    publisher: _Publisher,
) -> None:
    with _mirror(publisher, resync_every=1.0) as mirror:
        for _ in range(20_000):
            publisher.raw([TOPIC, (1 << 40).to_bytes(8, "big"), b"\xc1"])
        publisher.change([key(7)], [])
        until(lambda: _in_step(publisher, mirror), "in step after the flood")
        assert publisher.snapshots <= 2 + 20  # bounded by time (1 s apart), not by messages


@pytest.mark.slow
def test_silence_subscribes_again(publisher: _Publisher) -> None:
    mirror = KeyMirror(lambda: publisher, silence=0.5)
    try:
        until(lambda: _started(publisher, mirror), "subscribed")
        until(lambda: publisher.subscriptions >= 2, "a silent stream was left and joined again")
    finally:
        mirror.close()
