"""Counters the store keeps, and the snapshot ``TieredStore.stats()`` returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class TierStats:
    name: str
    blocks: int
    bytes: int
    capacity_blocks: int
    capacity_bytes: int
    evictions: int = 0
    """Blocks that left this tier to make room (demoted or dropped)."""


@dataclass
class StoreStats:
    """A snapshot of the store's counters (all counts are blocks unless named bytes)."""

    hits: int = 0
    """Blocks returned by ``get``."""
    misses: int = 0
    """Blocks asked of ``get`` that were absent (or failed their checksum)."""
    puts: int = 0
    """Blocks newly stored by ``put``."""
    duplicates: int = 0
    """Blocks given to ``put`` that were already present (not stored again)."""
    bytes_in: int = 0
    bytes_out: int = 0
    demotions: int = 0
    """Blocks moved down a tier to make room."""
    promotions: int = 0
    """Blocks copied up to the top tier on a hit."""
    evictions: int = 0
    """Blocks dropped from the store entirely to make room."""
    corrupt: int = 0
    """Blocks that failed their checksum on read and were dropped."""
    removed: int = 0
    tiers: list[TierStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
