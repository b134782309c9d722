"""A named test helper: a cache server's namespace stores whose slow steps wait for the
test (``GatedStores``), for the tests that a slow step of one namespace holds no lock
another namespace needs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvbridge.store import BlockKey, TieredStore
from kvbridge.store.server import _namespace_table


class GatedStores:
    """Stores made by the server, each slow step of a few names waiting for ``release``
    (``entered`` is set as one starts waiting):

    - ``slow``: the store's making (a large prefault, a slow LMDB open);
    - ``old``: its close (a reclaim unmapping memory, syncing LMDB);
    - ``disk``: each block its disk tier writes (a commit's write-through to LMDB)."""

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
        if settings.get("namespace") == b"disk":
            disk = store.tiers[-1]
            write = disk.store

            def waiting_write(key: BlockKey, src: Any, checksum: int = 0) -> None:
                self._wait()
                write(key, src, checksum)

            disk.store = waiting_write  # type: ignore[method-assign]
        return store

    def _wait(self) -> None:
        self.entered.set()
        assert self.release.wait(60), "the test never released the store"


def gated_stores(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedStores]:
    """The server's namespaces made as :class:`GatedStores` (a fixture's body): released
    at the end whatever the test did."""
    gate = GatedStores()
    monkeypatch.setattr(_namespace_table, "TieredStore", gate.store)
    yield gate
    gate.release.set()
