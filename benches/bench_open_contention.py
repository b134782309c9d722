"""The longest 64 KiB get of one namespace while other clients open three new namespaces
(issue 35), against the same gets with nothing opening, same run, same server: one
``kvbridge serve`` whose namespaces each get 512 MiB of host memory (prefaulted when a
namespace is made). ``.venv/bin/python -m pytest benches/bench_open_contention.py -s``."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.store import StoreClient

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess

BB = 64 << 10
OPENS = 3


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "2GiB", "--max-namespaces", "4")
    yield proc
    proc.kill()


def _gets(
    client: StoreClient, key: bytes, until: threading.Event | None, count: int
) -> list[float]:
    """Get one block again and again: ``count`` times, or until ``until`` is set."""
    out = np.zeros((1, BB), np.uint8)
    times: list[float] = []
    while (until is None and len(times) < count) or (until is not None and not until.is_set()):
        start = time.perf_counter()
        client.get([key], out)
        times.append(time.perf_counter() - start)
    return times


def _open_three(address: str, round_: int, done: threading.Event) -> None:
    try:
        for i in range(OPENS):
            name = f"opening-{round_}-{i}"
            with StoreClient(address, block_bytes=BB, namespace=name, timeout=60):
                pass  # closed at once: reclaimable by the next open
    finally:
        done.set()


def test_gets_while_namespaces_open(server: ServeProcess, benchmark: Any) -> None:
    with StoreClient(server.address, block_bytes=BB, namespace="reader") as reader:
        key = bytes(range(32))
        assert reader.put([key], np.ones((1, BB), np.uint8)) == [True]
        quiet = _gets(reader, key, None, 300)
        busy: list[float] = []
        for round_ in range(3):
            done = threading.Event()
            opener = threading.Thread(target=_open_three, args=(server.address, round_, done))
            opener.start()
            busy += _gets(reader, key, done, 0)
            opener.join()
        benchmark.pedantic(lambda: _gets(reader, key, None, 50), rounds=3)
    figures = {
        "quiet_median_ms": statistics.median(quiet) * 1e3,
        "quiet_max_ms": max(quiet) * 1e3,
        "opening_median_ms": statistics.median(busy) * 1e3,
        "opening_max_ms": max(busy) * 1e3,
        "gets_while_opening": len(busy),
    }
    benchmark.extra_info.update(figures)
    print()
    print("| gets of one namespace | median ms | longest ms | gets |")
    print("| --- | ---: | ---: | ---: |")
    calm = f"{figures['quiet_median_ms']:.2f} | {figures['quiet_max_ms']:.1f}"
    print(f"| nothing opening | {calm} | 300 |")
    print(
        f"| {OPENS} namespaces opening, 3 rounds | {figures['opening_median_ms']:.2f} | "
        f"{figures['opening_max_ms']:.1f} | {len(busy)} |"
    )
    print(f"longest while opening / longest quiet: {max(busy) / max(quiet):.1f}")
