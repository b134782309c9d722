"""Adversarial checks of issue 35's claim that no namespace waits for another's.

Each test holds one namespace's lock (and its store's lock) for as long as the test likes:
a commit whose write-through to LMDB waits on a gate (as in test_namespace_locks). A client
of another namespace then does something ordinary, and a third client of yet another
namespace must still be answered. Each failure names where the server got stuck.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import keys, payloads, until

from kvbridge.store import BlockKey, CacheServer, ServerConfig, StoreClient, TieredStore
from kvbridge.store.server import _namespace_table

BB = 4096
STALL_S = 5.0  # a request of an unrelated namespace answered in more than this is stalled


class _Gate:
    """The disk tier of namespace ``disk`` waits for ``release`` while it writes a block
    (the commit then holds that namespace's lock and its store's lock)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def store(self, block_bytes: int, **settings: Any) -> TieredStore:
        store = TieredStore(block_bytes, **settings)
        if settings.get("namespace") == b"disk":
            disk = store.tiers[-1]
            write = disk.store

            def waiting_write(key: BlockKey, src: Any) -> None:
                self.entered.set()
                assert self.release.wait(60), "the test never released the write"
                write(key, src)

            disk.store = waiting_write  # type: ignore[method-assign]
        return store


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Gate]:
    gate = _Gate()
    monkeypatch.setattr(_namespace_table, "TieredStore", gate.store)
    yield gate
    gate.release.set()


def _config(tmp_path: Path) -> ServerConfig:
    return ServerConfig(
        port=0, host_capacity=64 << 20, disk_path=str(tmp_path), disk_capacity=64 << 20
    )


def _in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    done: list[object] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:  # reported by the test
            done.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def _stuck_commit(gate: _Gate, slow: StoreClient) -> threading.Thread:
    ks = keys(30, 32)
    writer, _ = _in_thread(lambda: slow.put(ks, payloads(ks, BB)))
    assert gate.entered.wait(20), "the commit never wrote to the disk"
    return writer


def _served(client: StoreClient, what: str) -> None:
    """A match of ``client`` (another namespace) is answered within STALL_S."""
    ks = keys(0, 2)
    _, done = _in_thread(lambda: client.match_prefix(ks))
    until(lambda: bool(done), what, timeout=STALL_S)
    assert done == [0]


def test_quick_stats_during_a_slow_commit_stalls_every_namespace(
    gate: _Gate, tmp_path: Path
) -> None:
    """``stats`` is a quick op: answered on the control thread, which reads every store's
    stats under each store's lock (no try-lock now: the old code gave up when the state
    lock was busy). The disk commit holds its store's lock, so the control thread waits,
    and every client of every namespace with it."""
    with (
        CacheServer(_config(tmp_path)) as server,
        StoreClient(server.address, block_bytes=BB, namespace="fast", timeout=60) as fast,
        StoreClient(server.address, block_bytes=BB, namespace="disk", timeout=60) as slow,
        StoreClient(server.address, block_bytes=BB, namespace="watch", timeout=60) as watch,
    ):
        entered = threading.Event()
        stats = server._server_ops["stats"]

        def watched_stats(caller: Any, body: dict[str, Any]) -> dict[str, Any]:
            entered.set()
            return stats(caller, body)

        server._server_ops["stats"] = watched_stats
        writer = _stuck_commit(gate, slow)
        try:
            _served(fast, "fast served while the disk commit waits (control)")
            _in_thread(watch.server_stats)
            assert entered.wait(20), "the stats request never reached the server"
            _served(fast, "fast served while the disk commit waits and a client asks stats")
        finally:
            gate.release.set()
            writer.join(60)


def test_a_client_dialing_during_a_slow_commit_stalls_every_namespace(
    gate: _Gate, tmp_path: Path
) -> None:
    """Every dial makes a throwaway handshake session and says ``bye``
    (``TransferEngine.dial``): the server ends it on the control thread, and
    ``_end_session`` takes the lock of every namespace in turn (blocking), the busy one's
    too, though that session opened none. The control thread waits for the commit, and
    every client of every namespace with it: one client connecting anywhere is enough."""
    late: list[object] = []
    with (
        CacheServer(_config(tmp_path)) as server,
        StoreClient(server.address, block_bytes=BB, namespace="fast", timeout=60) as fast,
        StoreClient(server.address, block_bytes=BB, namespace="disk", timeout=60) as slow,
    ):
        entered = threading.Event()

        def watched_end(caller: Any) -> None:
            entered.set()
            server._end_session(caller)

        server.engine.set_session_end_handler(watched_end)
        writer = _stuck_commit(gate, slow)
        dialer = None
        try:
            _served(fast, "fast served while the disk commit waits (control)")
            dialer, late = _in_thread(
                lambda: StoreClient(server.address, block_bytes=BB, namespace="late", timeout=60)
            )
            assert entered.wait(20), "the dial's session end never reached the server"
            _served(fast, "fast served while the disk commit waits and a new client dials")
        finally:
            gate.release.set()
            writer.join(60)
            if dialer is not None:
                dialer.join(60)
            for client in late:
                if isinstance(client, StoreClient):
                    client.close()


def test_an_open_of_a_busy_namespace_stalls_no_open(gate: _Gate, tmp_path: Path) -> None:
    """An open of an existing namespace used to make the session an opener under that
    namespace's lock, inside the table's lock (``NamespaceTable._opened``): an open of the
    busy one held the table's lock until the commit ended, and an open of any other
    namespace (by sessions made before, so that no dial is involved) waited for it. Both
    complete while the commit waits."""
    with (
        CacheServer(_config(tmp_path)) as server,
        StoreClient(server.address, block_bytes=BB, namespace="fast", timeout=60) as fast,
        StoreClient(server.address, block_bytes=BB, namespace="other", timeout=60) as other,
        StoreClient(server.address, block_bytes=BB, namespace="disk", timeout=60) as slow,
    ):
        writer = _stuck_commit(gate, slow)
        try:
            _, busy = _in_thread(
                lambda: fast.peer.call({"op": "open", "namespace": b"disk", "block_bytes": BB})
            )
            until(lambda: bool(busy), "the open of the busy namespace", timeout=STALL_S)
            assert not isinstance(busy[0], BaseException), busy
            _, done = _in_thread(
                lambda: other.peer.call({"op": "open", "namespace": b"fresh", "block_bytes": BB})
            )
            until(lambda: bool(done), "an open of another namespace", timeout=STALL_S)
            assert not isinstance(done[0], BaseException), done
        finally:
            gate.release.set()
            writer.join(60)
