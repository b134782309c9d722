"""A real client's calls while 5,000 strangers hold connections on one port of a
``kvbridge serve`` held to 1,024 open files (the usual soft limit, nothing to raise it
to), against the same client on the same server while nobody floods it, in the same run.

For each port (control, events, data, metrics): the flood (``tests/strangers.py``:
5,000 connections that never prove anything, each one the server closes reopened, at
most 1,000 a second; ZMQ's greeting on the ZMQ ports), then a fresh client connects
(handshake, open: the ``connect`` row) and makes 300 calls of each kind: ``contains`` (a
control round trip) and ``get`` of one 8 KiB block (pin, read, release). p50 and p99
of each, idle first, flooded second; the ratio is idle p50 / flooded p50."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import _EXTRA_LINES

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess
from strangers import StrangerFlood, every_port

from kvbridge.store import StoreClient

BB = 8 << 10
CALLS = 300
STRANGERS = 5000
CONNECTS = 20


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServeProcess, dict[str, int]]]:
    server, ports = every_port("--host-capacity", "64MiB", "--handoff-ttl", "0")
    yield server, ports
    server.kill()


def _percentiles(fn: Callable[[int], object], count: int) -> tuple[float, float]:
    times = []
    for i in range(count):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    us = np.array(times) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def _measure(address: str) -> dict[str, tuple[float, float]]:
    stored = [i.to_bytes(16, "little") for i in range(CALLS)]
    out = np.zeros((1, BB), np.uint8)

    def connect(_: int) -> None:
        with StoreClient(address, block_bytes=BB, namespace=b"strangers", timeout=5) as c:
            c.contains(stored[:1])

    rows = {"connect": _percentiles(connect, CONNECTS)}
    with StoreClient(address, block_bytes=BB, namespace=b"strangers", timeout=5) as client:
        client.put(stored, np.ones((CALLS, BB), np.uint8))
        rows["contains"] = _percentiles(lambda i: client.contains(stored[i : i + 1]), CALLS)
        rows["get 8 KiB"] = _percentiles(lambda i: client.get(stored[i : i + 1], out), CALLS)
    return rows


@pytest.mark.parametrize("port", ["control", "events", "data", "metrics"])
def test_calls_while_strangers_hold_a_port(
    served: tuple[ServeProcess, dict[str, int]], port: str
) -> None:
    server, ports = served
    idle = _measure(server.address)
    with StrangerFlood(ports[port], STRANGERS, zmtp=port in ("control", "events")) as flood:
        flood.wait_held()
        flooded = _measure(server.address)
        opened = flood.stop()
    for name, (p50, p99) in flooded.items():
        base50, base99 = idle[name]
        line = (
            f"{port} port, {STRANGERS} strangers ({opened} connections opened), {name}: "
            f"p50 {p50:.0f} us p99 {p99:.0f} us (idle p50 {base50:.0f} us p99 {base99:.0f} "
            f"us: ratio {base50 / p50:.2f})"
        )
        _EXTRA_LINES.append(line)
        print(line)
