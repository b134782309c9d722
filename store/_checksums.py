"""End-to-end block checksums: XXH3-64 of a block's bytes, in order.

The writer computes one per block from the bytes it sends (host memory: for a GPU cache, the
staged copy), the store keeps it beside the block on every tier, and the reader verifies the
bytes once they have landed, before it calls the block loaded. Both hash as the bytes move,
with the transfer engine's ``Digests`` (``transfer/_digests.py``), one group per block. A
block made of pages spread over several buffers (a KV cache's layers) is hashed as the pages
one after another, so its checksum is the digest of the whole block whatever the layout:
:func:`block_sum` of the block in one buffer, and the disk tier's own checksum
(``disk/_tier.py``), are the same number.

``NO_SUM`` (0) stands for "no checksum known" (a writer that sends none, a block put locally):
such a block is served unverified. A block whose real XXH3-64 is 0 (one in 2**64) is treated
the same way.
"""

from __future__ import annotations

import xxhash

NO_SUM = 0
MAX_SUM = (1 << 64) - 1


def block_sum(block: memoryview) -> int:
    """The checksum of a block's bytes in one buffer (a block in pages: ``Digests``, one
    group per block, gives the same number)."""
    return int(xxhash.xxh3_64_intdigest(block))


def as_sums(sums: object) -> list[int] | None:
    """``sums`` as a list of checksums, or ``None`` when it is not one (a bad request)."""
    if not isinstance(sums, list) or not all(type(s) is int and 0 <= s <= MAX_SUM for s in sums):
        return None
    return sums


def check_sums(sums: object, count: int) -> list[int] | None:
    """``sums`` as ``count`` checksums, or ``None`` when it is not that."""
    checked = as_sums(sums)
    return checked if checked is not None and len(checked) == count else None
