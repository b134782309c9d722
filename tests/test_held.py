"""Pinned blocks leave the eviction order while pinned and come back to their place."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import FakeClock, key, keys, payloads

from kvbridge.store import BlockKey, StoreFull, TieredStore
from kvbridge.store.local import POLICIES, HostSlab, RemoteAccess, SlotTier
from kvbridge.store.local._order import StampOrder

BB = 128


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_stamp_order_matches_a_sorted_model(seed: int) -> None:
    """Random stamps, removals, holds and releases: the walk is always the unheld keys in
    stamp order, and ``everything`` all of them."""
    rng = random.Random(seed)
    order = StampOrder()
    model: dict[BlockKey, list[Any]] = {}  # key -> [stamp, held]
    stamp = 0
    universe = [key(i) for i in range(40)]
    for _ in range(3000):
        k, op = rng.choice(universe), rng.random()
        if op < 0.4:
            stamp += 1
            order.stamp(k, stamp)
            model.setdefault(k, [0, False])[0] = stamp
        elif k not in model:
            continue
        elif op < 0.55:
            order.remove(k)
            del model[k]
        elif op < 0.8:
            order.hold(k)
            model[k][1] = True
        else:
            order.release(k)
            model[k][1] = False
        walk = [k for k, (_, held) in sorted(model.items(), key=lambda kv: kv[1][0]) if not held]
        assert [k for k, _ in order.walk()] == walk == list(order.keys())
        assert [k for k, _ in order.everything()] == sorted(model, key=lambda k: model[k][0])
        assert len(order) == len(model) and all(k in order for k in model)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_walks_its_keys_less_the_held_ones(name: str) -> None:
    """Random inserts, uses, removals, holds and releases: the ranking is every present
    key once, and the candidates are the ranking less the held keys."""
    rng = random.Random(name)
    policy = POLICIES[name]()
    present: set[BlockKey] = set()
    held: set[BlockKey] = set()
    universe = [key(i) for i in range(30)]
    for _ in range(1500):
        k, op = rng.choice(universe), rng.random()
        if k not in present:
            policy.insert(k)
            present.add(k)
        elif op < 0.4:
            policy.touch(k)
        elif op < 0.6:
            policy.remove(k)
            present.discard(k)
            held.discard(k)
        elif op < 0.8:
            policy.hold(k)
            held.add(k)
        else:
            policy.release(k)
            held.discard(k)
        ranking = list(policy.ranking())
        assert len(ranking) == len(present) and set(ranking) == present
        assert list(policy.candidates()) == [k for k in ranking if k not in held]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_released_key_is_back_at_its_place(name: str) -> None:
    policy = POLICIES[name]()
    ks = keys(0, 6)
    for k in ks:
        policy.insert(k)
    policy.touch(ks[1])
    before = list(policy.ranking())
    policy.hold(ks[2])
    policy.hold(ks[4])
    assert list(policy.candidates()) == [k for k in before if k not in (ks[2], ks[4])]
    assert list(policy.ranking()) == before
    policy.insert(key(99))
    policy.release(ks[2])
    policy.release(ks[4])
    policy.release(ks[4])  # a key not held: ignored
    walk = list(policy.candidates())
    assert walk == list(policy.ranking()) and [k for k in walk if k != key(99)] == before


@pytest.mark.parametrize("name", ["lru", "reuse", "arc"])
def test_a_key_used_while_held_comes_back_hot(name: str) -> None:
    """Held and used: it stays out of the walk, and comes back at the hot end (for
    ``reuse`` and ``arc``, a first use also moves it to the queue of reused keys, still
    held)."""
    policy = POLICIES[name]()
    a, b, c = keys(0, 3)
    for k in (a, b, c):
        policy.insert(k)
    policy.hold(a)
    policy.touch(a)
    assert list(policy.candidates()) == [b, c]
    policy.release(a)
    assert list(policy.candidates()) == [b, c, a]
    policy.remove(a)
    assert list(policy.ranking()) == [b, c]


def test_arc_ranks_a_held_key_where_its_list_has_it() -> None:
    """ARC walks its two lists by their sizes against its target, and a held key still
    counts in its list's size: with the used-once list over its target and its coldest key
    held, that list's next key goes first. The ranking is the walk with each held key just
    before the next key of its own list."""
    policy = POLICIES["arc"]()
    a, b, c, d, e, f = keys(0, 6)
    for k in (a, b, c, d):
        policy.insert(k)
    policy.touch(c)
    policy.touch(d)
    policy.remove(a)  # a ghost of the keys used once
    policy.insert(e)
    policy.remove(b)
    policy.insert(a)  # back from the ghosts: the used-once list's target grows to 1
    assert list(policy.ranking()) == [c, d, a, e] == list(policy.candidates())
    policy.insert(f)
    assert list(policy.candidates()) == [e, c, d, a, f]  # used once: e and f, one too many
    policy.hold(e)
    assert list(policy.candidates()) == [f, c, d, a]
    assert list(policy.ranking()) == [e, f, c, d, a]
    policy.release(e)
    assert list(policy.candidates()) == [e, c, d, a, f] == list(policy.ranking())


def _counting(store: TieredStore) -> list[int]:
    """Count the keys the store's walks read from the top tier's order."""
    order = store.tiers[0].policy
    walked = [0]
    candidates = order.candidates

    def counted() -> Iterator[BlockKey]:
        for k in candidates():
            walked[0] += 1
            yield k

    order.candidates = counted  # type: ignore[method-assign]
    return walked


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_making_room_reads_only_its_victims_however_many_are_pinned(name: str) -> None:
    with TieredStore(BB, host_capacity=1000 * BB, policy=name) as store:
        remote = RemoteAccess(store)
        old, new = keys(0, 1000), keys(1000, 1050)
        store.put(old, payloads(old, BB))
        lease = store.pin(old[:900])  # the coldest 900
        walked = _counting(store)
        store.put(new, payloads(new, BB))
        assert walked[0] == 50  # the 50 victims, none of the 900 pinned blocks
        assert store.contains(old[:900]) == [True] * 900
        assert sum(store.contains(old[900:])) == 50
        lease.release()
        lid, slots = remote.stage(keys(2000, 2010))
        assert walked[0] == 60 and None not in slots  # released: the coldest again
        assert store.contains(old[:10]) == [False] * 10
        remote.abort(lid)


def test_an_expired_pin_puts_its_block_back_in_the_walk() -> None:
    clock = FakeClock()
    with TieredStore(BB, host_capacity=3 * BB, pin_ttl=5.0, clock=clock) as store:
        a, b, c, d = keys(0, 4)
        store.put([a, b, c], payloads([a, b, c], BB))
        store.pin([a])
        store.put([d], payloads([d], BB))  # b goes
        assert store.contains([a, b]) == [True, False]
        clock.advance(5.0)
        store.put([key(9)], payloads([key(9)], BB))  # a is unpinned and still the coldest
        assert store.contains([a, c]) == [False, True]


def test_a_block_copied_up_while_pinned_is_pinned_in_its_new_tier(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=2 * BB, disk_path=tmp_path, disk_capacity=8 * BB) as s:
        remote = RemoteAccess(s)
        a, b, c = keys(0, 3)
        s.put([a, b, c], payloads([a, b, c], BB))  # a on disk only, b and c in host
        held = s.pin([a])
        lease, _ = remote.pin_resident([a])  # copied up next to its disk copy
        lease.release()  # the first lease still pins a, in both tiers
        with pytest.raises(StoreFull, match="1 pinned"):
            remote.stage(keys(10, 12))
        held.release()
        lid, slots = remote.stage(keys(10, 12))
        assert None not in slots
        remote.abort(lid)
        out = np.zeros((1, BB), np.uint8)
        s.get([a], out)
        np.testing.assert_array_equal(out, payloads([a], BB))


class _OldPolicy:
    """A policy written for the four methods of before: no hold, release or ranking."""

    def insert(self, key: BlockKey) -> None: ...
    def touch(self, key: BlockKey) -> None: ...
    def remove(self, key: BlockKey) -> None: ...
    def candidates(self) -> Iterator[BlockKey]:
        return iter(())


def test_a_policy_without_hold_is_refused() -> None:
    with pytest.raises(TypeError, match="lacks hold, release, ranking"):
        TieredStore(BB, host_capacity=2 * BB, policy=_OldPolicy)  # type: ignore[arg-type]


def test_from_tiers_refuses_a_policy_without_hold(tmp_path: Path) -> None:
    tier = SlotTier("host", HostSlab(2, BB), _OldPolicy())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lacks hold, release, ranking"):
        TieredStore.from_tiers([tier])
    tier.close()


def test_unpin_ends_a_lease_whose_last_key_it_released() -> None:
    """``unpin`` of every key of an endless pin leaves nothing behind (10,000 cycles)."""
    with TieredStore(BB, host_capacity=2 * BB) as store:
        a = key(0)
        store.put([a], payloads([a], BB))
        for _ in range(10_000):
            store.pin([a], ttl=float("inf"))
            store.unpin([a])
        assert store.remove([a]) == [True]  # not pinned
        assert store.placement.pins.open_leases == 0


def test_a_key_named_twice_in_one_pin_is_held_once() -> None:
    with TieredStore(BB, host_capacity=2 * BB) as store:
        a, b, c = keys(0, 3)
        store.put([a, b], payloads([a, b], BB))
        lease = store.pin([a, a])
        assert store.tiers[0].policy.held == {a}  # type: ignore[attr-defined]
        lease.release()
        store.put([c], payloads([c], BB))  # a is the coldest and no longer held
        assert store.contains([a, b, c]) == [False, True, True]
