"""One client, one 8 KiB block at a time, through ``kvbridge serve``: what a KV connector
feels per call. ``get`` (pin, read, release), ``put`` (stage, write with its commit) and
``contains`` (a control call alone), 1,000 of each in a row, against a raw TCP round trip
carrying the same 8 KiB to a Python echo server (``P`` + payload answered by one byte)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import _EXTRA_LINES

from kvbridge.store import StoreClient
from kvbridge.tools._serve_cmds import read_listening

HERE = Path(__file__).parent
BB = 8 << 10
COUNT = 1000


@pytest.fixture(scope="module")
def endpoints() -> Iterator[tuple[str, int]]:
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
            *("--host-capacity", "64MiB", "--handoff-ttl", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    echo = subprocess.Popen(
        [sys.executable, str(HERE / "_echo_server.py"), str(BB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and echo.stdout is not None
    address, _ = read_listening(server.stdout)
    yield address, int(echo.stdout.readline())
    assert echo.stdin is not None
    echo.stdin.close()
    echo.wait(30)
    server.terminate()
    server.wait(30)


def _times(fn: Callable[[int], object]) -> np.ndarray:
    times = []
    for i in range(COUNT):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return np.array(times) * 1e6


def test_one_block_calls(endpoints: tuple[str, int]) -> None:
    address, echo_port = endpoints
    raw = socket.create_connection(("127.0.0.1", echo_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.ones(BB, np.uint8)
    stored = [i.to_bytes(16, "little") for i in range(COUNT)]
    fresh = [(10**6 + i).to_bytes(16, "little") for i in range(COUNT)]
    out = np.zeros((1, BB), np.uint8)

    def ping(_: int) -> None:
        raw.sendall(b"P")
        raw.sendall(payload.data)
        assert raw.recv(1) == b"k"

    with StoreClient(address, block_bytes=BB, namespace=b"latency") as client:
        client.put(stored, np.ones((COUNT, BB), np.uint8))
        for i in range(100):  # warm-up
            client.get(stored[i : i + 1], out)
            ping(i)
        rows = {
            "raw round trip": _times(ping),
            "get": _times(lambda i: client.get(stored[i : i + 1], out)),
            "put": _times(lambda i: client.put(fresh[i : i + 1], out)),
            "contains": _times(lambda i: client.contains(stored[i : i + 1])),
        }
    raw.close()
    base = float(np.percentile(rows["raw round trip"], 50))
    for name, us in rows.items():
        p50, p99 = np.percentile(us, 50), np.percentile(us, 99)
        line = (
            f"8 KiB {name}: p50 {p50:.0f} us p99 {p99:.0f} us (raw round trip p50 {base:.0f} "
            f"us: ratio {base / p50:.2f})"
        )
        _EXTRA_LINES.append(line)
        print(line)
