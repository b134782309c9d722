"""The namespaces' event stream (``docs/EVENTS.md``) through a real ``kvbridge serve
--events-port``:

- throughput: puts of 1,000-block prompts (4 KiB blocks) while a ``KeyMirror`` follows,
  until the mirror holds every key, against the same puts to a server that publishes
  nothing (the ratio is what publishing and applying costs the writer), with the events
  per second the mirror applied;
- lag: one small put, then the time until the mirror lists its key, p50/p99, against
  asking the server (``contains``, one round trip: what the mirror saves a lookup). The
  reader yields the GIL as it polls: one that spins holding it starves the mirror's
  thread to Python's switch interval (5 ms).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import _EXTRA_LINES

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import KeyMirror, StoreClient

BB = 4096
PROMPT = 1000
PROMPTS = 8
LAGS = 500
_SERVER = ("--host-capacity", "1GiB", "--handoff-ttl", "0", "--max-namespaces", "1")


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    with_events = ServeProcess(*_SERVER, "--events-port", "0")
    without = ServeProcess(*_SERVER)
    yield with_events, without
    with_events.kill()
    without.kill()


def _client(server: ServeProcess) -> StoreClient:
    return StoreClient(server.address, block_bytes=BB, namespace="bench-events")


def test_events_throughput(
    compare: Callable[..., Any], servers: tuple[ServeProcess, ServeProcess]
) -> None:
    with_events, without = servers
    block = payloads(keys(0, PROMPT), BB)
    rounds = iter(range(1, 1_000_000))
    applied: list[float] = []

    with (
        _client(with_events) as published,
        _client(without) as plain,
        KeyMirror(lambda: _client(with_events)) as mirror,
    ):
        assert mirror.wait_ready(30)

        def puts_followed() -> None:
            base = next(rounds) * PROMPTS * PROMPT
            started = time.perf_counter()
            last = []
            for p in range(PROMPTS):
                ks = keys(base + p * PROMPT, base + (p + 1) * PROMPT)
                published.put(ks, block)
                last = ks
            while mirror.leading(last) != PROMPT:
                time.sleep(0.0002)
            applied.append(PROMPTS * PROMPT / (time.perf_counter() - started))

        def puts_alone() -> None:
            base = next(rounds) * PROMPTS * PROMPT
            for p in range(PROMPTS):
                plain.put(keys(base + p * PROMPT, base + (p + 1) * PROMPT), block)

        compare(
            f"{PROMPTS} puts of {PROMPT} blocks, mirror following",
            puts_followed,
            puts_alone,
            baseline_name="the same puts, no events",
            nbytes=PROMPTS * PROMPT * BB,
            rounds=10,
        )
    line = f"events: a mirror applied {statistics.median(applied):,.0f} keys/s (median)"
    _EXTRA_LINES.append(line)
    print(line)


def test_commit_to_mirror_lag(servers: tuple[ServeProcess, ServeProcess]) -> None:
    with_events, _ = servers
    block = payloads(keys(0, 1), BB)
    lags, asks = [], []
    with _client(with_events) as client, KeyMirror(lambda: _client(with_events)) as mirror:
        assert mirror.wait_ready(30)
        for i in range(LAGS):
            ks = keys(10_000_000 + i, 10_000_001 + i)
            client.put(ks, block)  # returns once committed
            started = time.perf_counter()
            while mirror.leading(ks) != 1:
                time.sleep(0)  # a reader that spins holding the GIL would starve the mirror
            lags.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.contains(ks)
            asks.append(time.perf_counter() - started)
    lag, ask = np.array(lags) * 1e6, np.array(asks) * 1e6
    line = (
        f"commit -> mirror lag p50 {np.percentile(lag, 50):.0f} us p99 "
        f"{np.percentile(lag, 99):.0f} us; a contains round trip p50 "
        f"{np.percentile(ask, 50):.0f} us p99 {np.percentile(ask, 99):.0f} us"
    )
    _EXTRA_LINES.append(line)
    print(line)
