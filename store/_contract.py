"""The store contract: what every kvbridge store does, with the same verbs, argument names
and lease type.

Three stores implement it: :class:`~kvbridge.store.TieredStore` (the tiers in this
process), :class:`~kvbridge.store.StoreClient` (one cache server, ``kvbridge serve``) and
:class:`~kvbridge.store.ClusterClient` (the servers of a cluster). Code that only stores,
finds, reads, pins and removes blocks takes a :class:`BlockStore` and works with any of
them; each store adds what only it can do (a local store's tiers and ``check``, a client's
registered buffers and pages, a cluster's members) under its own name.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, runtime_checkable

from ._lease import Lease


@runtime_checkable
class BlockStore(Protocol):
    """Blocks of ``block_bytes`` bytes, each under a key (``prefix_hashes``)."""

    @property
    def block_bytes(self) -> int:
        """The size of every block of the store."""

    def put(self, keys: Sequence[bytes], blocks: object) -> list[bool]:
        """Store ``blocks`` (one row of ``block_bytes`` per key) under ``keys``; per key,
        whether it was new. All or nothing: ``StoreFull`` stores none of them."""

    def get(self, keys: Sequence[bytes], out: object) -> None:
        """Read the blocks of ``keys`` into ``out`` (one row per key); ``BlockNotFound``
        names every key absent (``out`` is then undefined)."""

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the store holds its block."""

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the store holds (a prefix cache's hit, in blocks)."""

    def pin(self, keys: Sequence[bytes]) -> Lease:
        """Keep the blocks of ``keys`` from eviction until the lease is released or
        expires; ``BlockNotFound``, holding nothing, when one is absent."""

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        """Drop the blocks of ``keys``; per key, whether it was there. ``BlockPinned``
        when a lease pins one (the store, or the member that holds the pinned copy, removes
        nothing)."""

    def clear(self) -> int:
        """Drop every block no lease pins; how many were dropped (a cluster counts each
        member's copy)."""

    def close(self) -> None:
        """Let go of the store (a second close does nothing)."""

    def __enter__(self) -> BlockStore: ...

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
