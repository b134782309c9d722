"""A cache client only dials (issue 35): its engine (``TransferEngine(serve=False)``) opens
no listening socket and starts no control server, call pool or accept thread, on TCP and
on UCX; it still does all a client does (puts, gets, pins) against a real server. What a
dial-only engine would serve is refused, saying why."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from helpers import keys, listening_sockets, payloads
from serve import ServeProcess

from kvbridge.store import StoreClient
from kvbridge.transfer import LocalProtocolError, TransferEngine, ucx_available

BB = 4096
SERVING_THREADS = ("kvbridge-control", "kvbridge-call-", "kvbridge-tcp-accept")
"""Threads of an engine that serves: its control socket, its call pool, its data listener."""


def _serving_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(SERVING_THREADS)]


TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            not ucx_available(), reason="needs ucxx: pip install kvbridge[ucx]"
        ),
    ),
]


@pytest.fixture(scope="module", params=TRANSPORTS)
def server(request: pytest.FixtureRequest) -> Iterator[tuple[ServeProcess, str]]:
    proc = ServeProcess("--host-capacity", "16MiB", "--transports", request.param)
    yield proc, request.param
    proc.kill()


@pytest.mark.slow
def test_a_client_opens_no_listening_socket_and_no_serving_thread(
    server: tuple[ServeProcess, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over UCX, UCX's own TCP transport listens for its endpoints whoever uses it (a
    worker's context opens two listening sockets): the client's context is limited to
    shared memory here, so that every listening socket left is one kvbridge opened."""
    proc, transport = server
    monkeypatch.setenv("UCX_TLS", "sm,self")  # read when the client's UCX context is made
    before, threads = listening_sockets(), _serving_threads()
    with StoreClient(proc.address, block_bytes=BB, namespace="dial", transports=transport) as c:
        assert listening_sockets() == before
        assert _serving_threads() == threads
        ks = keys(0, 4)
        assert all(c.put(ks, payloads(ks, BB)))
        out = np.zeros((4, BB), np.uint8)
        c.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        lease = c.pin(ks)
        lease.release()
        assert c.engine.stats()["calls_queued"] == 0


def test_what_a_dial_only_engine_would_serve_is_refused() -> None:
    with TransferEngine("dialler", serve=False) as engine:
        for attempt in (
            lambda: engine.address,
            engine.metadata,
            lambda: engine.set_request_handler(lambda caller, body: {}),
        ):
            with pytest.raises(LocalProtocolError, match="only dials"):
                attempt()


def test_a_serving_engine_listens() -> None:
    """The contrast that makes the first test mean something: the same probes see a
    serving engine's sockets and threads."""
    before = listening_sockets()
    with TransferEngine("server") as engine:
        assert len(listening_sockets() - before) == 2  # control and TCP data
        assert any(name.startswith("kvbridge-control") for name in _serving_threads())
        host, port = engine.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            pass
