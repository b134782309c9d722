"""Disk tier write and read against raw os.pwrite / os.pread of the same bytes.

Both sides skip fsync (the tier's default, sync=False) and read from a warm page cache, so
the ratio is what LMDB, checksums and the store's bookkeeping cost on top of the syscalls.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.store import TieredStore, prefix_hashes

BATCH = 64


@pytest.mark.parametrize("block_bytes", [64 << 10, 1 << 20], ids=["64KiB", "1MiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_disk_tier(compare: Callable[..., Any], tmp_path: Path, block_bytes: int, op: str) -> None:
    nbytes = BATCH * block_bytes
    keys = prefix_hashes(range(BATCH * 16), 16)
    src = np.random.default_rng(0).integers(0, 256, (BATCH, block_bytes), dtype=np.uint8)
    dst = np.empty_like(src)
    raw = os.open(tmp_path / "raw.bin", os.O_RDWR | os.O_CREAT, 0o600)

    def raw_write() -> None:
        for i in range(BATCH):
            os.pwrite(raw, src[i], i * block_bytes)

    def raw_read() -> None:
        for i in range(BATCH):
            os.preadv(raw, [dst[i]], i * block_bytes)

    raw_write()
    try:
        with TieredStore(
            block_bytes,
            host_capacity=0,
            disk_path=tmp_path / "tier",
            disk_capacity=2 * nbytes,
        ) as store:
            if op == "write":
                compare(
                    f"disk write {block_bytes >> 10} KiB x {BATCH}",
                    lambda: store.put(keys, src),
                    raw_write,
                    setup=lambda: store.remove(keys),
                    baseline_name="os.pwrite",
                    nbytes=nbytes,
                    rounds=15,
                )
            else:
                store.put(keys, src)
                compare(
                    f"disk read {block_bytes >> 10} KiB x {BATCH}",
                    lambda: store.get(keys, dst),
                    raw_read,
                    baseline_name="os.preadv",
                    nbytes=nbytes,
                    rounds=15,
                )
                np.testing.assert_array_equal(dst, src)
    finally:
        os.close(raw)
