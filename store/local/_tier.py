"""The tier interface that :class:`~kvbridge.store.TieredStore` stacks.

A tier owns its index (which keys it holds), its capacity and its eviction order (a
policy). It does not decide what to evict or where victims go: the store does, walking
``policy.candidates()``. Callers hold the store's lock; tiers are not thread-safe alone.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from .._buffers import BlockArray
from .._keys import BlockKey
from ._policy import EvictionPolicy

BlockReader = Callable[[BlockKey], "BlockArray | None"]
"""Returns a verified view of a block (valid until the reading context exits), or ``None``
when the stored bytes fail their checksum (the block is then a miss, never wrong data)."""


class Tier(Protocol):
    name: str
    block_bytes: int
    capacity: int
    """Most blocks the tier holds."""
    persistent: bool
    """True when blocks survive a restart; promotion copies out of such a tier, not moves."""
    policy: EvictionPolicy
    index: Container[BlockKey]
    """Live, read-only membership of the tier (a dict or set: ``key in index`` is C-fast)."""

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def keys(self) -> Iterator[BlockKey]: ...

    def store(self, key: BlockKey, src: BlockArray, checksum: int = ...) -> None:
        """Store a new block; the caller has checked ``len(self) < self.capacity``.
        ``checksum``: the block's end-to-end checksum (``_checksums``), carried with it; a
        tier that reads the bytes as it stores them (the disk) raises
        :class:`BlockCorrupt`, storing nothing, when they do not match it."""

    def checksum(self, key: BlockKey) -> int:
        """The end-to-end checksum of ``key`` (present), ``NO_SUM`` when none is known."""

    def position(self, key: BlockKey) -> int | None:
        """The block's slot number in the tier's one buffer, or ``None`` (lets adjacent
        blocks be copied in one piece)."""

    def reserve(self, key: BlockKey) -> BlockArray | None:
        """Index ``key`` in a free slot and return its view for the caller to fill, or
        ``None`` when the tier can only ``store`` whole blocks."""

    def delete(self, key: BlockKey) -> None:
        """Forget ``key`` (present) and free its space."""

    def discard(self, key: BlockKey) -> None:
        """Forget ``key`` (present), found bad on read: unlike ``delete``, this stands even
        when the surrounding batch fails."""

    def touch(self, key: BlockKey) -> None:
        """Record a hit on ``key`` (present) with the policy."""

    def reading(self) -> AbstractContextManager[BlockReader]:
        """A scope in which blocks can be read without copying."""

    def batch(self) -> AbstractContextManager[None]:
        """Group stores and deletes into one commit where the tier has commits."""

    def close(self) -> None: ...
