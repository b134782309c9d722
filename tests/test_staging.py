"""Staged puts (slots filled by someone else, then committed) and resident pins."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import FakeClock, keys, payload, payloads

from kvbridge.store import BlockKey, BlockNotFound, LeaseExpired, StoreFull, TieredStore
from kvbridge.store.local import RemoteAccess

BB = 4096


def _fill(store: TieredStore, slots: list[int | None], ks: Sequence[bytes]) -> None:
    top = store.tiers[0]
    for slot, k in zip(slots, ks, strict=True):
        if slot is not None:
            top.memory.slot(slot)[:] = payload(k, BB)  # type: ignore[attr-defined]


def test_a_staged_put_is_invisible_until_commit() -> None:
    with TieredStore(BB, host_capacity=8 * BB) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 3)
        lease, slots = remote.stage(ks)
        assert lease > 0 and all(s is not None for s in slots) and len(set(slots)) == 3
        assert store.contains(ks) == [False] * 3
        _fill(store, slots, ks)
        assert remote.commit(lease) == 3
        out = np.zeros((3, BB), np.uint8)
        store.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        with pytest.raises(LeaseExpired):
            remote.commit(lease)  # once only


def test_present_and_repeated_keys_get_no_slot() -> None:
    with TieredStore(BB, host_capacity=8 * BB) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 2)
        store.put(ks[:1], payloads(ks[:1], BB))
        lease, slots = remote.stage([ks[0], ks[1], ks[1]])
        assert slots[0] is None and slots[1] is not None and slots[2] is None
        assert store.stats().duplicates == 2
        remote.abort(lease)
        assert remote.stage(ks[:1]) == (0, [None])  # nothing to fill: no lease


def test_abort_and_expiry_give_the_slots_back() -> None:
    clock = FakeClock()
    with TieredStore(BB, host_capacity=2 * BB, clock=clock) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 4)
        lease, _ = remote.stage(ks[:2])
        with pytest.raises(StoreFull):
            remote.stage(ks[2:3])  # both slots are staged
        remote.abort(lease)
        short, _ = remote.stage(ks[:2], ttl=5.0)
        clock.advance(5.0)
        lease, slots = remote.stage(ks[2:4])  # the expired lease was swept
        assert sorted(s for s in slots if s is not None) == [0, 1]
        with pytest.raises(LeaseExpired):
            remote.commit(short)
        assert store.contains(ks[:2]) == [False, False]


def test_a_lease_that_expires_before_commit_stores_nothing() -> None:
    clock = FakeClock()
    with TieredStore(BB, host_capacity=2 * BB, clock=clock) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 2)
        lease, _ = remote.stage(ks, ttl=5.0)
        clock.advance(5.0)
        with pytest.raises(LeaseExpired):
            remote.commit(lease)
        assert store.contains(ks) == [False, False]
        assert remote.stage(ks)[0] > 0  # and its slots are free again


def test_staging_evicts_unpinned_blocks_and_refuses_when_all_are_pinned() -> None:
    with TieredStore(BB, host_capacity=2 * BB) as store:
        remote = RemoteAccess(store)
        old, new = keys(0, 2), keys(2, 4)
        store.put(old, payloads(old, BB))
        with store.pin(old[:1]):
            with pytest.raises(StoreFull, match="pinned"):
                remote.stage(new)  # one slot can be freed, two are needed
            assert store.contains(old) == [True, True]  # nothing changed
            lease, _ = remote.stage(new[:1])
        assert store.contains(old) == [True, False]
        remote.abort(lease)


def test_a_commit_racing_a_put_of_the_same_key_stores_it_once() -> None:
    with TieredStore(BB, host_capacity=4 * BB) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 1)
        lease, _ = remote.stage(ks)
        store.put(ks, payloads(ks, BB))
        assert remote.commit(lease) == 0
        assert len(store.tiers[0]) == 1
        assert remote.stage(keys(1, 4))[0] > 0  # the duplicate's slot was freed


def test_pin_resident_lifts_blocks_from_disk_into_memory(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=2 * BB, disk_path=tmp_path, disk_capacity=8 * BB) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 4)
        store.put(ks, payloads(ks, BB))  # two of them were demoted to disk
        assert len(store.tiers[0]) == 2
        lease, slots = remote.pin_resident(ks[:2])
        top = store.tiers[0]
        for k, slot in zip(ks[:2], slots, strict=True):
            np.testing.assert_array_equal(top.memory.slot(slot), payload(k, BB))  # type: ignore[attr-defined]
        with pytest.raises(StoreFull):
            remote.pin_resident(ks[2:])  # the two host slots are pinned
        lease.release()
        with pytest.raises(BlockNotFound):
            remote.pin_resident(keys(9, 10))


def test_staging_frees_a_batch_in_one_walk_past_pinned_blocks() -> None:
    """With `reuse`, pinned never-read blocks lead the candidates: a batch must not walk
    past them once per block (that made a server's handoff pins expire under load)."""
    with TieredStore(BB, host_capacity=64 * BB, policy="reuse") as store:
        remote = RemoteAccess(store)
        old, held, new = keys(0, 32), keys(32, 64), keys(64, 80)
        store.put(old, payloads(old, BB))
        store.get(old, np.zeros((32, BB), np.uint8))  # reused now
        store.put(held, payloads(held, BB))
        lease = store.pin(held)
        policy = store.tiers[0].policy
        walks = 0
        candidates = policy.candidates

        def counted() -> Iterator[BlockKey]:
            nonlocal walks
            walks += 1
            return candidates()

        policy.candidates = counted  # type: ignore[method-assign]
        lease_id, slots = remote.stage(new)
        assert walks == 1 and all(s is not None for s in slots)
        assert store.contains(held) == [True] * 32  # the pinned ones stayed
        assert sum(store.contains(old)) == 16  # the 16 victims were reused blocks
        remote.abort(lease_id)
        lease.release()
