"""What :meth:`TieredStore.close` writes: the blocks held only in memory, spilled to the
persistent tier so that a reopened store serves them."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .._errors import BlockCorrupt, StoreError
from .._keys import BlockKey
from ._tier import Tier

SPILL_COMMIT_BYTES = 16 << 20
"""A spill commits every 16 MiB: when the file system fills up (the disk tier's capacity
is only a promise) the commit that fails loses at most that much, and what the commits
before it wrote stays. Commits of 16 MiB cost little next to writing the bytes."""


def spill(tiers: Sequence[Tier], disk: Tier) -> int:
    """Store in ``disk`` the blocks of the memory tiers that it lacks, as many as its free
    room takes, newest first (the top tier first, the most recently used first within a
    tier); it evicts nothing. They are written oldest first, so that the disk's eviction
    order keeps theirs. Returns how many were written; stops at the first commit the disk
    refuses (a full file system), keeping what the commits before it wrote."""
    room = disk.capacity - len(disk)
    chosen: list[tuple[Tier, BlockKey]] = []
    for tier in tiers:
        if tier.persistent:
            continue
        for key in reversed(list(tier.policy.ranking())):
            if len(chosen) >= room:
                break
            if key not in disk:
                chosen.append((tier, key))
    chosen.reverse()
    step = max(1, SPILL_COMMIT_BYTES // disk.block_bytes)
    written = 0
    for start in range(0, len(chosen), step):
        try:
            with disk.batch():
                for tier, key in chosen[start : start + step]:
                    with tier.reading() as read:
                        data = read(key)
                        if data is not None:
                            with contextlib.suppress(BlockCorrupt):  # a bad copy stays out
                                disk.store(key, data, tier.checksum(key))
        except StoreError:
            break
        written += len(chosen[start : start + step])
    return written
