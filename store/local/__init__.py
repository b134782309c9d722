"""kvbridge.store.local: the tiered store in one process.

:class:`TieredStore` over a stack of tiers (:class:`SlotTier` over host or device memory,
the LMDB :class:`DiskTier` in ``disk/``), its :class:`Placement` (tiers, orders, pins, the
lock and the placement cascade), the eviction policies, and :class:`RemoteAccess`: the
lease protocol (staged puts, resident pins, write admission) a cache server runs over a
store. Imports nothing of ``server``, ``client`` or ``cluster``.
"""

from __future__ import annotations

from .._lease import Lease
from ._pins import DEFAULT_PIN_TTL_S
from ._placement import Placement, Prefetched
from ._policy import ARC, FIFO, LRU, POLICIES, EvictionPolicy, ReuseLRU
from ._remote import RemoteAccess
from ._slab import DeviceSlab, HostSlab, SlotMemory
from ._slots import SlotTier
from ._store import TieredStore
from ._tier import Tier
from .disk import CheckReport, DiskTier, blocks_within

__all__ = [
    "ARC",
    "DEFAULT_PIN_TTL_S",
    "FIFO",
    "LRU",
    "POLICIES",
    "CheckReport",
    "DeviceSlab",
    "DiskTier",
    "EvictionPolicy",
    "HostSlab",
    "Lease",
    "Placement",
    "Prefetched",
    "RemoteAccess",
    "ReuseLRU",
    "SlotMemory",
    "SlotTier",
    "Tier",
    "TieredStore",
    "blocks_within",
]
