"""One slow request does not hold up another session's: control calls run side by side (each
session's in order), and a pin's disk reads happen outside the server's locks. A prefetched
copy is used only while it is still the block committed under its key."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from helpers import keys, payloads, until

from kvbridge.store import CacheServer, ServerConfig, StoreClient, TieredStore
from kvbridge.store.local import RemoteAccess
from kvbridge.store.local.disk import _reads as _disk_reads
from kvbridge.store.local.disk._tier import DiskTier
from kvbridge.transfer import Caller, TransferEngine
from kvbridge.transfer._calls import MAX_QUEUED_CALLS, CallPool, CallsFull

BB = 64 << 10


class _SlowDisk:
    """Makes every prefetch read wait until the test lets it go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        real = DiskTier.copies

        def copies(tier: DiskTier, ks: Any) -> Any:
            self.entered.set()
            assert self.go.wait(30)
            return real(tier, ks)

        monkeypatch.setattr(DiskTier, "copies", copies)


def _in_thread(work: Any) -> tuple[threading.Thread, list[Any]]:
    done: list[Any] = []
    thread = threading.Thread(target=lambda: done.append(work()), daemon=True)
    thread.start()
    return thread, done


def test_a_client_reading_from_disk_does_not_hold_up_one_reading_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ServerConfig(
        port=0,
        host_capacity=16 * BB,
        disk_path=str(tmp_path),
        disk_capacity=64 * BB,
        max_namespaces=1,
        handoff_ttl=0.0,
    )
    cold, hot = keys(0, 32), keys(100, 102)
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=BB, namespace="m") as slow,
        StoreClient(server.address, block_bytes=BB, namespace="m") as fast,
    ):
        slow.put(cold, payloads(cold, BB))  # the first half leaves memory for the disk
        fast.put(hot, payloads(hot, BB))
        disk = _SlowDisk(monkeypatch)
        out = np.zeros((4, BB), np.uint8)
        reader, _ = _in_thread(lambda: slow.get(cold[:4], out))
        assert disk.entered.wait(10)  # the slow client is reading the disk now
        got = np.zeros((2, BB), np.uint8)
        for _ in range(20):  # memory reads, contains and puts all answered meanwhile
            fast.get(hot, got)
            assert fast.contains(hot + cold[:1]) == [True, True, True]
        fresh = keys(200, 202)
        fast.put(fresh, payloads(fresh, BB))
        assert (got == payloads(hot, BB)).all()
        assert reader.is_alive()  # still waiting on its disk
        disk.go.set()
        reader.join(30)
        assert not reader.is_alive()
        assert (out == payloads(cold[:4], BB)).all()


def _disk_store(tmp_path: Path) -> TieredStore:
    return TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=32 * BB)


def _evict(store: TieredStore, start: int) -> None:
    """Fill the host tier with other blocks, so that earlier ones are on disk only."""
    filler = keys(start, start + 4)
    store.put(filler, payloads(filler, BB))


def test_a_prefetched_copy_stands_in_for_the_locked_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _disk_store(tmp_path) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 3)
        store.put(ks, payloads(ks, BB))
        _evict(store, 1000)
        early = remote.prefetch(ks + keys(1000, 1001))  # a block in memory is not read
        assert len(early) == 3

        def no_disk(tier: DiskTier) -> Any:
            raise AssertionError("the disk was read under the lock")

        monkeypatch.setattr(DiskTier, "reading", no_disk)
        lease, _ = remote.pin_resident(ks, early=early)
        lease.release()
        monkeypatch.undo()
        out = np.zeros((3, BB), np.uint8)
        store.get(ks, out)
        assert (out == payloads(ks, BB)).all()


def test_a_prefetched_copy_of_a_rewritten_block_is_never_served(tmp_path: Path) -> None:
    with _disk_store(tmp_path) as store:
        remote = RemoteAccess(store)
        k = keys(0, 1)
        store.put(k, payloads(k, BB))
        _evict(store, 1000)
        early = remote.prefetch(k)
        assert len(early) == 1
        store.remove(k)  # the key is given other bytes between the prefetch and the pin
        other = payloads(keys(7, 8), BB)
        store.put(k, other)
        _evict(store, 2000)
        lease, _ = remote.pin_resident(k, early=early)
        lease.release()
        out = np.zeros((1, BB), np.uint8)
        store.get(k, out)
        assert (out == other).all()


def test_a_prefetch_of_a_closed_store_or_bad_keys_changes_nothing(tmp_path: Path) -> None:
    store = _disk_store(tmp_path)
    ks = keys(0, 2)
    store.put(ks, payloads(ks, BB))
    _evict(store, 1000)
    before = store.stats()
    assert (
        len(RemoteAccess(store).prefetch(ks + keys(50, 51))) == 2
    )  # an absent key is just not read
    assert store.stats() == before
    store.close()
    with pytest.raises(Exception, match="closed"):
        RemoteAccess(store).prefetch(ks)


@pytest.fixture
def engines() -> Iterator[tuple[TransferEngine, TransferEngine, TransferEngine]]:
    with (
        TransferEngine("server") as server,
        TransferEngine("one") as one,
        TransferEngine("two") as two,
    ):
        yield server, one, two


def test_calls_of_different_sessions_run_side_by_side_and_each_in_order(
    engines: tuple[TransferEngine, TransferEngine, TransferEngine],
) -> None:
    server, one, two = engines
    release = threading.Event()
    seen: dict[int, list[int]] = {}

    def handler(caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("block"):
            assert release.wait(30)
        seen.setdefault(caller.session, []).append(body["n"])
        return {"n": body["n"]}

    server.set_request_handler(handler)
    first = one.connect(server.metadata())
    second = two.connect(server.metadata())
    blocked, answers = _in_thread(lambda: first.call({"block": True, "n": 0}))
    for n in range(1, 51):  # the other session's calls are answered meanwhile, in order
        assert second.call({"n": n}) == {"n": n}
    assert blocked.is_alive()
    release.set()
    blocked.join(30)
    assert answers == [{"n": 0}]
    for n in range(1, 6):  # casts, then a call: answered in the order they were sent
        first.cast({"n": n})
    assert first.call({"n": 6}) == {"n": 6}
    assert sorted(seen.values()) == [list(range(7)), list(range(1, 51))]


def test_a_session_flooding_calls_is_refused_past_its_queue() -> None:
    context = zmq.Context()
    answers = context.socket(zmq.PULL)
    answers.bind("inproc://test-answers")
    pool = CallPool(context, "inproc://test-answers")
    release = threading.Event()
    try:
        pool.submit(b"s", lambda: [b"x"] if release.wait(30) else [])
        for _ in range(MAX_QUEUED_CALLS):
            pool.submit(b"s", lambda: [b"y"])
        with pytest.raises(CallsFull):
            pool.submit(b"s", lambda: [b"z"])
        pool.submit(b"other", lambda: [b"o"])  # another session is not refused, nor held
        assert answers.poll(10_000) and answers.recv_multipart() == [b"o"]
        release.set()
        got = [answers.recv_multipart() for _ in range(MAX_QUEUED_CALLS + 1)]
        assert got == [[b"x"]] + [[b"y"]] * MAX_QUEUED_CALLS
        pool.submit(b"s", lambda: [b"again"])  # the queue drained: taken again
        assert answers.recv_multipart() == [b"again"]
    finally:
        release.set()
        pool.close()
        answers.close()
        context.term()


@pytest.mark.slow
def test_prefetches_beside_writes_that_grow_the_map_and_a_close(tmp_path: Path) -> None:
    """Prefetch reads run outside the store's lock while other threads write (the map grows
    under them: LMDB forbids that beside an open read) and finally close the store: no
    crash, no wrong byte, every prefetch either read or gave nothing. Each read is slowed
    down, so that map growth comes while reads are open. In a child process: without the
    read gate it crashed (a read of an unmapped page) in 3 of 5 runs, which must fail the
    test, not kill the test run."""
    child = multiprocessing.get_context("fork").Process(target=_grow_and_close, args=(tmp_path,))
    child.start()
    child.join(120)
    assert child.exitcode == 0


def _grow_and_close(path: Path) -> None:
    real = _disk_reads._verified

    def slow(*args: Any) -> Any:
        found = real(*args)
        time.sleep(0.002)  # a view into the map is held across this
        return found

    _disk_reads._verified = slow  # type: ignore[assignment]  # this process only
    store = TieredStore(BB, host_capacity=32 * BB, disk_path=path, disk_capacity=4096 * BB)
    remote = RemoteAccess(store)
    cold = keys(0, 8)
    store.put(cold, payloads(cold, BB))
    filler = keys(1000, 1032)
    store.put(filler, payloads(filler, BB))
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = [0]

    def prefetcher() -> None:
        try:
            while not stop.is_set():
                early = remote.prefetch(cold)
                reads[0] += len(early)
                lease, _ = remote.pin_resident(cold, early=early)
                out = np.zeros((len(cold), BB), np.uint8)
                store.get(cold, out)
                lease.release()
                assert (out == payloads(cold, BB)).all()
                store.get(filler, np.zeros((len(filler), BB), np.uint8))  # cold goes back down
        except Exception as exc:
            if "closed" not in str(exc):
                errors.append(exc)

    threads = [threading.Thread(target=prefetcher) for _ in range(2)]
    for thread in threads:
        thread.start()
    for start in range(2000, 2000 + 64 * 40, 64):  # 160 MiB written: the map grows
        batch = keys(start, start + 64)
        store.put(batch, payloads(batch, BB))
    store.close()
    stop.set()
    for thread in threads:
        thread.join(30)
    os._exit(0 if not errors and reads[0] > 0 else 1)


def test_quick_calls_answer_on_the_control_thread_but_never_overtake_their_session(
    engines: tuple[TransferEngine, TransferEngine, TransferEngine],
) -> None:
    server, one, two = engines
    blocked, release = threading.Event(), threading.Event()
    order: list[tuple[str, int]] = []

    def handler(caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("block"):
            blocked.set()
            assert release.wait(30)
        order.append(("pool", body["n"]))
        return {"n": body["n"], "by": "pool"}

    def quick(caller: Caller, body: dict[str, Any]) -> dict[str, Any] | None:
        if body.get("block"):
            return None  # may wait: leave it to the pool
        order.append(("quick", body["n"]))
        return {"n": body["n"], "by": "quick"}

    server.set_request_handler(handler, quick=quick)
    first = one.connect(server.metadata())
    second = two.connect(server.metadata())
    assert second.call({"n": 1}) == {"n": 1, "by": "quick"}
    first.cast({"block": True, "n": 2})  # to the pool, where it waits
    assert blocked.wait(30)
    behind, answers = _in_thread(lambda: first.call({"n": 3}))  # quick, but behind the cast
    until(lambda: server.stats()["calls_queued"] == 2, "the call queued behind the cast")
    assert second.call({"n": 4}) == {"n": 4, "by": "quick"}  # another session: at once
    assert behind.is_alive() and answers == []
    release.set()
    behind.join(30)
    assert answers == [{"n": 3, "by": "pool"}]  # its session was busy: it went to the pool
    assert [n for _, n in order] == [1, 4, 2, 3]
