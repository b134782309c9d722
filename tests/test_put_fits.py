"""A put larger than a namespace can hold is refused whole, by a cache server as by a local
store, and a put of several requests never keeps its tail while it drops its head (a chain
stored that way can never hit: ``match_prefix`` counts from the first block)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payloads

from kvbridge.store import (
    CacheServer,
    ServerConfig,
    StoreClient,
    StoreFull,
    TieredStore,
    TooManyRequests,
)
from kvbridge.store.local import RemoteAccess

BB = 4096
SLOTS = 16


@pytest.fixture(params=["reuse", "lru", "fifo"])
def client(request: pytest.FixtureRequest) -> Iterator[StoreClient]:
    config = ServerConfig(
        port=0,
        host_capacity=SLOTS * BB,
        max_namespaces=1,
        handoff_ttl=0,  # no holds on fresh blocks: nothing stops a put evicting itself
        policy=request.param,
    )
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=BB, namespace="m") as client,
    ):
        assert client.request_keys == SLOTS // 4
        yield client


@pytest.mark.parametrize("blocks", [SLOTS + 1, 4 * SLOTS])
def test_a_put_longer_than_the_namespace_is_refused_and_stores_nothing(
    client: StoreClient, blocks: int
) -> None:
    ks = keys(0, blocks)
    with pytest.raises(StoreFull, match="nothing was stored"):
        client.put(ks, payloads(ks, BB))
    assert client.contains(ks) == [False] * blocks
    assert client.stats().puts == 0
    local = TieredStore(BB, host_capacity=SLOTS * BB)
    with pytest.raises(StoreFull):  # the local store agrees
        local.put(ks, payloads(ks, BB))
    local.close()


def test_a_put_that_fits_whole_is_stored_whole(client: StoreClient) -> None:
    ks = keys(0, SLOTS)
    assert client.put(ks, payloads(ks, BB)) == [True] * SLOTS
    assert client.match_prefix(ks) == SLOTS
    out = np.zeros((SLOTS, BB), np.uint8)
    client.get(ks, out)
    assert (out == payloads(ks, BB)).all()


def test_only_new_blocks_count_against_the_room(client: StoreClient) -> None:
    held = keys(0, 8)
    client.put(held, payloads(held, BB))
    again = keys(0, 16)  # 8 held + 8 new: the whole namespace, in four requests
    assert client.put(again, payloads(again, BB)) == [False] * 8 + [True] * 8
    assert client.match_prefix(again) == 16


def test_a_put_whose_blocks_cannot_all_stay_is_refused_like_a_local_put(
    client: StoreClient,
) -> None:
    held = keys(0, 12)
    client.put(held, payloads(held, BB))
    again = keys(0, 20)  # 12 held + 8 new > 16 slots: the new ones would evict held ones
    with pytest.raises(StoreFull):
        client.put(again, payloads(again, BB))
    assert client.contains(again) == [True] * 12 + [False] * 8  # nothing changed
    local = TieredStore(BB, host_capacity=SLOTS * BB)
    local.put(held, payloads(held, BB))
    with pytest.raises(StoreFull):
        local.put(again, payloads(again, BB))
    assert local.contains(again) == [True] * 12 + [False] * 8
    local.close()


def test_pinned_blocks_shrink_the_room_for_a_long_put(client: StoreClient) -> None:
    pinned = keys(100, 108)
    client.put(pinned, payloads(pinned, BB))
    lease = client.pin(pinned[:4])
    try:
        ks = keys(0, SLOTS - 3)  # 13 new blocks; 12 slots are not pinned
        with pytest.raises(StoreFull):
            client.put(ks, payloads(ks, BB))
        assert client.contains(ks) == [False] * len(ks)
        assert client.contains(pinned) == [True] * 8  # nothing was evicted for it
    finally:
        lease.release()


def test_a_put_of_several_requests_evicts_none_of_its_own_blocks(client: StoreClient) -> None:
    others = keys(100, 100 + SLOTS)  # a full namespace of blocks read once already: the
    client.put(others, payloads(others, BB))  # reuse policy evicts new blocks before them
    client.get(others, np.zeros((SLOTS, BB), np.uint8))
    ks = keys(0, 12)  # three requests; each must make room by evicting the others
    assert client.put(ks, payloads(ks, BB)) == [True] * 12
    assert client.match_prefix(ks) == 12
    out = np.zeros((12, BB), np.uint8)
    client.get(ks, out)
    assert (out == payloads(ks, BB)).all()
    assert client.contains(others).count(True) == SLOTS - 12


def test_with_a_disk_tier_a_put_larger_than_memory_is_stored_whole(tmp_path: Path) -> None:
    config = ServerConfig(
        port=0,
        host_capacity=SLOTS * BB,
        disk_path=str(tmp_path / "disk"),
        disk_capacity=8 << 20,
        max_namespaces=1,
        handoff_ttl=0,
    )
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=BB, namespace="m") as client,
    ):
        ks = keys(0, 3 * SLOTS)  # three times the memory: the disk copies hold it
        assert client.put(ks, payloads(ks, BB)) == [True] * len(ks)
        assert client.match_prefix(ks) == len(ks)
        out = np.zeros((len(ks), BB), np.uint8)
        client.get(ks, out)
        assert (out == payloads(ks, BB)).all()
        too_many = keys(1000, 1000 + client.stats().tiers[1].capacity_blocks + 1)
        with pytest.raises(StoreFull):
            client.put(too_many, payloads(too_many, BB))
        assert not any(client.contains(too_many))


def test_a_pin_still_keeps_its_blocks_in_memory_beside_a_disk_copy(tmp_path: Path) -> None:
    """The put's rule (a block backed by a disk copy may leave memory) is not a pin's: a
    pin lifts its blocks into memory and none of them may make way for another (the soak
    found a KeyError in pin when it was)."""
    with TieredStore(
        BB,
        host_capacity=4 * BB,
        disk_path=tmp_path,
        disk_capacity=64 * BB,
        write_through=True,
        policy="fifo",
    ) as store:
        ks = keys(0, 8)
        store.put(ks, payloads(ks, BB))  # memory holds the last four, the disk all eight
        wanted = [ks[0], ks[5], ks[4]]  # one to lift, then two in memory: the oldest first
        lease, slots = RemoteAccess(store).pin_resident(wanted)
        assert len(set(slots)) == 3
        out = np.zeros((3, BB), np.uint8)
        store.get(wanted, out)
        assert (out == payloads(wanted, BB)).all()
        lease.release()


def test_a_put_that_fails_midway_leaves_no_record_behind(client: StoreClient) -> None:
    """A put of several requests refused after its ``room`` (here: the session's share)
    ends its record at once: retries are refused for the same reason, never because
    earlier attempts still keep blocks."""
    held = keys(100, 105)
    client.put(held, payloads(held, BB))
    leases = [client.pin(held[:4]), client.pin(held[4:])]  # 5 of the session's 8 slots:
    try:  # a 4-block request passes its half
        ks = keys(0, 10)
        for _ in range(4):  # four records of 10 keys would pass the 32 a tenant may keep
            with pytest.raises(TooManyRequests, match="share"):
                client.put(ks, payloads(ks, BB))
    finally:
        for lease in leases:
            lease.release()
    assert client.put(ks, payloads(ks, BB)) == [True] * 10


@pytest.mark.parametrize("seconds", [0.002, 0.005, 0.01, 0.02, 0.05])
def test_a_put_past_its_deadline_raises_timeout_and_reads_nothing_after(
    seconds: float,
) -> None:
    block = 1 << 20
    config = ServerConfig(port=0, host_capacity=64 * block, max_namespaces=1, handoff_ttl=0)
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=block, namespace="m") as client,
    ):
        ks = keys(0, 16)
        data = payloads(ks, block)
        try:
            with client.deadline(seconds):
                client.put(ks, data)
        except TimeoutError:
            pass  # not RegionBusy, nor anything else
        data[:] = 0  # the caller reuses its buffer at once
        stored = [k for k, present in zip(ks, client.contains(ks), strict=True) if present]
        if stored:  # what was committed is the bytes the put was given, never the zeros
            out = np.zeros((len(stored), block), np.uint8)
            client.get(stored, out)
            assert (out == payloads(stored, block)).all()
        again = keys(100, 101)
        assert client.put(again, payloads(again, block)) == [True]  # the client goes on


def test_a_single_request_put_keeps_its_stored_head(client: StoreClient) -> None:
    full = keys(100, 100 + SLOTS)
    for start in range(0, SLOTS, client.request_keys):
        part = full[start : start + client.request_keys]
        client.put(part, payloads(part, BB))
    chain = [full[0], *keys(0, client.request_keys - 1)]  # the oldest block, then new ones
    client.put(chain, payloads(chain, BB))
    assert client.match_prefix(chain) == len(chain)
