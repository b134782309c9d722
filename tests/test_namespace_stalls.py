"""Adversarial checks of issue 35's claim that no namespace waits for another's (each
failed on the first per-namespace locks, ``9f85efd``).

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
from gated_stores import GatedStores, gated_stores
from helpers import keys, payloads, until

from kvbridge.store import CacheServer, ServerConfig, StoreClient, StoreStats, TieredStore

BB = 4096
STALL_S = 5.0  # a request of an unrelated namespace answered in more than this is stalled


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedStores]:
    yield from gated_stores(monkeypatch)


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


def _stuck_commit(gate: GatedStores, slow: StoreClient) -> threading.Thread:
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


def test_another_namespace_is_served_while_a_client_asks_stats(
    gate: GatedStores, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stats`` reads every store's figures under each store's lock. It used to be a
    quick op, answered on the control thread: behind the disk commit's store lock the
    control thread waited, and every client of every namespace with it."""
    with (
        CacheServer(_config(tmp_path)) as server,
        StoreClient(server.address, block_bytes=BB, namespace="fast", timeout=60) as fast,
        StoreClient(server.address, block_bytes=BB, namespace="disk", timeout=60) as slow,
        StoreClient(server.address, block_bytes=BB, namespace="watch", timeout=60) as watch,
    ):
        entered = threading.Event()
        stats = TieredStore.stats

        def watched_stats(store: TieredStore) -> StoreStats:
            entered.set()  # the server reads the stores' figures for a stats request
            return stats(store)

        monkeypatch.setattr(TieredStore, "stats", watched_stats)
        writer = _stuck_commit(gate, slow)
        try:
            _served(fast, "fast served while the disk commit waits (control)")
            _in_thread(watch.server_stats)
            assert entered.wait(20), "the stats request never reached the server"
            _served(fast, "fast served while the disk commit waits and a client asks stats")
        finally:
            gate.release.set()
            writer.join(60)


def test_another_namespace_is_served_while_a_new_client_dials(
    gate: GatedStores, tmp_path: Path
) -> None:
    """Every dial makes a throwaway handshake session and says ``bye``
    (``TransferEngine.dial``): the server ends it on the control thread. Its end used to
    take the lock of every namespace in turn, the busy one's too, though that session
    opened none: the control thread waited for the commit, and every client of every
    namespace with it. Now it takes only the locks of the namespaces it opened."""
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


def test_opens_complete_while_a_namespace_is_busy(gate: GatedStores, tmp_path: Path) -> None:
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
