"""What one cache client costs its process (issue 35: clients only dial): threads, listening
sockets and the time to connect and open a namespace, for a ``StoreClient`` (its engine
made with ``serve=False``) against the same client on a serving engine (what every client
was before: ``TransferEngine()`` passed in as ``engine=``), same run, same server.
``.venv/bin/python -m pytest benches/bench_client_cost.py -s``."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.store import StoreClient
from kvbridge.transfer import TransferEngine

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import listening_sockets
from serve import ServeProcess

ROUNDS = 30


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "16MiB")
    yield proc
    proc.kill()


Made = tuple[StoreClient, TransferEngine | None]
"""A client, and the engine it was given (closed after it), if any."""


def _dialling(address: str) -> Made:
    return StoreClient(address, block_bytes=4096, namespace="cost"), None


def _serving(address: str) -> Made:
    """A client on an engine that serves, as every client's was before."""
    engine = TransferEngine("serving-client", connect_timeout=5.0)
    return StoreClient(address, block_bytes=4096, namespace="cost", engine=engine), engine


def _cost(make: Callable[[], Made]) -> dict[str, float]:
    threads, sockets = threading.active_count(), len(listening_sockets())
    seconds, extra = [], {}
    for _ in range(ROUNDS):
        start = time.perf_counter()
        client, engine = make()
        seconds.append(time.perf_counter() - start)
        extra = {
            "threads": threading.active_count() - threads,
            "listening": len(listening_sockets()) - sockets,
        }
        client.close()
        if engine is not None:
            engine.close()
    return {**extra, "connect_ms": statistics.median(seconds) * 1e3}


def test_what_a_client_costs(server: ServeProcess, benchmark: Any) -> None:
    """The two kinds alternate, twice each (the machine is shared): the median of all."""
    runs: dict[str, list[dict[str, float]]] = {"after": [], "before": []}
    for _ in range(2):
        runs["before"].append(_cost(lambda: _serving(server.address)))
        runs["after"].append(_cost(lambda: _dialling(server.address)))
    after, before = (
        {**runs[kind][-1], "connect_ms": statistics.median(r["connect_ms"] for r in runs[kind])}
        for kind in ("after", "before")
    )

    def connect_and_close() -> None:
        _dialling(server.address)[0].close()

    benchmark.pedantic(connect_and_close, rounds=5)
    benchmark.extra_info.update({"dialling": after, "serving": before})
    print()
    print("| client | threads | listening sockets | connect + open, median ms |")
    print("| --- | ---: | ---: | ---: |")
    for label, cost in (("dials only (now)", after), ("serving engine (before)", before)):
        print(
            f"| {label} | {cost['threads']:.0f} | {cost['listening']:.0f} | "
            f"{cost['connect_ms']:.2f} |"
        )
    print(f"ratio connect now / before: {after['connect_ms'] / before['connect_ms']:.2f}")
    assert after["listening"] == 0 and before["listening"] == 2  # what each engine is
