"""The UCX transport keeps TCP's promises; each test acts as the fault or the attacker would.

- A client killed while idle gives back what its session held within the keepalive's
  bound (UCX over shared memory reports no dead peer at all; the engine-level tests of the
  keepalive, over every transport, are in ``test_transfer_faults.py``).
- No byte lands after a failure: not in a reader's buffer once its read failed, not in a
  served region once the write's hold on it ended, even when the stopped peer resumes in
  the middle of a rendezvous.
- Streams that never greet leave nothing posted; a stranger's messages open no stream and
  nothing a peer sends stops the listener.
- Channel numbers a peer's code chooses (colliding, huge, reserved) never cross two streams
  and never break a serving thread.

Everything that is not about UCX alone runs over TCP too.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from attack import data_pipe
from helpers import reap, spawn_python, until
from serve import ServeProcess

from kvbridge.store import StoreClient
from kvbridge.transfer import PeerClosed, Region, TransferEngine, TransferError, ucx_available
from kvbridge.transfer import _ucx as ucx_module
from kvbridge.transfer._metadata import EngineInfo
from kvbridge.transfer._protocol import KEEPALIVE_MISSES
from kvbridge.transfer._settings import DEFAULT_STREAMS

TRANSPORTS = ["tcp"] + (["ucx"] if ucx_available() else [])
needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (kvbridge[ucx])")
MiB = 1 << 20
KEEPALIVE = 0.5
SLACK = 3.0
"""Beyond a bound, for scheduling on a loaded two-core machine (three processes, a UCX
thread each): what a wait allows on top of the bound under test, never what it asserts."""


# -- a. dead peers (the engine-level tests are in test_transfer_faults.py) ----------------

_STORE_CLIENT = """
import sys
from kvbridge.store import StoreClient

client = StoreClient(sys.argv[1], block_bytes=1 << 16, namespace="first", transports="ucx")
print("open", flush=True)
sys.stdin.read()
"""


def _opens(address: str, namespace: str) -> bool:
    try:
        client = StoreClient(address, block_bytes=1 << 16, namespace=namespace, transports="ucx")
    except Exception:  # the table is full: StoreFull, or the pause after a refused open
        return False
    client.close()
    return True


_KEEPALIVE_S = 1.0


@pytest.mark.slow
@needs_ucx
def test_a_killed_ucx_client_gives_its_namespace_back() -> None:
    """``kvbridge serve --max-namespaces 1`` over UCX: a client SIGKILLed while idle held
    the only namespace for good (35 s and counting); now its session ends within the
    keepalive's bound (three missed pings; 1 s ones here) and the next client's namespace
    opens."""
    server = ServeProcess(
        *("--transports", "ucx", "--max-namespaces", "1", "--host-capacity", str(4 * MiB)),
        *("--keepalive", str(_KEEPALIVE_S)),
    )
    client = spawn_python(_STORE_CLIENT, server.address)
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == "open"
        assert not _opens(server.address, "second")  # the table is full
        client.kill()
        until(
            lambda: _opens(server.address, "second"),
            "the dead client's namespace is given back",
            timeout=KEEPALIVE_MISSES * _KEEPALIVE_S + SLACK,
            pause=0.5,
        )
    finally:
        reap(client)
        server.kill()


# -- b. no byte after the failure -------------------------------------------------------

_SERVER = """
import sys
import numpy as np
from kvbridge.transfer import TransferEngine

engine = TransferEngine("server", transports=sys.argv[1], timeout=float(sys.argv[2]))
engine.register(np.full(int(sys.argv[3]), 0xAB, np.uint8))
print(engine.metadata().hex(), flush=True)
for line in sys.stdin:  # each line: how many streams it serves
    print(engine.stats()["served_streams"], flush=True)
engine.close()
"""

_WRITER = """
import sys
import numpy as np
from kvbridge.transfer import TransferEngine

engine = TransferEngine("writer", transports=sys.argv[1], timeout=float(sys.argv[2]))
source = engine.register(np.full(int(sys.argv[3]), 0x5A, np.uint8))
peer = engine.connect(bytes.fromhex(sys.argv[4]))
remote = next(iter(peer.regions.values()))
try:
    peer.write([(source, 0, remote.id, 0, remote.length)]).wait(120)
    print("written", flush=True)
except Exception:
    print("failed", flush=True)
sys.stdin.read()
"""

SIZE = 256 * MiB
SAMPLE = MiB  # one byte per MiB tells whether a transfer has started to land


def _served(server: subprocess.Popen[str]) -> int:
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write("?\n")
    server.stdin.flush()
    return int(server.stdout.readline())


def _landing(buffer: np.ndarray) -> None:
    """Wait until the first bytes of a transfer are in ``buffer`` (then it is mid-way)."""
    until(lambda: bool(buffer[::SAMPLE].any()), "the transfer started", pause=0.0005)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failed_read_lets_no_byte_land_after_its_failure(transport: str) -> None:
    """The server is stopped mid-read; the read fails with its timeout; the server resumes
    and finishes what it was sending. Not one more byte lands in the reader's buffer (a
    canary): the failure came only once nothing could write there any more."""
    server = spawn_python(_SERVER, transport, "2.0", str(SIZE))
    try:
        assert server.stdout is not None
        metadata = bytes.fromhex(server.stdout.readline())
        with TransferEngine("reader", transports=transport, timeout=1.0) as reader:
            canary = np.zeros(SIZE, np.uint8)
            local = reader.register(canary)
            peer = reader.connect(metadata)
            remote = next(iter(peer.regions.values()))
            handle = peer.read([(local, 0, remote.id, 0, SIZE)])
            _landing(canary)
            os.kill(server.pid, signal.SIGSTOP)
            with pytest.raises(TransferError, match="not done after"):
                handle.wait(30)
            landed = canary.copy()
            os.kill(server.pid, signal.SIGCONT)
            until(
                lambda: not np.array_equal(canary, landed) or _served(server) == 0,
                "the server's stream ended (or a byte landed)",
            )
            assert np.array_equal(canary, landed), "bytes landed after the read failed"
    finally:
        reap(server)


def _hold_ended(engine: TransferEngine, region: Region) -> bool:
    try:
        engine.unregister(region)
    except TransferError:  # RegionBusy: a served op still holds it
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_stalled_write_lets_no_byte_land_after_its_hold_ended(transport: str) -> None:
    """A writer is stopped mid-write; the frame's deadline ends the stream and the write's
    hold on the region; the region's memory goes to its next owner (a canary); the writer
    resumes in the middle of its rendezvous. Not one of its bytes lands in the canary."""
    with TransferEngine("server", transports=transport, timeout=1.0) as server:
        slot = np.zeros(SIZE, np.uint8)
        region = server.register(slot)
        writer = spawn_python(_WRITER, transport, "2.0", str(SIZE), server.metadata().hex())
        try:
            _landing(slot)
            os.kill(writer.pid, signal.SIGSTOP)
            until(lambda: _hold_ended(server, region), "the write's hold ended")
            slot[:] = 0xC3  # the next owner's bytes
            os.kill(writer.pid, signal.SIGCONT)
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "failed"
            until(lambda: server.stats()["served_streams"] == 0, "the stream ended")
            assert (slot == 0xC3).all(), "the stalled write landed after its hold ended"
        finally:
            reap(writer)


# -- c. streams that never greet, strangers ------------------------------------------------


def _posted(engine: TransferEngine) -> int:
    """UCX operations the engine's transport has posted and UCX has not finished yet."""
    return int(engine._transports["ucx"].posted())  # type: ignore[union-attr]


@pytest.mark.slow
@needs_ucx
def test_streams_that_never_greet_leave_nothing_posted() -> None:
    """A peer opens streams and never greets: once the greeting timeout ends them, the
    server holds no thread, no stream and no posted receive for them (each posted receive
    has an owner that cancels it)."""
    with (
        TransferEngine("server", transports="ucx", connect_timeout=1.0) as server,
        TransferEngine("silent", transports="ucx") as silent,
    ):
        baseline = _posted(server)
        pipes = [data_pipe(server, silent) for _ in range(8)]
        until(
            lambda: server.stats()["served_streams"] == 0, "the greeting timeout ended the streams"
        )
        until(lambda: _posted(server) == baseline, "nothing is posted for them any more")
        for pipe in pipes:
            pipe.close()


def _stranger_sends(
    worker_address: bytes, messages: Callable[[bytes], list[bytes]], answer_tag: int | None
) -> bytes | None:
    """Send ``messages(own worker address)`` to a UCX worker on its connect tag from a bare
    ucxx worker (as a stranger would, without kvbridge) and wait until they went out, and
    for a message on ``answer_tag`` if one is given (its first 8 bytes)."""
    raw = ucx_module._Worker()
    ucx, array = raw.ucx, raw.Array
    box: list[Any] = []
    answer = bytearray(8)
    payloads = messages(raw.address)

    def send() -> Any:
        address = ucx.UCXAddress.create_from_buffer(worker_address)
        box.append(ucx.UCXEndpoint.create_from_worker_address(raw.worker, address, True))
        connect = ucx.UCXXTag(ucx_module._CONNECT_TAG)
        sends = [box[0].tag_send(array(m), connect) for m in payloads]
        if answer_tag is None:
            return sends, None
        return [*sends, raw.worker.tag_recv(array(answer), ucx.UCXXTag(answer_tag))], None

    def drop() -> Any:
        for endpoint in box:
            endpoint.close_blocking()
        box.clear()
        return [], None

    try:
        raw.call(send).result(20)
        return None if answer_tag is None else bytes(answer)
    finally:
        raw.call(drop).result(10)
        raw.close()


@pytest.mark.slow
@needs_ucx
def test_no_message_a_stranger_sends_opens_a_stream_or_stops_the_listener() -> None:
    """A stranger (no kvbridge, no connect key) sends the server's UCX worker garbage on
    the connect tag and a message longer than any CONNECT: the server lives (UCX aborts on
    a garbage worker address), opens no stream, and an honest client still connects and
    writes. A well-formed CONNECT with a wrong key opens no stream either, and the right
    one, sent after it by the same stranger, is answered: the listener read them all."""
    server = spawn_python(_SERVER, "ucx", "5.0", str(MiB))
    try:
        assert server.stdout is not None
        metadata = bytes.fromhex(server.stdout.readline())
        listener = EngineInfo.decode(metadata).transports["ucx"]
        rng = random.Random(5)
        junk = [rng.randbytes(4096) for _ in range(20)] + [bytes(5000)]
        _stranger_sends(bytes(listener["worker"]), lambda own: junk, None)
        with TransferEngine("honest", transports="ucx") as honest:
            src = honest.register(np.ones(4096, np.uint8))
            peer = honest.connect(metadata)
            peer.write([(src, 0, next(iter(peer.regions)), 0, 4096)]).wait(10)
            assert _served(server) == DEFAULT_STREAMS
        assert server.poll() is None

        def connects(own: bytes) -> list[bytes]:
            wrong_key = ucx_module._connect_message(secrets.token_bytes(16), 7, own)
            good = ucx_module._connect_message(bytes(listener["key"]), 7, own)
            return [bytes(wrong_key), bytes(good)]

        answer_tag = (7 << 32) | ucx_module._CONTROL | ucx_module._ACCEPT  # on channel 7
        answer = _stranger_sends(bytes(listener["worker"]), connects, answer_tag)
        assert answer is not None and answer.startswith(b"KVU1")
        assert _served(server) <= 1  # the good CONNECT's stream, until its greeting times out
    finally:
        reap(server)


# -- d. channels a peer chooses ---------------------------------------------------------


class _Chosen:
    """What a peer's modified kvbridge draws its channel numbers from: one number."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.token_bytes = secrets.token_bytes

    def randbelow(self, n: int) -> int:
        return self.value


@pytest.fixture
def three() -> Iterator[tuple[TransferEngine, TransferEngine, TransferEngine]]:
    with (
        TransferEngine("server", transports="ucx", timeout=10.0, connect_timeout=2.0) as s,
        TransferEngine("honest", transports="ucx", connect_timeout=2.0) as a,
        TransferEngine("mallory", transports="ucx", connect_timeout=2.0) as m,
    ):
        yield s, a, m


@needs_ucx
@pytest.mark.parametrize(
    "channel", [12345, 2**31 - 1, 2**32 - 2], ids=["colliding", "huge", "largest"]
)
def test_channels_peers_choose_never_cross_two_streams(
    monkeypatch: pytest.MonkeyPatch,
    three: tuple[TransferEngine, TransferEngine, TransferEngine],
    channel: int,
) -> None:
    """Every stream of two peers draws the same channel number (a peer's code may choose
    any), and the two write differently shaped batches at once (1 MiB messages against
    70,000-byte ones): each write lands where it addressed, whole, and no serving thread
    breaks (a channel from 2**31 up used to overflow the tag in the server's thread)."""
    monkeypatch.setattr(ucx_module, "secrets", _Chosen(channel))
    server, *peers = three
    half, piece = 8 * MiB, 70_000
    target = np.zeros(2 * half, np.uint8)
    there = server.register(target)
    shapes = [[(0, half)], [(o, min(piece, half - o)) for o in range(0, half, piece)]]
    handles = []
    for i, (engine, spans) in enumerate(zip(peers, shapes, strict=True)):
        here = engine.register(np.full(half, i + 1, np.uint8))
        peer = engine.connect(server.metadata())
        ops = [(here, o, there.id, i * half + o, n) for o, n in spans]
        handles += [peer.write(ops) for _ in range(4)]
    for handle in handles:
        handle.wait(20)
    assert (target[:half] == 1).all() and (target[half:] == 2).all()


@pytest.mark.slow
@needs_ucx
def test_a_connect_on_the_listeners_channel_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    three: tuple[TransferEngine, TransferEngine, TransferEngine],
) -> None:
    """A peer that claims the one reserved channel (the listener's, where CONNECTs travel)
    gets no stream; the server goes on serving others."""
    server, honest, mallory = three
    channels = mallory._transports["ucx"]._channels  # type: ignore[union-attr]
    monkeypatch.setattr(channels, "take", lambda: 0xFFFFFFFF)
    with pytest.raises(PeerClosed):
        mallory.connect(server.metadata())
    dst = server.register(np.zeros(4096, np.uint8))
    src = honest.register(np.ones(4096, np.uint8))
    honest.connect(server.metadata()).write([(src, 0, dst.id, 0, 4096)]).wait(10)
