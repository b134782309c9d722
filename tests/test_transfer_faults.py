"""Faults: a peer killed or frozen mid-transfer, garbage on the data and control ports."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest
import zmq
from attack import data_pipe
from helpers import reap, spawn_python, until

from kvbridge.transfer import (
    Peer,
    PeerClosed,
    Region,
    TransferEngine,
    TransferError,
    ucx_available,
)
from kvbridge.transfer._protocol import KEEPALIVE_MISSES
from kvbridge.transfer._settings import DEFAULT_STREAMS

MiB = 1 << 20

_TARGET = """
import sys
import numpy as np
from kvbridge.transfer import TransferEngine

engine = TransferEngine("target", transports=sys.argv[1])
buffer = np.zeros(256 << 20, np.uint8)
engine.register(buffer)
print(engine.metadata().hex(), flush=True)
sys.stdin.read()
engine.close()
"""


TRANSPORTS = ["tcp"] + (["ucx"] if ucx_available() else [])


@pytest.fixture(params=TRANSPORTS)
def target(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TARGET, request.param],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    metadata = bytes.fromhex(proc.stdout.readline().strip())
    yield proc, metadata
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(10)


def _engine(metadata: bytes, name: str, timeout: float) -> TransferEngine:
    """An engine speaking whatever transport the target offers."""
    return TransferEngine(
        name, transports=("tcp", "ucx") if ucx_available() else "tcp", timeout=timeout
    )


_Ops = list[tuple[Region, int, int, int, int]]


def _big_write(engine: TransferEngine, metadata: bytes) -> tuple[Peer, tuple[_Ops, Region]]:
    src = engine.register(np.ones(256 << 20, np.uint8))
    peer = engine.connect(metadata)
    region = next(iter(peer.regions.values()))
    ops = [(src, i * MiB, region.id, i * MiB, MiB) for i in range(256)]
    return peer, (ops, src)


@pytest.mark.slow
def test_killed_peer_fails_pending_handles_and_others_keep_working(
    target: tuple[subprocess.Popen[str], bytes],
) -> None:
    proc, metadata = target
    with _engine(metadata, "initiator", 5.0) as engine, TransferEngine("other") as other:
        peer, (ops, _) = _big_write(engine, metadata)
        handles = [peer.write(ops) for _ in range(8)]  # 2 GiB in flight
        proc.kill()
        started = time.monotonic()
        with pytest.raises(TransferError):
            for handle in handles:
                peer.wait(handle, 20)
        # TCP sees the reset at once; a UCX stream over shared memory sees nothing (UCX's
        # own keepalive runs every 20 s, the protocol's idles while busy), but the peer's
        # control connection drops, which Peer.wait looks at: well before the 5 s timeout.
        assert time.monotonic() - started < 4
        for handle in handles:  # every other batch fails too, none hangs
            with pytest.raises(TransferError):
                handle.wait(15)
        with pytest.raises(PeerClosed):
            peer.write(ops[:1])
        # The engine still serves and connects elsewhere.
        dst = other.register(np.zeros(MiB, np.uint8))
        src = engine.register(np.full(MiB, 7, np.uint8))
        engine.connect(other.metadata()).write([(src, 0, dst.id, 0, MiB)]).wait(10)


@pytest.mark.slow
def test_frozen_peer_times_out(target: tuple[subprocess.Popen[str], bytes]) -> None:
    proc, metadata = target
    with _engine(metadata, "initiator", 1.0) as engine:
        peer, (ops, _) = _big_write(engine, metadata)
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        handle = peer.write(ops * 4)
        with pytest.raises(TransferError, match=r"not done after 1\.0 s"):
            handle.wait(15)
        assert time.monotonic() - started < 10
        assert peer.closed


def _garbage_stream(target: TransferEngine, opener: TransferEngine, garbage: bytes) -> None:
    """Open a data stream to ``target`` by hand, send ``garbage`` on it, and close it (over
    UCX the stream is one of ``opener``'s pipes, the garbage one message)."""
    pipe = data_pipe(target, opener)
    pipe.send([garbage])
    pipe.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_on_the_data_port_fails_only_that_connection(transport: str) -> None:
    with (
        TransferEngine("a", transports=transport) as a,
        TransferEngine("b", transports=transport) as b,
        TransferEngine("m", transports=transport) as mallory,
    ):
        src, dst = a.register(np.full(MiB, 3, np.uint8)), b.register(np.zeros(MiB, np.uint8))
        peer = a.connect(b.metadata())
        rng = random.Random(1)
        for _ in range(30):
            _garbage_stream(b, mallory, rng.randbytes(rng.randint(1, 200)))
            peer.write([(src, 0, dst.id, 0, MiB)]).wait(10)
        assert (np.frombuffer(dst.view, np.uint8) == 3).all()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fuzzing_the_control_port_while_a_client_works(transport: str) -> None:
    with (
        TransferEngine("a", transports=transport) as a,
        TransferEngine("b", transports=transport) as b,
    ):
        src, dst = a.register(np.full(4096, 5, np.uint8)), b.register(np.zeros(4096, np.uint8))
        endpoint = f"tcp://{b.address}"
        stop = threading.Event()
        errors: list[BaseException] = []

        def fuzz() -> None:
            rng = random.Random(2)
            ctx = zmq.Context()
            try:
                while not stop.is_set():
                    sock = ctx.socket(rng.choice([zmq.DEALER, zmq.REQ, zmq.PUSH]))
                    sock.setsockopt(zmq.LINGER, 0)
                    # A PUSH never pairs with the ROUTER: without a send timeout the fuzzer
                    # itself would block forever on it.
                    sock.setsockopt(zmq.SNDTIMEO, 100)
                    sock.connect(endpoint)
                    junk = rng.choice(
                        [
                            rng.randbytes(rng.randint(0, 300)),
                            msgpack.packb({"op": rng.choice(["hello", "auth", "metadata", 7])}),
                            msgpack.packb({"op": "hello", "v": 1, "name": "x", "nonce": b"1"}),
                            msgpack.packb([1, 2, 3]),
                        ]
                    )
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart([b"", junk] if rng.random() < 0.5 else [junk])
                    time.sleep(0.001)
                    sock.close()
            except BaseException as exc:
                errors.append(exc)
            finally:
                ctx.term()

        thread = threading.Thread(target=fuzz)
        thread.start()
        try:
            for _ in range(20):
                peer = a.connect(b.metadata())
                peer.write([(src, 0, dst.id, 0, 4096)]).wait(10)
                peer.close()
        finally:
            stop.set()
            thread.join()
        assert not errors
        assert (np.frombuffer(dst.view, np.uint8) == 5).all()


# -- peers that die or freeze while idle: the keepalive ----------------------------------

KEEPALIVE = 0.5
SLACK = 3.0
"""Beyond a bound, for scheduling on a loaded two-core machine (three processes, a thread
each per stream): what a wait allows on top of the bound under test, never what it asserts."""


_IDLE_CLIENT = """
import sys
from kvbridge.transfer import TransferEngine

engine = TransferEngine("client", transports=sys.argv[1])
engine.connect(bytes.fromhex(sys.argv[2]))
print("connected", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_an_idle_client_that_dies_or_freezes_loses_its_session(transport: str, fault: int) -> None:
    """The server ends the session of a client that went silent within the keepalive's
    bound (three intervals): its streams, and with them its leases, are not held for good."""
    ended = threading.Event()
    with TransferEngine("server", transports=transport, keepalive=KEEPALIVE) as server:
        server.set_session_end_handler(lambda caller: ended.set())
        client = spawn_python(_IDLE_CLIENT, transport, server.metadata().hex())
        try:
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "connected"
            until(lambda: server.stats()["served_streams"] == DEFAULT_STREAMS)
            os.kill(client.pid, fault)
            assert ended.wait(KEEPALIVE_MISSES * KEEPALIVE + SLACK), "the session lives on"
            until(lambda: server.stats()["served_streams"] == 0)
        finally:
            reap(client)


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_idle_stream_that_keeps_its_peer_alive_lives_on(transport: str) -> None:
    """The other side of the bound: a live client idle for many keepalive limits keeps its
    session (its PINGs are answered), and its next write goes through."""
    ended = threading.Event()
    with (
        TransferEngine("server", transports=transport, keepalive=0.1) as server,
        TransferEngine("client", transports=transport) as client,
    ):
        server.set_session_end_handler(lambda caller: ended.set())
        dst = server.register(np.zeros(4096, np.uint8))
        src = client.register(np.ones(4096, np.uint8))
        peer = client.connect(server.metadata())
        assert not ended.wait(10 * KEEPALIVE_MISSES * 0.1)  # ten silence limits, all pinged
        peer.write([(src, 0, dst.id, 0, 4096)]).wait(10)
        assert not peer.closed


_IDLE_SERVER = """
import sys
from kvbridge.transfer import TransferEngine

engine = TransferEngine("server", transports=sys.argv[1], keepalive=float(sys.argv[2]))
print(engine.metadata().hex(), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_client_notices_its_idle_server_died_or_froze(transport: str, fault: int) -> None:
    """The other way round: the client's peer closes once its PING, sent while nothing
    else was outstanding, has no answer for the keepalive's limit (it pings within two
    intervals of its last frame and looks once an interval), so the next call reconnects
    instead of waiting out a transfer timeout."""
    server = spawn_python(_IDLE_SERVER, transport, str(KEEPALIVE))
    try:
        assert server.stdout is not None
        metadata = bytes.fromhex(server.stdout.readline())
        with TransferEngine("client", transports=transport) as client:
            peer = client.connect(metadata)
            os.kill(server.pid, fault)
            until(lambda: peer.closed, timeout=(2 + 2 * KEEPALIVE_MISSES) * KEEPALIVE + SLACK)
    finally:
        reap(server)
