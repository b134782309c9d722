"""A namespace being opened holds no lock another namespace's requests or frames need
(issue 35): while one client's open is stuck making its store (here a store whose making
waits for an event the test controls, as a large prefault or a slow LMDB open would), a
client of another namespace gets, puts and pins; a second open of the stuck namespace
waits for it and then shares it. Before, the open held the server's state lock throughout
and every request of every namespace waited (201-221 ms measured for one 64 KiB get while
three namespaces opened)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import keys, payloads, until

from kvbridge.store import CacheServer, ServerConfig, StoreClient, TieredStore
from kvbridge.store.server import _namespace_table

BB = 4096


class _Gate:
    """The store of the namespace named ``slow`` waits, while being made, for
    ``release``; the store of ``old`` waits so while it closes."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def store(self, block_bytes: int, **settings: Any) -> TieredStore:
        if settings.get("namespace") == b"slow":
            self._wait()
        store = TieredStore(block_bytes, **settings)
        if settings.get("namespace") == b"old":
            close = store.close

            def waiting_close() -> None:
                self._wait()
                close()

            store.close = waiting_close  # type: ignore[method-assign]
        return store

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the store"


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    gate = _Gate()
    monkeypatch.setattr(_namespace_table, "TieredStore", gate.store)
    yield gate
    gate.release.set()


def test_another_namespace_is_served_while_one_is_being_opened(gate: _Gate) -> None:
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


def test_another_namespace_is_served_while_an_idle_one_is_reclaimed(gate: _Gate) -> None:
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
