"""End-to-end block checksums: XXH3-64 of a block's bytes, in order.

The writer computes one per block from the bytes it sends (host memory: for a GPU cache, the
staged copy), the store keeps it beside the block on every tier, and the reader verifies the
bytes once they have landed, before it calls the block loaded. Both hash as the bytes move:
the transfer engine's ``Digests`` (``transfer/_digests.py``), one group per block, gives the
same number as :func:`block_sum`. A block made of pages spread
over several buffers (a KV cache's layers) is hashed as the pages one after another, so its
checksum is the digest of the whole block whatever the layout: the disk tier's own checksum
(``disk/_tier.py``) is the same number.

``NO_SUM`` (0) stands for "no checksum known" (a writer that sends none, a block put locally):
such a block is served unverified. A block whose real XXH3-64 is 0 (one in 2**64) is treated
the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

NO_SUM = 0
MAX_SUM = (1 << 64) - 1


def block_sum(pages: Sequence[memoryview]) -> int:
    """The checksum of a block given as its pages, in order."""
    if len(pages) == 1:
        return int(xxhash.xxh3_64_intdigest(pages[0]))
    digest = xxhash.xxh3_64()
    for page in pages:
        digest.update(page)
    return int(digest.intdigest())


def as_sums(sums: object) -> list[int] | None:
    """``sums`` as a list of checksums, or ``None`` when it is not one (a bad request)."""
    if not isinstance(sums, list) or not all(type(s) is int and 0 <= s <= MAX_SUM for s in sums):
        return None
    return sums


def check_sums(sums: object, count: int) -> list[int] | None:
    """``sums`` as ``count`` checksums, or ``None`` when it is not that."""
    checked = as_sums(sums)
    return checked if checked is not None and len(checked) == count else None
