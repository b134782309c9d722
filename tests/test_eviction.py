"""Eviction scenarios: exact victims, demotion and promotion paths, pins and their expiry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import FakeClock, key, payloads

from kvbridge.store import Lease, StoreFull, TieredStore
from kvbridge.store.local import FIFO, LRU, DiskTier, HostSlab, SlotTier, Tier

BB = 128
K = [key(i) for i in range(20)]
a, b, c, d, e, f, g, h = K[:8]


NAMES = dict(zip(K, "abcdefghijklmnopqrst", strict=True))


def order(store: TieredStore) -> dict[str, str]:
    """Each tier's keys in eviction order, coldest first, pinned ones at their places, as
    letters ("abc")."""
    return {tier.name: "".join(NAMES[k] for k in tier.policy.ranking()) for tier in store.tiers}


def put(store: TieredStore, *ks: bytes) -> list[bool]:
    return store.put(list(ks), payloads(list(ks), BB))


def get(store: TieredStore, *ks: bytes) -> np.ndarray:
    out = np.zeros((len(ks), BB), np.uint8)
    store.get(list(ks), out)
    np.testing.assert_array_equal(out, payloads(list(ks), BB))
    return out


def test_lru_host_only_drops_least_recently_used() -> None:
    with TieredStore(BB, host_capacity=3 * BB) as s:
        put(s, a, b, c)
        get(s, a)
        put(s, b)  # a duplicate put is a use too
        assert order(s) == {"host": "cab"}
        put(s, d)
        assert order(s) == {"host": "abd"}
        put(s, e, f)
        assert order(s) == {"host": "def"}
        stats = s.stats()
        assert (stats.evictions, stats.demotions, stats.tiers[0].evictions) == (3, 0, 3)


def test_fifo_ignores_hits() -> None:
    with TieredStore(BB, host_capacity=3 * BB, policy="fifo") as s:
        put(s, a, b, c)
        get(s, a)
        put(s, d)
        assert order(s) == {"host": "bcd"}


def test_arc_moves_its_split_by_the_ghosts_of_each_list() -> None:
    """ARC: blocks used once (T1, first in the order while T1 is above its target ``p``),
    blocks used again (T2); a block back from T1's ghosts raises ``p``, one back from
    T2's ghosts lowers it, and both come back into T2."""
    with TieredStore(BB, host_capacity=4 * BB, policy="arc") as s:
        put(s, a, b, c, d)
        get(s, c, d)
        assert order(s) == {"host": "abcd"}  # T1 a b, then T2 c d (p = 0)
        put(s, e)  # a leaves T1: a ghost in B1
        assert order(s) == {"host": "becd"}
        put(s, a)  # b goes; a is back from B1: p = 1, and a joins T2
        assert order(s) == {"host": "cdae"}  # T1 (e) is at its target: T2 goes first
        put(s, f)  # c leaves T2: a ghost in B2
        assert order(s) == {"host": "edaf"}  # T1 (e f) is above p = 1 by one
        put(s, c)  # e goes; c is back from B2: p = 0
        assert order(s) == {"host": "fdac"}


def test_arc_remembers_no_more_ghosts_than_its_size_allows() -> None:
    """T1 and its ghosts together hold at most the tier's size: with the tier full of
    blocks used once, an evicted one is forgotten at once and comes back as new."""
    with TieredStore(BB, host_capacity=2 * BB, policy="arc") as s:
        put(s, a, b)
        put(s, c)  # a goes; T1 (b c) leaves B1 no room
        put(s, a)  # b goes; a is new again: T1 c a (back from B1 it would be in T2: "ac")
        assert order(s) == {"host": "ca"}
        get(s, c)
        put(s, d)  # a goes, and is remembered: T1 holds d alone
        put(s, a)  # d goes; a is back from B1: T2 c a (new, it would be in T1: "ac")
        assert order(s) == {"host": "ca"}


def test_demotion_to_disk_promotion_back_and_drop_from_disk(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=4 * BB) as s:
        put(s, a, b, c, d)
        get(s, a)
        put(s, e)  # host full: b is the LRU victim and moves to disk
        assert order(s) == {"host": "cdae", "disk": "b"}
        put(s, f, g)
        assert order(s) == {"host": "aefg", "disk": "bcd"}
        get(s, b)  # disk hit: promoted to host (a demoted), the disk copy stays
        assert order(s) == {"host": "efgb", "disk": "cdab"}
        put(s, h)  # e demoted; disk full: its LRU block c leaves the store
        assert order(s) == {"host": "fgbh", "disk": "dabe"}
        stats = s.stats()
        assert stats.promotions == 1
        assert stats.demotions == 5  # b, c, d, a, e
        assert stats.evictions == 1  # c
        assert s.contains([c]) == [False]
        get(s, d, a, e, f, g, b, h)  # everything else is still readable


def test_evicting_a_block_with_a_disk_copy_writes_nothing(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=2 * BB, disk_path=tmp_path, disk_capacity=4 * BB) as s:
        put(s, a, b)
        put(s, c)  # a -> disk
        get(s, a)  # promoted, disk keeps its copy; b -> disk
        assert order(s) == {"host": "ca", "disk": "ba"}
        put(s, d)  # c -> disk
        put(s, e)  # a leaves the host; its disk copy is reused, not rewritten
        assert order(s) == {"host": "de", "disk": "bac"}


def test_device_host_disk_cascade_with_a_host_memory_stand_in(tmp_path: Path) -> None:
    """The device tier's logic, run on CPU: the same SlotTier over host memory."""
    tiers: list[Tier] = [
        SlotTier("device", HostSlab(2, BB, pin=False), LRU()),
        SlotTier("host", HostSlab(2, BB, pin=False), LRU()),
        DiskTier(tmp_path, BB, 4, policy=LRU()),
    ]
    with TieredStore.from_tiers(tiers) as s:
        for k in (a, b, c, d, e):
            put(s, k)
        assert order(s) == {"device": "de", "host": "bc", "disk": "a"}
        get(s, a)  # disk -> device (disk keeps a, now its most recent); d -> host; b -> disk
        assert order(s) == {"device": "ea", "host": "cd", "disk": "ba"}
        get(s, c)  # host -> device moves it (memory tiers are exclusive); e swaps into its slot
        assert order(s) == {"device": "ac", "host": "de", "disk": "ba"}
        assert s.stats().promotions == 2


def test_no_promotion_when_disabled(tmp_path: Path) -> None:
    with TieredStore(
        BB, host_capacity=BB, disk_path=tmp_path, disk_capacity=4 * BB, promote=False
    ) as s:
        put(s, a)
        put(s, b)
        get(s, a)
        assert order(s) == {"host": "b", "disk": "a"}


def test_pinned_blocks_are_skipped_by_eviction() -> None:
    with TieredStore(BB, host_capacity=3 * BB) as s:
        put(s, a, b, c)
        lease = s.pin([a])
        put(s, d)
        assert order(s) == {"host": "acd"}  # b went, a stayed
        lease.release()
        put(s, e)
        assert order(s) == {"host": "cde"}


def test_pinned_block_is_neither_demoted_nor_promoted(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=2 * BB, disk_path=tmp_path, disk_capacity=4 * BB) as s:
        put(s, a, b)
        put(s, c)  # a on disk
        with s.pin([a]):
            get(s, a)  # pinned where it is
            assert order(s) == {"host": "bc", "disk": "a"}
        with s.pin([b, c]):
            put(s, d)  # host is all pinned: d goes straight to disk
            assert order(s) == {"host": "bc", "disk": "ad"}


def _expired(lease: Lease) -> bool:
    """``lease.expired`` through a call: mypy keeps the narrowing of ``assert not
    lease.expired`` across ``clock.advance`` and takes what follows a later ``assert
    lease.expired`` for unreachable."""
    return lease.expired


def test_pins_expire() -> None:
    clock = FakeClock()
    with TieredStore(BB, host_capacity=2 * BB, pin_ttl=5.0, clock=clock) as s:
        put(s, a, b)
        lease = s.pin([a, b])
        with pytest.raises(StoreFull):
            put(s, c)
        clock.advance(4.9)
        assert not _expired(lease)
        with pytest.raises(StoreFull):
            put(s, c)  # still pinned just before the deadline
        clock.advance(0.1)
        assert _expired(lease)
        put(s, c)  # the expired pins no longer hold the blocks
        assert order(s) == {"host": "bc"}
        lease.release()  # harmless after expiry


def test_unpin_releases_one_pin_per_key() -> None:
    with TieredStore(BB, host_capacity=2 * BB) as s:
        put(s, a, b)
        s.pin([a])
        s.pin([a], ttl=float("inf"))
        s.unpin([a, b])  # b was never pinned: ignored
        with pytest.raises(StoreFull):
            put(s, c, d)  # a still holds one pin
        s.unpin([a])
        put(s, c, d)
        assert order(s) == {"host": "cd"}


def test_a_batch_does_not_evict_its_own_blocks(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=2 * BB, disk_path=tmp_path, disk_capacity=2 * BB) as s:
        put(s, a)
        put(s, b, c, d, e)  # a is dropped; the head of the batch stays in the host tier
        assert order(s) == {"host": "bc", "disk": "de"}
        get(s, b, c, d, e)


def test_custom_policy_factory() -> None:
    with TieredStore(BB, host_capacity=2 * BB, policy=FIFO) as s:
        put(s, a, b)
        get(s, a)
        put(s, c)
        assert order(s) == {"host": "bc"}
