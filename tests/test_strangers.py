"""Strangers holding connections, on every port of a real ``kvbridge serve`` started under
an open-files limit of 1,024 that it cannot raise: 5,000 connections that never prove
anything, reopened as fast as the server closes them, on the control port, the events
port (both ZMQ: each completes ZMQ's greeting), the data port or the metrics port. A real
client still connects, and puts and reads a block back byte for byte, each call within
1 s, while the flood goes on; and the server still serves once it ends. Before the gates,
about 1,100 silent ZMQ connections took every descriptor and a client timed out."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import key, payloads
from serve import ServeProcess
from strangers import StrangerFlood, every_port

from kvbridge.store import StoreClient

STRANGERS = 5000
BLOCK = 4096
CALL_BOUND_S = 1.0
"""What the issue asks of every call of a real client under the flood."""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServeProcess, dict[str, int]]]:
    served, ports = every_port("--host-capacity", "16MiB")
    yield served, ports
    served.kill()


def _round_trip(address: str, number: int) -> None:
    ks = [key(number), key(number + 1)]
    blocks = payloads(ks, BLOCK)
    with StoreClient(address, block_bytes=BLOCK, namespace="m", timeout=CALL_BOUND_S) as client:
        client.put(ks, blocks)
        out = np.zeros_like(blocks)
        client.get(ks, out)
        assert np.array_equal(out, blocks)
        assert client.subscription().ticket  # the events op answers too


@pytest.mark.slow
@pytest.mark.parametrize("port", ["control", "events", "data", "metrics"])
def test_a_flood_of_strangers_leaves_room_for_a_real_client(
    server: tuple[ServeProcess, dict[str, int]], port: str
) -> None:
    served, ports = server
    number = 100 * list(ports).index(port)
    with StrangerFlood(ports[port], STRANGERS, zmtp=port in ("control", "events")) as flood:
        flood.wait_held()
        for i in range(3):
            _round_trip(served.address, number + 2 * i)
        opened = flood.stop()
    assert opened >= STRANGERS
    assert served.proc.poll() is None
    _round_trip(served.address, number + 10)  # and after it


def test_the_server_raises_its_open_files_limit_at_start() -> None:
    served = ServeProcess("--host-capacity", "16MiB", open_files=(1024, 4096))
    try:
        assert served.open_files() == 4096
        log = served.stop_and_read_log()
    finally:
        served.kill()
    assert "open files: 4096" in log
