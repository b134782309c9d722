"""End-to-end block checksums (``store/_checksums.py``): bytes damaged on purpose, each time
at another place, never reach a reader as a hit.

- the server's slab after the commit (a stray write into a real server's memory);
- the server's staged slot, after the write landed and before the commit;
- the reader's receive buffer, after the transport delivered the bytes (a test seam,
  ``kvbridge.transfer.testing``);
- the disk tier's file (a real server's LMDB, between two runs), and a memory copy gone bad
  while the disk holds a sound one.

The reader gets a miss from the damaged block on (``BlockCorrupt``, a ``BlockNotFound``),
the blocks before it whole; the bad copy is gone from the store and counted; a sound copy
stays. A reader cannot make the server drop a sound block, and bad checksums in a commit are
refused without changing anything."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attack import raw
from corruption import flip_stored_bit, overwrite_in_files, overwrite_in_memory
from helpers import keys, payloads, until
from serve import BLOCK, TRANSPORTS, ServeProcess, namespaces, small_config

from kvbridge.store import (
    BadRequest,
    BlockCorrupt,
    BlockNotFound,
    CacheServer,
    ServerConfig,
    StoreClient,
)
from kvbridge.transfer import MAX_CONTROL_BYTES
from kvbridge.transfer.testing import corrupt_received

COUNT = 8
BAD = 3
GARBAGE = bytes(range(256)) * 16  # 4 KiB no payload of the tests holds


def _client(address: str, transport: str = "tcp", *, verify: bool = True) -> StoreClient:
    return StoreClient(
        address, block_bytes=BLOCK, namespace="m", transports=transport, verify=verify
    )


def _stored(server_stats: dict[str, Any]) -> dict[str, Any]:
    """The one namespace's figures in a ``stats`` reply."""
    (figures,) = server_stats["namespaces"]
    return dict(figures)


def _read_all(client: StoreClient, ks: Sequence[bytes]) -> tuple[np.ndarray, BlockCorrupt]:
    out = np.zeros((len(ks), BLOCK), dtype=np.uint8)
    with pytest.raises(BlockCorrupt) as raised:
        client.get(ks, out)
    return out, raised.value


def _a_miss_from_the_bad_block_on(client: StoreClient, ks: Sequence[bytes]) -> None:
    """What every place of damage must come to for the reader."""
    out, corrupt = _read_all(client, ks)
    assert corrupt.first == BAD and list(corrupt.keys) == list(ks[BAD:])
    assert np.array_equal(out[:BAD], payloads(ks[:BAD], BLOCK))  # those before: whole
    assert client.counters["blocks_corrupt"] == 1


def _dropped(client: StoreClient, key: bytes) -> None:
    """Until the server no longer holds ``key``: it drops a bad copy at once, or, where the
    read that found it has not ended on its side yet, when its pin ends."""
    until(lambda: client.contains([key]) == [False], "the bad block dropped")


def test_a_stray_write_into_a_servers_slab_is_a_miss_from_that_block_on() -> None:
    server = ServeProcess("--host-capacity", str(4 * COUNT * BLOCK))
    try:
        with _client(server.address) as client:
            ks = keys(0, COUNT)
            client.put(ks, payloads(ks, BLOCK))
            needle = payloads(ks[BAD : BAD + 1], BLOCK)[0, :64].tobytes()
            assert overwrite_in_memory(server.proc.pid, needle, GARBAGE) == 1
            _a_miss_from_the_bad_block_on(client, ks)
            _dropped(client, ks[BAD])
            assert client.contains(ks) == [i != BAD for i in range(COUNT)]
            assert _stored(client.server_stats())["corrupt"] == 1
            out = np.zeros((COUNT - 1, BLOCK), dtype=np.uint8)
            others = [k for i, k in enumerate(ks) if i != BAD]
            client.get(others, out)  # the rest are sound
            assert np.array_equal(out, payloads(others, BLOCK))
    finally:
        server.kill()


@pytest.fixture(params=TRANSPORTS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[CacheServer, str]]:
    with CacheServer(small_config(request.param)) as server:
        yield server, request.param


def _flip_once() -> tuple[list[int], object]:
    """A change that flips the first byte of the first frame it sees, and its count."""
    seen: list[int] = []

    def change(views: Sequence[memoryview]) -> None:
        if not seen and views and views[0].nbytes:
            views[0][0] ^= 0xFF
        seen.append(len(views))

    return seen, change


def test_a_damaged_slot_is_a_miss_over_every_transport(served: tuple[CacheServer, str]) -> None:
    server, transport = served
    with _client(server.address, transport) as client:
        ks = keys(0, COUNT)
        client.put(ks, payloads(ks, BLOCK))
        (ns,) = namespaces(server)
        flip_stored_bit(ns, ks[BAD], 100)  # one bit, in place
        _a_miss_from_the_bad_block_on(client, ks)
        _dropped(client, ks[BAD])
        assert ns.store.stats().corrupt == 1


def test_bytes_damaged_on_their_way_to_a_reader_are_a_miss_and_the_stored_copy_stays() -> None:
    with CacheServer(small_config()) as server, _client(server.address) as client:
        ks = keys(0, COUNT)
        client.put(ks, payloads(ks, BLOCK))
        seen, change = _flip_once()
        with corrupt_received(change):  # type: ignore[arg-type]
            out, corrupt = _read_all(client, ks[BAD:])
        assert seen and corrupt.first == 0
        assert client.contains(ks) == [True] * COUNT  # the server's copy is sound: kept
        (ns,) = namespaces(server)
        assert ns.store.stats().corrupt == 0
        client.get(ks, out := np.zeros((COUNT, BLOCK), dtype=np.uint8))
        assert np.array_equal(out, payloads(ks, BLOCK))


def test_bytes_damaged_in_a_staged_slot_before_the_commit_never_reach_a_reader() -> None:
    with CacheServer(small_config()) as server, _client(server.address) as client:
        ks = keys(0, COUNT)
        client.put(ks[:BAD], payloads(ks[:BAD], BLOCK))
        seen, change = _flip_once()
        with corrupt_received(change):  # type: ignore[arg-type]
            client.put(ks[BAD:], payloads(ks[BAD:], BLOCK))  # lands bad, committed
        assert seen
        _a_miss_from_the_bad_block_on(client, ks)
        _dropped(client, ks[BAD])


def test_a_reader_cannot_make_the_server_drop_a_sound_block() -> None:
    with CacheServer(small_config()) as server, _client(server.address) as client:
        ks = keys(0, COUNT)
        client.put(ks, payloads(ks, BLOCK))
        asked = ks[:2]  # a request's worth of the small server's
        assert raw(client).op("verify", keys=asked) == {"dropped": [False, False]}
        assert client.contains(ks) == [True] * COUNT
        with pytest.raises(BadRequest):
            raw(client).op("verify", keys="not keys")
        (ns,) = namespaces(server)
        assert ns.store.stats().corrupt == 0


@pytest.mark.parametrize("sums", [[1], [0, -1], [0, 1.5], ["x", "y"], "nope", [True, False]])
def test_a_commit_with_checksums_that_make_no_sense_is_refused_and_changes_nothing(
    sums: object,
) -> None:
    with CacheServer(small_config()) as server, _client(server.address) as client:
        ks = keys(0, 2)
        attacker = raw(client)
        staged = attacker.op("stage", keys=ks)
        with pytest.raises(BadRequest):
            attacker.op("commit", lease=staged["lease"], sums=sums)
        assert client.contains(ks) == [False, False]
        assert attacker.op("commit", lease=staged["lease"], sums=[0, 0])["stored"] == 2


def test_with_verify_off_a_reader_takes_what_landed() -> None:
    """The reader's check is what turns damage into a miss (``verify: false`` skips it)."""
    with CacheServer(small_config()) as server, _client(server.address, verify=False) as client:
        ks = keys(0, COUNT)
        client.put(ks, payloads(ks, BLOCK))
        (ns,) = namespaces(server)
        flip_stored_bit(ns, ks[BAD], 100)
        out = np.zeros((COUNT, BLOCK), dtype=np.uint8)
        client.get(ks, out)
        assert not np.array_equal(out[BAD], payloads(ks[BAD : BAD + 1], BLOCK)[0])


def test_a_damaged_disk_block_is_a_miss_and_is_dropped(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    flags = ["--host-capacity", str(4 * COUNT * BLOCK), "--max-namespaces", "1"]
    flags += ["--disk-path", str(disk), "--disk-capacity", "64MiB"]
    server = ServeProcess(*flags)
    ks = keys(0, COUNT)
    try:
        with _client(server.address) as client:
            client.put(ks, payloads(ks, BLOCK))
        server.stop(signal.SIGTERM)  # a clean stop writes what memory holds to the disk
        needle = payloads(ks[BAD : BAD + 1], BLOCK)[0, :64].tobytes()
        assert overwrite_in_files(disk, needle, GARBAGE) == 1
        server = ServeProcess(*flags)
        with _client(server.address) as client:
            with pytest.raises(BlockNotFound) as missing:
                client.get(ks, np.zeros((COUNT, BLOCK), dtype=np.uint8))
            assert list(missing.value.keys) == [ks[BAD]]
            assert client.match_prefix(ks) == BAD
            assert client.contains(ks) == [i != BAD for i in range(COUNT)]
            assert _stored(client.server_stats())["corrupt"] == 1
    finally:
        server.kill()


def test_a_memory_copy_gone_bad_is_dropped_and_the_disk_copy_serves(tmp_path: Path) -> None:
    """A server writes each block through to its disk at the commit (checked against the
    writer's checksum there): a memory copy that goes bad later is dropped on the reader's
    report, and the next read gets the sound disk copy. Nothing committed is lost."""
    config = ServerConfig(
        port=0,
        host_capacity=4 * COUNT * BLOCK,
        disk_path=str(tmp_path / "disk"),
        disk_capacity=64 << 20,
        max_namespaces=1,
        handoff_ttl=0,
    )
    with CacheServer(config) as server, _client(server.address) as client:
        ks = keys(0, COUNT)
        client.put(ks, payloads(ks, BLOCK))
        (ns,) = namespaces(server)
        flip_stored_bit(ns, ks[BAD], 7)
        _a_miss_from_the_bad_block_on(client, ks)
        until(
            lambda: ns.store.where(ks[BAD : BAD + 1]) == ["disk"],
            "the bad memory copy dropped (once the read that found it ended on the server)",
        )
        out = np.zeros((COUNT, BLOCK), dtype=np.uint8)
        client.get(ks, out)
        assert np.array_equal(out, payloads(ks, BLOCK))
        assert ns.store.stats().corrupt == 1


def test_a_put_with_more_checksums_than_a_notification_holds_commits_them_by_call() -> None:
    """A request of 8,192 blocks (a namespace of 32,768 small slots): its commit, 9 bytes a
    checksum, outgrows a write's 64 KiB notification and follows the write as a call. Its
    blocks are stored with their checksums: a bad one is found."""
    small, slots = 4096, 32768
    config = ServerConfig(port=0, host_capacity=slots * small, max_namespaces=1, handoff_ttl=0)
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=small, namespace="m") as client,
    ):
        count = client.request_keys
        assert count * 9 > MAX_CONTROL_BYTES
        ks = keys(0, count)
        client.put(ks, data := payloads(ks, small))
        client.get(ks, out := np.zeros_like(data))
        assert np.array_equal(out, data)
        (ns,) = namespaces(server)
        flip_stored_bit(ns, ks[count - 2], 7)
        with pytest.raises(BlockCorrupt) as raised:
            client.get(ks, out)
        assert raised.value.first == count - 2
