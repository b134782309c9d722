"""kvbridge.store: block keys, tiers and the tiered KV-block store.

Public surface:

- :func:`prefix_hashes` and :data:`BlockKey`: chained, deterministic block keys.
- :class:`TieredStore`: device/host/disk tiers with dedup, eviction, pins and checksums.
- Tiers and their building blocks, for custom stacks: :class:`SlotTier`, :class:`HostSlab`,
  :class:`DeviceSlab`, :class:`DiskTier`, :class:`EvictionPolicy` and the policies.
- Typed errors, all subclasses of :class:`StoreError`.
"""

from ._disk import CheckReport, DiskTier
from ._errors import (
    BlockNotFound,
    BlockPinned,
    IncompatibleStore,
    InvalidBlock,
    InvalidKey,
    InvalidTokens,
    LeaseExpired,
    StoreClosed,
    StoreError,
    StoreFull,
    TierUnavailable,
)
from ._keys import KEY_BYTES, BlockKey, HashAlgo, prefix_hashes
from ._pins import DEFAULT_PIN_TTL_S, Lease
from ._policy import FIFO, LRU, POLICIES, EvictionPolicy
from ._sizes import parse_size
from ._slab import DeviceSlab, HostSlab, SlotMemory
from ._slots import SlotTier
from ._stats import StoreStats, TierStats
from ._store import TieredStore
from ._tier import Tier

__all__ = [
    "DEFAULT_PIN_TTL_S",
    "FIFO",
    "KEY_BYTES",
    "LRU",
    "POLICIES",
    "BlockKey",
    "BlockNotFound",
    "BlockPinned",
    "CheckReport",
    "DeviceSlab",
    "DiskTier",
    "EvictionPolicy",
    "HashAlgo",
    "HostSlab",
    "IncompatibleStore",
    "InvalidBlock",
    "InvalidKey",
    "InvalidTokens",
    "Lease",
    "LeaseExpired",
    "SlotMemory",
    "SlotTier",
    "StoreClosed",
    "StoreError",
    "StoreFull",
    "StoreStats",
    "Tier",
    "TierStats",
    "TierUnavailable",
    "TieredStore",
    "parse_size",
    "prefix_hashes",
]
