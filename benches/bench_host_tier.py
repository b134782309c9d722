"""Host tier put/get against numpy.copyto of the same bytes (batches of 256 blocks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbridge.store import TieredStore, prefix_hashes

BATCH = 256


@pytest.mark.parametrize("block_bytes", [64 << 10, 1 << 20], ids=["64KiB", "1MiB"])
@pytest.mark.parametrize("op", ["put", "get"])
def test_host_tier(compare: Callable[..., Any], block_bytes: int, op: str) -> None:
    nbytes = BATCH * block_bytes
    keys = prefix_hashes(range(BATCH * 16), 16)
    src = np.random.default_rng(0).integers(0, 256, (BATCH, block_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    with TieredStore(block_bytes, host_capacity=BATCH * block_bytes) as store:
        if op == "put":
            compare(
                f"host put {block_bytes >> 10} KiB x {BATCH}",
                lambda: store.put(keys, src),
                lambda: np.copyto(dst, src),
                setup=lambda: store.remove(keys),
                baseline_name="numpy.copyto",
                nbytes=nbytes,
            )
        else:
            store.put(keys, src)
            compare(
                f"host get {block_bytes >> 10} KiB x {BATCH}",
                lambda: store.get(keys, dst),
                lambda: np.copyto(dst, src),
                baseline_name="numpy.copyto",
                nbytes=nbytes,
            )
            np.testing.assert_array_equal(dst, src)


@pytest.mark.parametrize("pinned", [0.0, 0.9], ids=["none-pinned", "90pct-pinned"])
def test_host_put_evicting(compare: Callable[..., Any], pinned: float) -> None:
    """A full tier whose coldest blocks are pinned: every put evicts a batch. Pinned blocks
    are out of the eviction order, so the share pinned should not change the time."""
    block_bytes, capacity = 4 << 10, 32768
    src = np.random.default_rng(0).integers(0, 256, (BATCH, block_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    tokens = (capacity + 128 * BATCH) * 16
    fresh = prefix_hashes(range(capacity * 16, tokens), 16)  # 128 batches of new keys
    batches = iter(range(0, len(fresh), BATCH))
    with TieredStore(block_bytes, host_capacity=capacity * block_bytes) as store:
        filled = prefix_hashes(range(capacity * 16), 16)
        for start in range(0, capacity, BATCH):
            store.put(filled[start : start + BATCH], src)
        lease = store.pin(filled[: int(capacity * pinned)], ttl=float("inf"))
        compare(
            f"host put 4 KiB x {BATCH}, evicting, {pinned:.0%} of {capacity} pinned",
            lambda: store.put(fresh[(at := next(batches)) : at + BATCH], src),
            lambda: np.copyto(dst, src),
            baseline_name="numpy.copyto",
            nbytes=BATCH * block_bytes,
        )
        lease.release()
