"""Stored versus served (``store/server/_served.py``): a cache that stores but never
serves says so. On a fake clock: a namespace whose writers keep storing while its readers'
loads all fail, or whose readers open another namespace (a mismatched setting between two
engines), raises the write-only alarm once its window passes (one warning, the gauge at 1),
and ``kvbridge stats`` shows what lookups advertised against what was delivered; a delivered
block ends the alarm."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys

import numpy as np
import pytest
from helpers import FakeClock, keys, payloads
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvbridge.store import BlockNotFound, CacheServer, ServerConfig, StoreClient

BLOCK = 64 << 10
WINDOW = 600.0


def _server(clock: FakeClock) -> CacheServer:
    config = ServerConfig(
        port=0, host_capacity=64 * BLOCK, max_namespaces=2, handoff_ttl=0, lease_ttl=30
    )
    return CacheServer(config, clock=clock)


def _gauge(server: CacheServer, namespace: str) -> float:
    """The namespace's ``kvbridge_write_only``, as Prometheus would scrape it."""
    text = generate_latest(server.metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvbridge_write_only" and sample.labels["namespace"] == namespace:
                return float(sample.value)
    raise AssertionError(f"no kvbridge_write_only for {namespace}")


def _store_every_minute(client: StoreClient, clock: FakeClock, minutes: int, first: int) -> None:
    for i in range(minutes):
        ks = keys(first + i, first + i + 1)
        client.put(ks, payloads(ks, BLOCK))
        clock.advance(60)


def test_a_namespace_whose_loads_all_fail_raises_the_alarm_within_its_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    with _server(clock) as server:
        writer = StoreClient(server.address, block_bytes=BLOCK, namespace="model")
        reader = StoreClient(server.address, block_bytes=BLOCK, namespace="model")
        with writer, reader, caplog.at_level(logging.WARNING, "kvbridge.server"):
            label = f"model/{BLOCK}"
            _store_every_minute(writer, clock, 9, first=0)
            for _ in range(3):  # the reader asks for blocks nobody stored: every load fails
                with pytest.raises(BlockNotFound):
                    reader.get(keys(500, 501), np.zeros(BLOCK, np.uint8))
            assert _gauge(server, label) == 0  # 9 minutes: inside the window
            _store_every_minute(writer, clock, 3, first=9)  # past 10 minutes
            assert _gauge(server, label) == 1
            warned = [r for r in caplog.records if "write-only" in r.getMessage()]
            assert len(warned) == 1 and "lost gone 3" in warned[0].getMessage()
            _store_every_minute(writer, clock, 3, first=12)
            assert len([r for r in caplog.records if "write-only" in r.getMessage()]) == 1
            reader.get(keys(0, 1), np.zeros(BLOCK, np.uint8))  # a delivered block ends it
            assert _gauge(server, label) == 0


def test_two_engines_on_mismatched_namespaces_show_in_kvbridge_stats() -> None:
    """The writer saves in one namespace, the reader looks up in another (a different
    model or block layout setting): the writer's namespace goes write-only, and ``kvbridge
    stats`` shows the reader's lookups advertising nothing and nothing delivered."""
    clock = FakeClock()
    with _server(clock) as server:
        writer = StoreClient(server.address, block_bytes=BLOCK, namespace="model-a")
        reader = StoreClient(server.address, block_bytes=BLOCK, namespace="model-b")
        with writer, reader:
            for minute in range(12):
                ks = keys(minute, minute + 1)
                writer.put(ks, payloads(ks, BLOCK))
                assert reader.match_prefix(ks) == 0
                clock.advance(60)
            assert _gauge(server, f"model-a/{BLOCK}") == 1
            assert _gauge(server, f"model-b/{BLOCK}") == 0  # it stores nothing
            shown = subprocess.run(
                [sys.executable, "-m", "kvbridge", "stats", server.address],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
    lines = shown.splitlines()
    at = next(i for i, line in enumerate(lines) if "advertised" in line)
    header = lines[at].split()
    rows = {
        line.split()[0]: dict(zip(header, line.split(), strict=True)) for line in lines[at + 1 :]
    }
    asked, written = rows[_shown_as("model-b")], rows[_shown_as("model-a")]
    assert (asked["lookups"], asked["advertised"], asked["delivered"]) == ("12", "0", "0")
    assert written["alarm"] == "WRITE-ONLY" and asked["alarm"] == "-"


def _shown_as(namespace: str) -> str:
    """How ``kvbridge stats`` names a namespace its own session did not open (a digest)."""
    return f"sha256:{hashlib.sha256(namespace.encode()).hexdigest()[:12]}/{BLOCK}"
