"""The transfer engine under floods and starvation: what a data listener must survive.

Threads that cannot start, connections by the thousand, peers that trickle a byte at a time
(before and after their greeting): each costs the engine one refused stream at most, and
the next honest peer is served as if nothing happened. And a batch is reported done only
once its buffers are free again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from attack import descriptors

from kvbridge.transfer import TransferEngine
from kvbridge.transfer import _served as served_module
from kvbridge.transfer._protocol import Connection, Role

KiB = 1 << 10


@pytest.fixture
def pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    with (
        TransferEngine("a", connect_timeout=1.0, timeout=2.0) as a,
        TransferEngine("b", connect_timeout=1.0, timeout=2.0) as b,
    ):
        yield a, b


def _write_once(a: TransferEngine, b: TransferEngine) -> None:
    src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
    here, there = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    peer.write([(here, 0, there.id, 0, 4096)]).wait(5)
    assert (dst == src).all()
    peer.close()
    a.unregister(here)
    b.unregister(there)


def _data_address(engine: TransferEngine) -> tuple[str, int]:
    address = engine._transports["tcp"].address()
    return str(address["host"]), int(address["port"])


def _closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> bool:
    """Whether the other end closes ``sock`` within ``seconds`` (while we drip bytes)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if drip:
                sock.send(drip)
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_thread_that_cannot_start_costs_one_stream_not_the_listener(
    pair: tuple[TransferEngine, TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    real_start = threading.Thread.start
    failures = [3]

    def start(self: threading.Thread) -> None:
        if self.name.startswith("kvbridge-serve") and failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(Exception):  # noqa: B017 - whichever way the peer finds out
        _write_once(a, b)
    monkeypatch.setattr(threading.Thread, "start", real_start)
    time.sleep(0.1)
    _write_once(a, b)  # the listener is still accepting
    assert failures[0] < 3


def test_a_connection_flood_is_capped_and_leaves_room_afterwards(
    pair: tuple[TransferEngine, TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = pair
    monkeypatch.setattr(served_module, "MAX_SERVED_STREAMS", 8)
    flood = [socket.create_connection(_data_address(b)) for _ in range(40)]
    time.sleep(0.3)
    served = len(b._served)
    assert served <= 8
    closed = sum(_closed_within(s, 0.1) for s in flood)
    assert closed >= 40 - 8  # the ones past the cap were closed at once
    for s in flood:
        s.close()
    deadline = time.monotonic() + 5
    while b._served and time.monotonic() < deadline:  # the rest time out (no greeting)
        time.sleep(0.05)
    _write_once(a, b)


def test_a_slow_loris_before_its_greeting_is_dropped(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    """One byte every 0.2 s never completes a greeting: the whole greeting has the
    handshake timeout (1 s here), not each byte of it."""
    _, b = pair
    sock = socket.create_connection(_data_address(b))
    header = Connection(Role.INITIATOR).hello(bytes(64), 0)
    start = time.monotonic()
    for byte in header[:20]:
        try:
            sock.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.2)
    assert _closed_within(sock, 3.0)
    assert time.monotonic() - start < 4.5
    sock.close()


@pytest.mark.parametrize("drip", [b"\x01", b""], ids=["trickle", "silence"])
def test_a_slow_loris_inside_a_frame_is_dropped_and_frees_what_it_held(
    pair: tuple[TransferEngine, TransferEngine], drip: bytes
) -> None:
    """A session that starts a write and trickles its payload, or goes silent, loses the
    stream once the frame's deadline (the transfer timeout, 2 s here) passes, however
    steadily it trickles; the region it addressed is released then."""
    a, b = pair
    target = np.zeros(64 * KiB, np.uint8)
    there = b.register(target)
    peer = a.connect(b.metadata())  # a real session
    credentials = peer._credentials
    assert credentials is not None
    sock = socket.create_connection(_data_address(b))
    conn = Connection(Role.INITIATOR)
    sock.sendall(conn.hello(credentials.hello(5), 5))
    sock.recv(64)  # ACK
    sock.sendall(conn.write(99, descriptors(there.id, there.key, [(0, 64 * KiB)])))
    start = time.monotonic()
    assert _closed_within(sock, 6.0, drip=drip)
    assert 1.5 < time.monotonic() - start < 5.0
    sock.close()
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            b.unregister(there)  # nothing holds it any more
            break
        except Exception:
            time.sleep(0.05)
    else:
        pytest.fail("the trickled write still holds the region")
    peer.close()


def test_done_means_the_buffers_are_free(pair: tuple[TransferEngine, TransferEngine]) -> None:
    """Eight threads each register, write, wait and unregister at once, many times: a batch
    reports done only after it released its regions, so unregister never finds one busy."""
    a, b = pair
    dst = b.register(np.zeros(8 * 4 * KiB, np.uint8))
    peer = a.connect(b.metadata())
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for _ in range(150):
                region = a.register(np.full(4 * KiB, index, np.uint8))
                peer.write([(region, 0, dst.id, index * 4 * KiB, 4 * KiB)]).wait(10)
                a.unregister(region)  # RegionBusy here was the bug
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    peer.close()


def test_silent_connections_cannot_keep_a_peer_out(
    pair: tuple[TransferEngine, TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone without the secret opens connections and never greets. They used to hold
    served-stream slots for the whole greeting timeout, so honest peers could not connect;
    now a newcomer pushes out the oldest silent one."""
    a, b = pair
    monkeypatch.setattr(served_module, "MAX_SERVED_STREAMS", 32)
    monkeypatch.setattr(served_module, "MAX_UNGREETED_STREAMS", 8)
    flood = [socket.create_connection(_data_address(b)) for _ in range(64)]
    try:
        for _ in range(5):
            _write_once(a, b)  # every attempt gets in
            flood += [socket.create_connection(_data_address(b)) for _ in range(16)]
    finally:
        for s in flood:
            s.close()


def test_frame_deadlines_leave_one_watchdog_entry_per_stream(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    """A busy stream re-arms one watchdog entry instead of adding one per frame (which
    piled up for a whole transfer timeout: tens of thousands on a busy server)."""
    a, b = pair
    src, dst = a.register(np.ones(4 * KiB, np.uint8)), b.register(np.zeros(4 * KiB, np.uint8))
    peer = a.connect(b.metadata())
    for _ in range(300):
        peer.write([(src, 0, dst.id, 0, 4 * KiB)]).wait(10)
    assert len(b._watchdog._heap) <= 2 * a.settings.streams
    peer.close()


def test_a_stream_pushed_out_before_its_greeting_is_opened_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server closes the first two streams it accepts before reading their greeting
    (as a burst of silent connections pushing them out would): the dial opens them again
    with fresh greetings and the write goes through."""
    accept = served_module.ServedStreams.accept
    dropped: list[Any] = []

    def drop_first_two(self: served_module.ServedStreams, pipe: Any) -> None:
        if len(dropped) < 2:
            dropped.append(pipe)
            pipe.close()
            return
        accept(self, pipe)

    monkeypatch.setattr(served_module.ServedStreams, "accept", drop_first_two)
    with (
        TransferEngine("a", connect_timeout=1.0, timeout=2.0) as a,
        TransferEngine("b", connect_timeout=1.0, timeout=2.0) as b,
    ):
        _write_once(a, b)
    assert len(dropped) == 2
