"""Tier building blocks: the host slab, the slot allocator, sizes."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from helpers import keys, payloads

from kvbridge.store import TieredStore, TierUnavailable, parse_size
from kvbridge.store._buffers import cupy_module
from kvbridge.store.local import LRU, HostSlab, SlotTier


def test_host_slab_is_page_aligned_and_views_are_zero_copy() -> None:
    slab = HostSlab(8, 3000, pin=False)
    assert slab.address % mmap.PAGESIZE == 0
    assert slab.array.nbytes == 8 * 3000
    view = slab.slot(3)
    view[:] = 7
    assert np.shares_memory(view, slab.array)
    assert (slab.array[3 * 3000 : 4 * 3000] == 7).all()
    assert not slab.pinned
    slab.close()
    slab.close()


def test_pinning_without_a_gpu_is_refused_only_when_required() -> None:
    if cupy_module() is not None:
        pytest.skip("this machine has a GPU")
    assert HostSlab(1, 64, pin="auto").pinned is False
    with pytest.raises(TierUnavailable, match="pinned host memory"):
        HostSlab(1, 64, pin=True)


def test_slot_tier_views_point_into_the_slab_and_slots_are_reused() -> None:
    tier = SlotTier("host", HostSlab(3, 64, pin=False), LRU())
    ks = keys(0, 4)
    data = payloads(ks, 64)
    for k, block in zip(ks[:3], data[:3], strict=True):
        tier.store(k, block)
    assert [tier.position(k) for k in ks[:3]] == [0, 1, 2]
    assert np.shares_memory(tier.view(ks[1]), tier.memory.slot(1))
    tier.delete(ks[1])
    tier.store(ks[3], data[3])
    assert tier.position(ks[3]) == 1  # the freed slot
    np.testing.assert_array_equal(tier.view(ks[3]), data[3])
    assert len(tier) == 3 and ks[1] not in tier


def test_store_exposes_zero_copy_slot_views() -> None:
    with TieredStore(64, host_capacity=4 * 64) as store:
        ks = keys(0, 2)
        store.put(ks, payloads(ks, 64))
        host = store.tiers[0]
        assert isinstance(host, SlotTier)
        np.testing.assert_array_equal(host.view(ks[1]), payloads(ks[1:], 64)[0])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("512 MB", 512_000_000),
        ("1.5GiB", 3 << 29),
        ("64k", 64_000),
        ("100", 100),
        (4096, 4096),
        ("0", 0),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1", -5, True, 1.5, None])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)  # type: ignore[arg-type]
