"""kvbridge.store.local.disk: the disk tier, blocks in LMDB with a checksum each.

``_tier`` (:class:`DiskTier`), ``_reads`` (verified reads, and the prefetch outside the
store's lock), ``_meta`` (meta and checksum records), ``_space`` (the preallocated map: no
SIGBUS on a full disk), ``_faults`` (LMDB's errors as typed store errors).
"""

from __future__ import annotations

from ._tier import FORMAT_VERSION, CheckReport, DiskTier, blocks_within

__all__ = ["FORMAT_VERSION", "CheckReport", "DiskTier", "blocks_within"]
