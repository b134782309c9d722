"""No namespace waits for another's (issue 35): each has a lock of its own, the only one its
requests and remote frames take, and the slow work of the server runs outside every lock
another namespace needs. Here the slow step waits for an event the test controls, and a
client of another namespace gets, puts and matches meanwhile:

- an open making its store (a large prefault, a slow LMDB open); a second open of the
  stuck namespace waits for it and then shares it;
- a reclaim closing an idle namespace's store (its memory unmapped, its disk synced);
- a commit writing its blocks through to the namespace's disk (LMDB).

Before, one server-wide state lock was held throughout each, and every request of every
namespace waited (201-221 ms measured for one 64 KiB get while three namespaces opened).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gated_stores import GatedStores, gated_stores
from helpers import keys, payloads, until

from kvbridge.store import CacheServer, ServerConfig, StoreClient

BB = 4096


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedStores]:
    yield from gated_stores(monkeypatch)


def test_another_namespace_is_served_while_one_is_being_opened(gate: GatedStores) -> None:
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as server:
        fast = StoreClient(server.address, block_bytes=BB, namespace="fast")
        opened: list[StoreClient] = []
        second: list[StoreClient] = []  # each client is closed here: see test_unclosed_engine
        opener = threading.Thread(
            target=lambda: opened.append(
                StoreClient(server.address, block_bytes=BB, namespace="slow", timeout=30)
            )
        )
        try:
            opener.start()
            assert gate.entered.wait(20), "the slow open never started making its store"
            ks = keys(0, 4)
            assert all(fast.put(ks, payloads(ks, BB)))  # stage, write, commit
            out = np.zeros((4, BB), np.uint8)
            fast.get(ks, out)  # pin, read, release
            np.testing.assert_array_equal(out, payloads(ks, BB))
            assert fast.match_prefix(ks) == 4
            assert not opened and opener.is_alive()  # all of it while the open was stuck
            waiter = threading.Thread(
                target=lambda: second.append(
                    StoreClient(server.address, block_bytes=BB, namespace="slow", timeout=30)
                )
            )
            waiter.start()
            gate.release.set()
            opener.join(30)
            waiter.join(30)
            until(lambda: len(opened) == len(second) == 1, "both opens of the slow namespace")
            slow_keys = keys(10, 12)
            assert all(opened[0].put(slow_keys, payloads(slow_keys, BB)))
            assert second[0].match_prefix(slow_keys) == 2  # one namespace, shared
        finally:
            gate.release.set()
            opener.join(30)
            for client in (fast, *opened, *second):
                client.close()


def test_another_namespace_is_served_while_an_idle_one_is_reclaimed(gate: GatedStores) -> None:
    """At the namespace limit an open reclaims an idle namespace, whose store then closes
    (its memory unmapped, its disk synced): here a close that waits for the test."""
    config = ServerConfig(port=0, host_capacity=64 << 20, max_namespaces=2)
    with CacheServer(config) as server:
        fast = StoreClient(server.address, block_bytes=BB, namespace="fast")
        StoreClient(server.address, block_bytes=BB, namespace="old").close()  # idle now
        opened: list[StoreClient] = []
        opener = threading.Thread(
            target=lambda: opened.append(
                StoreClient(server.address, block_bytes=BB, namespace="new", timeout=30)
            )
        )
        try:
            opener.start()
            assert gate.entered.wait(20), "the open never reclaimed the idle namespace"
            ks = keys(20, 23)
            assert all(fast.put(ks, payloads(ks, BB)))
            out = np.zeros((3, BB), np.uint8)
            fast.get(ks, out)
            np.testing.assert_array_equal(out, payloads(ks, BB))
            assert not opened and opener.is_alive()  # while the old store was closing
            gate.release.set()
            opener.join(30)
            assert len(opened) == 1 and opened[0].match_prefix(ks) == 0  # another namespace
        finally:
            gate.release.set()
            opener.join(30)
            for client in (fast, *opened):
                client.close()


def test_another_namespace_is_served_while_a_commit_writes_to_disk(
    gate: GatedStores, tmp_path: Path
) -> None:
    """A commit writes its blocks through to the disk tier under its own namespace's lock
    (the store's, inside it): the write here waits for the test."""
    config = ServerConfig(
        port=0, host_capacity=64 << 20, disk_path=str(tmp_path), disk_capacity=64 << 20
    )
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=BB, namespace="fast") as fast,
        StoreClient(server.address, block_bytes=BB, namespace="disk", timeout=30) as slow,
    ):
        slow_keys = keys(30, 32)
        stored: list[list[bool]] = []
        writer = threading.Thread(
            target=lambda: stored.append(slow.put(slow_keys, payloads(slow_keys, BB)))
        )
        try:
            writer.start()
            assert gate.entered.wait(20), "the commit never wrote to the disk"
            ks = keys(40, 43)
            assert all(fast.put(ks, payloads(ks, BB)))
            out = np.zeros((3, BB), np.uint8)
            fast.get(ks, out)
            np.testing.assert_array_equal(out, payloads(ks, BB))
            assert fast.match_prefix(ks) == 3
            assert not stored and writer.is_alive()  # all of it while the write waited
            gate.release.set()
            writer.join(30)
            assert stored == [[True, True]] and slow.match_prefix(slow_keys) == 2
        finally:
            gate.release.set()
            writer.join(30)
